"""API keys and the request's tenant.

A key is ``iq_`` followed by 32 random bytes (base62-ish via token_urlsafe); only its SHA-256 is
stored, so a database leak does not leak keys. Keys have enough entropy that a fast hash is
the right choice (a slow password hash would cost latency on every request for nothing).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.api.errors import ApiError
from app.core import limits
from app.core.db import get_session
from app.core.models import ApiKey, new_id, now
from app.core.settings import get_settings

KEY_PREFIX = "iq_"
DEFAULT_TENANT = "default"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_key(
    session: Session,
    tenant: str,
    name: str = "",
    *,
    requests_per_minute: int | None = None,
    tokens_per_minute: int | None = None,
    max_queued: int | None = None,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; returns the row and the plaintext, which is never stored.

    The three limits override the settings' defaults for calls made with this key.
    """
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        id=new_id("key"),
        tenant=tenant,
        name=name,
        prefix=plaintext[:10],
        key_hash=hash_key(plaintext),
        created_at=now(),
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        max_queued=max_queued,
    )
    session.add(row)
    session.flush()
    return row, plaintext


def revoke_key(session: Session, key_id: str) -> bool:
    result = session.execute(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=now())
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


def key_for(session: Session, key: str) -> ApiKey | None:
    """The live key row for a plaintext key (None: unknown or revoked)."""
    # The lookup is by hash, so comparing hashes in SQL is not a timing oracle on the key.
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(key)))
    if row is None or row.revoked_at is not None:
        return None
    return row


def current_tenant(request: Request, session: Annotated[Session, Depends(get_session)]) -> str:
    """FastAPI dependency: the tenant of the request's bearer key (limits: ``caller_limits``)."""
    if not get_settings().require_auth:
        request.state.limits = limits.defaults()
        return DEFAULT_TENANT
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(
            401,
            "missing_api_key",
            "an API key is required: send `Authorization: Bearer <key>`",
            headers=challenge,
        )
    row = key_for(session, token.strip())
    found = None
    if row is not None:
        # Read before the rollback: it expires the row, and reading it afterwards would open
        # a transaction that holds SQLite's write lock until the request ends.
        found = (row.tenant, (row.requests_per_minute, row.tokens_per_minute, row.max_queued))
    session.rollback()  # end the read transaction; the route opens its own
    if found is None:
        raise ApiError(
            401, "invalid_api_key", "the API key is invalid or revoked", headers=challenge
        )
    tenant, overrides = found
    request.state.limits = limits.for_key(*overrides)
    return tenant


def caller_limits(request: Request) -> limits.Limits:
    """The limits of the key that authenticated ``request``."""
    found: limits.Limits = getattr(request.state, "limits", None) or limits.defaults()
    return found


Tenant = Annotated[str, Depends(current_tenant)]
