"""Relaying a running job's output from its worker to the API request that waits for it.

A job submitted through ``/v1/chat/completions`` or ``/v1/completions`` is still a job: the row
is the truth. The relay only makes waiting fast. Each such job has a Redis stream,
``inferq:relay:<job id>``; the worker appends

- ``{"t": <lease token>, "d": <text>}`` for each piece of output (jobs with ``relay="tokens"``),
- ``{"t": <lease token>, "end": "1"}`` once the job's outcome is committed (every relayed job).

A stream, not pub/sub: the reader can start after the writer (the API reads from the first
entry), and a reader that reconnects misses nothing. Streams expire ``relay_ttl_s`` after
their last entry. The reader also looks at the row now and then when the stream is quiet, so a
lost entry (Redis restarted, a worker killed) delays an answer but never loses it.

The worker side (:class:`Publisher`) runs on a thread of its own: the engine's loop thread only
puts pieces on a queue, and pieces of one job that queued up meanwhile go out as one entry.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import cast

import redis
import redis.asyncio

from app.core.settings import get_settings

log = logging.getLogger("inferq.relay")

KEY_PREFIX = "inferq:relay:"
POLL_S = 1.0
READ_COUNT = 512
MAX_PENDING = 100_000  # pieces waiting for Redis in one worker


def key(job_id: str) -> str:
    return KEY_PREFIX + job_id


# --- worker side ------------------------------------------------------------------------------


class Publisher:
    """Appends relay entries from any thread; a failed write is logged, never raised."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._ttl = max(1, int(get_settings().relay_ttl_s))
        # (job id, lease token, text or None for the end marker)
        self._queue: queue.SimpleQueue[tuple[str, int, str | None]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="relay", daemon=True)
        self._thread.start()

    def piece(self, job_id: str, token: int, text: str) -> None:
        # While Redis is away pieces would pile up: past a bound they are dropped (the API
        # sends what a stream missed from the committed row); end markers never are.
        if self._queue.qsize() < MAX_PENDING:
            self._queue.put((job_id, token, text))

    def end(self, job_id: str, token: int) -> None:
        self._queue.put((job_id, token, None))

    def _loop(self) -> None:
        while True:
            items = [self._queue.get()]
            while len(items) < READ_COUNT:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(items)
            except redis.RedisError as exc:
                # The API falls back to reading the row; tokens of this moment are not shown.
                log.warning("relaying %d entries failed: %s", len(items), exc)

    def _write(self, items: list[tuple[str, int, str | None]]) -> None:
        entries: list[tuple[str, dict[str, str]]] = []
        for job_id, token, text in items:
            last = entries[-1][1] if entries and entries[-1][0] == job_id else {}
            if text is not None and "d" in last and last["t"] == str(token):
                last["d"] += text  # pieces that queued up meanwhile: one entry
                continue
            fields = {"t": str(token), "end": "1"} if text is None else {"t": str(token), "d": text}
            entries.append((job_id, fields))
        pipe = self._client.pipeline(transaction=False)
        for job_id, fields in entries:
            pipe.xadd(key(job_id), fields)  # type: ignore[arg-type]
        for job_id in dict.fromkeys(job_id for job_id, _ in entries):
            pipe.expire(key(job_id), self._ttl)
        pipe.execute()


# --- API side ---------------------------------------------------------------------------------


@dataclass
class Entry:
    token: int
    text: str | None  # None: the outcome is committed


_async_client: redis.asyncio.Redis | None = None


def async_client() -> redis.asyncio.Redis:
    """The API's asyncio Redis client (one per process, like dispatch's sync client)."""
    global _async_client
    if _async_client is None:
        timeout = get_settings().dependency_timeout_s
        _async_client = redis.asyncio.Redis.from_url(
            get_settings().redis_url,
            socket_connect_timeout=timeout,
            # A read blocks up to POLL_S on the server, so the socket waits longer than that.
            socket_timeout=POLL_S + timeout,
            health_check_interval=30,
        )
    return _async_client


async def follow(job_id: str) -> AsyncGenerator[Entry | None, None]:
    """Entries of a job's relay as they arrive; ``None`` each time ``POLL_S`` passes quietly.

    The caller checks the job row on ``None`` and stops when it is terminal. Redis errors
    count as quiet time, so a caller keeps polling the row while Redis is away.
    """
    client = async_client()
    last = "0-0"
    while True:
        try:
            answer = await client.xread(
                {key(job_id): last}, count=READ_COUNT, block=int(POLL_S * 1000)
            )
        except redis.RedisError as exc:
            log.warning("reading the relay of %s failed: %s", job_id, exc)
            await asyncio.sleep(POLL_S)  # as long as a quiet read would have blocked
            answer = None
        if not answer:
            yield None
            continue
        # RESP2 answer: [(key, [(entry id, {field: value})])]
        streams = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", answer)
        for _stream, items in streams:
            for entry_id, fields in items:
                last = entry_id.decode()
                token = int(fields[b"t"])
                if b"end" in fields:
                    yield Entry(token, None)
                else:
                    yield Entry(token, fields[b"d"].decode())
