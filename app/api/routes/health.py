"""Liveness and readiness probes, the Prometheus page and Prometheus's service discovery of
the workers (no authentication)."""

from __future__ import annotations

import redis
from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError

from app.api.metrics import api_exposition
from app.core.db import session_scope
from app.core.errors import unavailable
from app.core.messaging import clients
from app.core.observe import missing
from app.core.processes import presence

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


def database_ok() -> bool:
    try:
        with session_scope() as session:
            session.execute(text("SELECT 1"))
        return True
    except SQLAlchemyError:
        return False


@router.get("/readyz")
def readyz() -> dict[str, object]:
    """The database and Redis both answer (503 when not). A part of the deployment whose work
    waits with no live process to do it (app/core/observe/missing.py) makes the answer ``degraded``
    and is listed under ``missing``, still with 200: readiness takes an API pod out of its
    Service, and an API that cannot be reached does not bring a dispatcher or a worker back;
    it only stops submissions, polls and cancels too (docs/architecture.md, "No silent
    waits")."""
    checks = {
        "database": "ok" if database_ok() else "unavailable",
        "redis": "ok" if clients.redis_ok() else "unavailable",
    }
    down = [name for name, state in checks.items() if state != "ok"]
    if down:
        raise unavailable("not_ready", f"unavailable: {', '.join(down)}")
    try:
        found = missing.current()
    except (SQLAlchemyError, redis.RedisError):
        raise unavailable("not_ready", "unavailable: database or redis") from None
    return {
        "status": "degraded" if found else "ready",
        **checks,
        "missing": [m.as_dict() for m in found],
    }


@router.get("/metrics", include_in_schema=False)
def metrics() -> Response:
    """Prometheus exposition (docs/observability.md)."""
    body, content_type = api_exposition()
    return Response(body, media_type=content_type)


@router.get("/metrics/targets", include_in_schema=False)
def metrics_targets() -> JSONResponse:
    """Prometheus HTTP service discovery (``http_sd_configs``): the /metrics of every live
    inference worker and ops worker, from their presence records (docs/observability.md)."""
    try:
        groups = presence.metrics_targets(clients.redis_client())
    except redis.RedisError:
        # Not an empty list: Prometheus keeps the targets it last discovered while this fails,
        # and would drop every worker on an empty answer.
        raise unavailable(
            "broker_unavailable", "the worker registry (Redis) is unavailable; retry later"
        ) from None
    return JSONResponse(groups)
