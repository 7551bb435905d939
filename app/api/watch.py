"""The API's log of what the deployment lacks: at start, what in Redis's configuration can
lose a message (``clients.durability_warnings``); then a warning when a part of the deployment
whose work waits has no live process (app/core/observe/missing.py), repeated once a minute while it
lasts, and a line when it is back. Runs in each API process for its lifetime (``lifespan`` in
app/api/main.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis
from fastapi import FastAPI
from sqlalchemy.exc import SQLAlchemyError

from app.core.messaging import clients
from app.core.observe import missing

log = logging.getLogger("inferq.missing")

CHECK_S = 5.0  # how often it looks: a missing part is logged within seconds of showing
REPEAT_S = 60.0  # ... and again once a minute while it lasts


async def watch(check_s: float = CHECK_S, repeat_s: float = REPEAT_S) -> None:
    logged: dict[tuple[str, str | None], float] = {}  # (part, model) -> when last logged
    while True:
        await asyncio.sleep(check_s)
        try:
            found = await asyncio.to_thread(missing.current)
        except (SQLAlchemyError, redis.RedisError) as exc:  # /readyz says which is down
            log.debug("could not look for missing parts: %s", exc)
            continue
        now = time.monotonic()
        current = {(m.part, m.model): m for m in found}
        for key, part in current.items():
            if now - logged.get(key, -repeat_s) >= repeat_s:
                log.warning("missing %s: %s", part.part, part.message())
                logged[key] = now
        for key in list(logged):
            if key not in current:
                del logged[key]
                log.info("%s: nothing waits for a missing one any more", key[1] or key[0])


@contextlib.asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    """At start, what in Redis's configuration can lose a message; then the watcher."""
    await asyncio.to_thread(clients.warn_if_not_durable)
    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
