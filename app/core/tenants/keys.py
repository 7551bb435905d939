"""API keys: made, looked up and revoked (the CLI and `inferq up` make them; the API checks them;
a deployment's first operator key can come from a Secret, ``ensure_key``).

A key is ``iq_`` followed by 32 random bytes (base62-ish via token_urlsafe); only its SHA-256 is
stored, so a database leak does not leak keys. Keys have enough entropy that a fast hash is
the right choice (a slow password hash would cost latency on every request for nothing).
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from app.core.errors import DomainError, Kind
from app.core.models import ApiKey, new_id, now

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
    weight: float | None = None,
    operator: bool = False,
) -> tuple[ApiKey, str]:
    """Create a key for ``tenant``; returns the row and the plaintext, which is never stored.

    The three limits override the settings' defaults for calls made with this key; ``weight``
    is the tenant's in the fair share (app/core/scheduling/fairshare.py; None: 1); an ``operator``
    key signs in to the console as the operator, who sees every tenant (docs/console.md).
    """
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    row = _store(
        session,
        tenant,
        name,
        plaintext,
        requests_per_minute=requests_per_minute,
        tokens_per_minute=tokens_per_minute,
        max_queued=max_queued,
        weight=weight,
        operator=operator,
    )
    return row, plaintext


def _store(session: Session, tenant: str, name: str, plaintext: str, **fields: Any) -> ApiKey:
    """The row of ``plaintext`` (its hash and prefix, never itself), added and flushed."""
    row = ApiKey(
        id=new_id("key"),
        tenant=tenant,
        name=name,
        prefix=plaintext[:10],
        key_hash=hash_key(plaintext),
        created_at=now(),
        **fields,
    )
    session.add(row)
    session.flush()
    return row


MIN_GIVEN_KEY = 32  # characters of a key made elsewhere (create_key's are 46)


def ensure_key(
    session: Session, tenant: str, plaintext: str, name: str = "", *, operator: bool = False
) -> tuple[ApiKey, bool]:
    """A key whose plaintext was made elsewhere (a deployment's Secret): its row, and whether
    it was created now. A key already stored, live or revoked, is left as it is: a revoked one
    is not brought back by the next deployment."""
    if not plaintext.startswith(KEY_PREFIX) or len(plaintext) < MIN_GIVEN_KEY:
        raise DomainError(
            Kind.INVALID,
            "invalid_key",
            f"a key must start with {KEY_PREFIX!r} and hold at least {MIN_GIVEN_KEY} characters",
        )
    found = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(plaintext)))
    if found is not None:
        return found, False
    return _store(session, tenant, name, plaintext, operator=operator), True


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
