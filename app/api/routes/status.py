"""``GET /v1/admin/status``: what `inferq status` shows, as JSON (docs/api.md, "Status").

The same snapshot the command reads itself where no API answers (app/core/observe/snapshot.py
takes it; app/core/observe/shapes.py is its JSON form). An operator's key only: it names every
tenant and every worker's host.
"""

from __future__ import annotations

from typing import Any

import redis
from fastapi import APIRouter

from app.api.auth import Operator
from app.api.deps import SessionDep
from app.api.schemas import ErrorBody
from app.core.errors import BROKER_DOWN, unavailable
from app.core.messaging import clients
from app.core.observe import shapes, snapshot
from app.core.settings import get_settings

router = APIRouter(prefix="/v1/admin", tags=["admin"], responses={"default": {"model": ErrorBody}})


@router.get("/status")
def get_status(_: Operator, session: SessionDep) -> dict[str, Any]:
    """Each lane's messages and jobs, each tenant's share, the workers, ops workers and
    dispatchers announced, the last minute's throughput and the warnings `inferq status` shows
    (a database that does not answer: 503, as on every route)."""
    try:
        taken = snapshot.take(clients.redis_client(), session, get_settings())
    except redis.RedisError:
        raise unavailable(*BROKER_DOWN) from None
    return shapes.to_json(taken)
