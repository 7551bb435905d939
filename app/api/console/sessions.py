"""The console's sign-in: one session per browser, kept in Redis, named by an HttpOnly cookie.

- ``POST /console/login`` with an API key: the key is checked as /v1 checks it
  (app/core/tenants/keys.py) and a session is made: a random id in the cookie (HttpOnly,
  SameSite=Strict, Secure over https) and, in Redis under the id's SHA-256, the key's tenant,
  whether it is an operator's key, the key's id and the session's CSRF token, for
  ``INFERQ_CONSOLE_SESSION_S``. The key itself is never kept, nor put in a URL.
- Every page reads the session and checks that its key is still live: a revoked key signs out
  at its next page.
- Every action (a POST) carries the session's CSRF token, in its form or in the
  ``X-CSRF-Token`` header, compared in constant time (:func:`check_csrf`).
- With keys off (``INFERQ_REQUIRE_AUTH=false``) there is no key to sign in with, and /v1 is
  open: the first page makes a session as the operator (docs/console.md).
- With Redis away no session can be read or made: every function here raises the
  ``broker_unavailable`` refusal (503), as /v1 does when it cannot admit a call.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import redis

from app.core.db import session_scope
from app.core.errors import BROKER_DOWN, DomainError, Kind, unavailable
from app.core.messaging import clients
from app.core.messaging.names import CONSOLE_SESSION_PREFIX
from app.core.models import ApiKey
from app.core.settings import get_settings
from app.core.tenants.keys import DEFAULT_TENANT, key_for

COOKIE = "inferq_console"
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-CSRF-Token"


@dataclass(frozen=True)
class Viewer:
    """Who is looking: a tenant, or the operator (every tenant)."""

    tenant: str
    operator: bool
    csrf: str
    key_id: str | None = None  # None: keys are off

    @property
    def scope(self) -> str | None:
        """The tenant the console's reads are scoped to (app/core/queries.py): None for the
        operator, who reads every tenant's."""
        return None if self.operator else self.tenant


def _address(session_id: str) -> str:
    # Only a hash is a key in Redis: a copy of Redis does not hold live cookies.
    return CONSOLE_SESSION_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()


@contextlib.contextmanager
def _redis() -> Iterator[redis.Redis]:
    """This process's Redis client; Redis away is a 503."""
    try:
        yield clients.redis_client()
    except redis.RedisError:
        raise unavailable(*BROKER_DOWN) from None


def _keep(viewer: Viewer) -> str:
    """Store ``viewer`` as a new session; returns its id (the cookie's value)."""
    session_id = secrets.token_urlsafe(32)
    ttl = int(get_settings().console_session_s)
    with _redis() as client:
        client.set(_address(session_id), json.dumps(asdict(viewer)), ex=ttl)
    return session_id


def sign_in(key: str) -> tuple[str, Viewer]:
    """A session for the holder of ``key`` (401 when it is unknown or revoked)."""
    with session_scope() as session:
        row = key_for(session, key.strip())
        if row is None:
            raise DomainError(
                Kind.UNAUTHENTICATED, "invalid_api_key", "the API key is invalid or revoked"
            )
        viewer = Viewer(row.tenant, row.operator, secrets.token_urlsafe(32), row.id)
    return _keep(viewer), viewer


def open_session() -> tuple[str, Viewer]:
    """A session with keys off: the operator's."""
    viewer = Viewer(DEFAULT_TENANT, True, secrets.token_urlsafe(32))
    return _keep(viewer), viewer


def viewer_of(session_id: str | None) -> Viewer | None:
    """The session's viewer, if the session exists and its key is still live."""
    if not session_id:
        return None
    with _redis() as client:
        raw = client.get(_address(session_id))
    if raw is None:
        return None
    viewer = Viewer(**json.loads(raw))
    if viewer.key_id is not None:
        with session_scope() as session:
            row = session.get(ApiKey, viewer.key_id)
            if row is None or row.revoked_at is not None:
                sign_out(session_id)
                return None
    elif get_settings().require_auth:
        return None  # made while keys were off; they are on now
    return viewer


def sign_out(session_id: str | None) -> None:
    if session_id:
        with _redis() as client:
            client.delete(_address(session_id))


def check_csrf(viewer: Viewer, token: str | None) -> None:
    """Refuse an action whose CSRF token is not the session's (403)."""
    if not token or not hmac.compare_digest(token.encode(), viewer.csrf.encode()):
        raise DomainError(
            Kind.FORBIDDEN,
            "csrf_failed",
            "the action's CSRF token is missing or wrong: reload the page and try again",
        )
