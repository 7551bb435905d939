"""The operator's routes for a tenant: /v1/admin/tenants/{tenant}, what is kept of its history
(app/core/lifecycle/retention.py does the work; docs/api.md, "What is kept"). An operator's key
only (``inferq keys create --admin``); the same as ``inferq tenant retention``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from app.api.auth import Operator
from app.api.deps import SessionDep
from app.api.schemas import ErrorBody, TenantOut, TenantUpdate
from app.core.lifecycle import retention

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses={"default": {"model": ErrorBody}})

# A tenant is named as `inferq keys create --tenant` names it: up to 64 characters (the
# column's), none a control character (PostgreSQL's text refuses NUL).
TenantName = Annotated[str, Path(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]+$")]


@router.get("/tenants/{tenant}", response_model=TenantOut)
def get_tenant(tenant: TenantName, _: Operator, session: SessionDep) -> TenantOut:
    """A tenant's retention (its own and the one in force) and where its history ends."""
    return TenantOut.of(retention.kept(session, tenant))


@router.post("/tenants/{tenant}", response_model=TenantOut)
def update_tenant(
    tenant: TenantName, body: TenantUpdate, _: Operator, session: SessionDep
) -> TenantOut:
    """Give the tenant its own retention (seconds, 0: forever), or null for the default."""
    retention.set_retention(session, tenant, body.job_retention_s)
    return TenantOut.of(retention.kept(session, tenant))
