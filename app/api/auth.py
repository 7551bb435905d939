"""The request's tenant: the bearer key checked on every /v1 route, the key's limits, and
whether it is an operator's (the admin routes')."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from app.core.db import new_session
from app.core.errors import DomainError, Kind
from app.core.scheduling import limits
from app.core.settings import get_settings
from app.core.tenants.keys import DEFAULT_TENANT, key_for

_Found = tuple[str, tuple[int | None, int | None, int | None], bool]


async def current_tenant(request: Request) -> str:
    """FastAPI dependency: the tenant of the request's bearer key (limits: ``caller_limits``).

    Async and with its own session: a sync dependency, or one on the route's session, costs
    thread hops on every call, the realtime lane's included (docs/benchmarks.md, "What each
    change bought"); with keys off it does no I/O at all.
    """
    if not get_settings().require_auth:
        request.state.limits = limits.defaults()
        request.state.operator = True  # keys off: one user, the console's operator too
        return DEFAULT_TENANT
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise DomainError(
            Kind.UNAUTHENTICATED,
            "missing_api_key",
            "an API key is required: send `Authorization: Bearer <key>`",
        )
    found = await run_in_threadpool(_lookup, token.strip())
    if found is None:
        raise DomainError(
            Kind.UNAUTHENTICATED, "invalid_api_key", "the API key is invalid or revoked"
        )
    tenant, overrides, operator = found
    request.state.limits = limits.for_key(*overrides)
    request.state.operator = operator
    return tenant


def _lookup(token: str) -> _Found | None:
    session = new_session()
    try:
        row = key_for(session, token)
        if row is None:
            return None
        overrides = (row.requests_per_minute, row.tokens_per_minute, row.max_queued)
        return row.tenant, overrides, row.operator
    finally:
        # Ends the read transaction: left open, it would hold SQLite's write lock.
        session.close()


def caller_limits(request: Request) -> limits.Limits:
    """The limits of the key that authenticated ``request``."""
    found: limits.Limits = getattr(request.state, "limits", None) or limits.defaults()
    return found


Tenant = Annotated[str, Depends(current_tenant)]


async def operator(request: Request, tenant: Tenant) -> str:
    """FastAPI dependency of the admin routes: the request's key must be an operator's
    (``inferq keys create --admin``; every request is the operator's with keys off)."""
    if not getattr(request.state, "operator", False):
        raise DomainError(
            Kind.FORBIDDEN,
            "operator_key_required",
            "this route is the operator's: use a key made with `inferq keys create --admin`",
        )
    return tenant


Operator = Annotated[str, Depends(operator)]
