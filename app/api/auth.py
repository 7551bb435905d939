"""The request's tenant: the bearer key checked on every /v1 route, and the key's limits."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from app.api.deps import get_session
from app.core import limits
from app.core.errors import DomainError, Kind
from app.core.keys import DEFAULT_TENANT, key_for
from app.core.settings import get_settings


def current_tenant(request: Request, session: Annotated[Session, Depends(get_session)]) -> str:
    """FastAPI dependency: the tenant of the request's bearer key (limits: ``caller_limits``)."""
    if not get_settings().require_auth:
        request.state.limits = limits.defaults()
        return DEFAULT_TENANT
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise DomainError(
            Kind.UNAUTHENTICATED,
            "missing_api_key",
            "an API key is required: send `Authorization: Bearer <key>`",
        )
    row = key_for(session, token.strip())
    found = None
    if row is not None:
        # Read before the rollback: it expires the row, and reading it afterwards would open
        # a transaction that holds SQLite's write lock until the request ends.
        found = (row.tenant, (row.requests_per_minute, row.tokens_per_minute, row.max_queued))
    session.rollback()  # end the read transaction; the route opens its own
    if found is None:
        raise DomainError(
            Kind.UNAUTHENTICATED, "invalid_api_key", "the API key is invalid or revoked"
        )
    tenant, overrides = found
    request.state.limits = limits.for_key(*overrides)
    return tenant


def caller_limits(request: Request) -> limits.Limits:
    """The limits of the key that authenticated ``request``."""
    found: limits.Limits = getattr(request.state, "limits", None) or limits.defaults()
    return found


Tenant = Annotated[str, Depends(current_tenant)]
