"""A response's stream of OpenAI's server-sent events (``event: <type>`` and ``data: {...}``,
each with its ``sequence_number``), made by ``responses_format.EventLog`` from the job's relay
messages.

- **Foreground** (``stream: true``): the relay's pub/sub, as a streamed chat call
  (app/api/completions.py); a caller that leaves cancels the response.
- **Background** (``background: true`` and ``stream: true``): the job relays to a kept log in
  Redis (app/core/messaging/relay.py), which any API process follows, from the start or after
  ``starting_after``; a caller that leaves changes nothing. A background response created
  without ``stream``, or whose log has expired, streams from its row instead: its output comes
  whole, once it has ended (docs/openai.md, "Responses").
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.api import completions
from app.core.db import session_scope
from app.core.errors import DomainError, Kind
from app.core.messaging import relay
from app.core.models import TERMINAL, Job, JobStatus, StoredResponse, response_id_of
from app.core.openai import responses
from app.core.openai.openai_format import Ended, job_error
from app.core.openai.responses_format import EventLog

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ROW_CHECK_S = 2.0  # while a followed log is quiet, the job's row is read this often
END_GRACE_S = 10.0  # how long an ended job's end message is waited for in its kept log


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def foreground(prepared: responses.Prepared, request: Request, tenant: str) -> Response:
    """Stream a response as its job runs, over the relay's pub/sub."""
    chat = prepared.chat.model_copy(update={"stream": True})
    call, first = await completions.start(chat, request, tenant, prepared.attach)
    if first is None:
        return Response(status_code=499)
    if not isinstance(first, relay.Entry) and first.status != JobStatus.SUCCEEDED:
        await call.close()
        raise job_error(first)  # before any output: a plain HTTP error, as with OpenAI
    log = EventLog(response_id_of(call.job.id), prepared.render(call.job))

    async def events() -> AsyncGenerator[str, None]:
        sent = 0
        async for item in completions.followed(call, first):
            if isinstance(item, relay.Entry):
                log.piece(item.token, item.text or "", item.calls)
            else:
                log.end(prepared.render(item))
            if log.restarted:
                call.let_go()  # the response goes on; GET /v1/responses/{id} has its end
            for event in log.events[sent:]:
                yield sse(event)
            sent = len(log.events)
            if log.done:
                return

    headers = {**HEADERS, completions.JOB_HEADER: call.job.id}
    return completions.EventStream(call, events(), headers)


def _load(job_id: str) -> Job:
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise DomainError(Kind.NOT_FOUND, "response_not_found", "the response was deleted")
        session.expunge(job)
        return job


async def follow(
    row: StoredResponse, job: Job, request: Request, starting_after: int | None
) -> Response:
    """Stream a background response (``row``, with its ``job`` as just read) from its kept log
    (or its row), from the start or after ``starting_after``; refuses a ``starting_after``
    past the last event made so far."""
    log = EventLog(row.id, responses.opening(row, job))
    kept = relay.is_log(job.reply_to) and job.relay == "tokens"
    cursor = "0"

    async def read(block_s: float) -> bool:
        """Feed the log every kept message there is (waiting up to ``block_s`` for a first
        one); True if there was any."""
        nonlocal cursor
        if not kept or job.reply_to is None:
            return False
        found = False
        while not log.done:
            entries = await relay.read_log(job.reply_to, cursor, block_s)
            for log_id, entry in entries:
                cursor = log_id
                if entry.text is not None:
                    log.piece(entry.token, entry.text, entry.calls)
                elif entry.ended is not None:
                    log.end(responses.render(row, Ended.of(job, entry.ended)))
            found = found or bool(entries)
            if len(entries) < relay.READ_COUNT:
                break
            block_s = 0
        return found

    terminal_at: float | None = None

    async def from_row() -> None:
        """End from the row a job that ended with no end message kept: never relayed, its
        log expired, or the message lost with Redis. While its log exists the end message is
        waited for (``END_GRACE_S``): the worker sends it just after its commit, and a stream
        ended from the row would number its events otherwise than one read from the log."""
        nonlocal job, terminal_at
        job = await run_in_threadpool(_load, row.job_id)
        if job.status not in TERMINAL or log.done:
            return
        if kept and job.reply_to is not None and await relay.log_exists(job.reply_to):
            terminal_at = terminal_at or time.monotonic()
            if time.monotonic() - terminal_at < END_GRACE_S:
                return
        log.end(responses.render(row, job))

    await read(0)
    if not log.done:
        await from_row()
    # A starting_after past the events made so far may be one another process has made
    # already: wait for them a while before refusing it.
    deadline = time.monotonic() + END_GRACE_S
    while (
        starting_after is not None
        and starting_after >= len(log.events)
        and not log.done
        and time.monotonic() < deadline
    ):
        if not await read(relay.POLL_S):
            if not kept:
                await anyio.sleep(relay.POLL_S)
            await from_row()
    if starting_after is not None and starting_after >= len(log.events):
        raise DomainError(
            Kind.INVALID,
            "invalid_starting_after",
            f"starting_after is {starting_after}: this response's last event so far is "
            f"{len(log.events) - 1}",
            param="starting_after",
        )

    async def events() -> AsyncGenerator[str, None]:
        sent = 0 if starting_after is None else starting_after + 1
        checked = time.monotonic()
        while True:
            for event in log.events[sent:]:
                yield sse(event)
            sent = max(sent, len(log.events))
            if log.done or await request.is_disconnected():
                return  # a background response goes on without its reader
            if kept and await read(relay.POLL_S):
                continue
            if not kept:
                await anyio.sleep(relay.POLL_S)
            if time.monotonic() - checked >= ROW_CHECK_S or not kept:
                checked = time.monotonic()
                await from_row()

    headers = {**HEADERS, completions.JOB_HEADER: row.job_id}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
