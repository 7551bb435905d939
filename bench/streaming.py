"""The streaming client of the serving scenarios (``peer``, ``overhead``): the same on every side.

``clients`` concurrent clients, each sending its next request when the previous one has ended
(``vllm bench serve``'s closed loop), on one asyncio loop so that the client costs little CPU
next to the servers it measures. Each request streams (``stream: true``, usage included) and
is recorded with what the client saw: when it was sent, when each content chunk arrived, when
it ended, and the job id inferq answers in a header (``inferq-job-id``), which joins it to the
job's own timestamps.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx

JOB_HEADER = "inferq-job-id"


async def _one(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    created = time.time()
    try:
        return await _stream(client, path, body, created)
    except httpx.TransportError as exc:
        # A dropped connection is the server's failure to report (``failed`` in the
        # summary), not a reason to lose the whole run.
        return {
            "created_at": created,
            "finished_at": time.time(),
            "status": "failed",
            "error": repr(exc),
        }


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], created: float
) -> dict[str, Any]:
    times: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", path, json=body) as r:
        r.raise_for_status()
        job_id = r.headers.get(JOB_HEADER)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    times.append(time.time())
    return {
        "job_id": job_id,
        "created_at": created,
        "first_token_at": times[0] if times else None,
        "finished_at": time.time(),
        "token_times": times,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", len(times)),
        "status": "succeeded",
    }


async def _all(
    url: str,
    path: str,
    bodies: list[dict[str, Any]],
    clients: int,
    progress: Callable[[int], None],
) -> list[dict[str, Any] | None]:
    records: list[dict[str, Any] | None] = [None] * len(bodies)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(bodies)):
        queue.put_nowait(i)
    # Idle connections expire well before a server's keep-alive timeout (uvicorn's: 5 s), so
    # the client never sends on a connection the server is closing at that moment.
    limits = httpx.Limits(
        max_connections=clients, max_keepalive_connections=clients, keepalive_expiry=1.0
    )
    done = 0
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def loop() -> None:
            nonlocal done
            while not queue.empty():
                i = queue.get_nowait()
                records[i] = await _one(client, path, bodies[i])
                done += 1
                progress(done)

        await asyncio.gather(*(loop() for _ in range(clients)))
    return records


def stream_all(
    url: str,
    path: str,
    bodies: list[dict[str, Any]],
    clients: int,
    progress: Callable[[int], None] = lambda done: None,
    *,
    skip: int = 0,
) -> list[dict[str, Any]]:
    """Stream every body to ``url`` + ``path`` with ``clients`` concurrent clients; the
    records of all but the first ``skip`` bodies (a warm-up inside the same closed loop, so
    the measured requests are the steady state, not the start's burst of ``clients`` at
    once)."""
    records = asyncio.run(_all(url, path, bodies, clients, progress))
    return [r for r in records[skip:] if r is not None]
