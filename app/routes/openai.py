"""OpenAI-compatible realtime endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Each call is a job (realtime lane unless the body says ``lane``): the route submits it, then
waits on the job's relay (app/relay.py) and answers from the committed row. With
``stream: true`` the answer is server-sent events in OpenAI's chunk format, relayed as the
engine produces them, ending with ``data: [DONE]``. The response headers wait for the first
piece of output, so a job that fails before producing any (a prompt longer than the context)
is a plain HTTP error, as with OpenAI. A caller that goes away cancels its job, which aborts
it in the engine.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app import jobs, relay
from app.auth import Tenant
from app.db import session_scope
from app.errors import error_body
from app.models import TERMINAL, Job, JobStatus
from app.openai_compat import (
    CHAT,
    ChatCompletionRequest,
    CompletionRequest,
    chunk,
    endpoint_of,
    job_error,
    response_body,
)
from app.schemas import ErrorBody
from app.settings import get_settings

log = logging.getLogger("inferq.api")
router = APIRouter(prefix="/v1", tags=["openai"], responses={"default": {"model": ErrorBody}})
JOB_HEADER = "inferq-job-id"


def _model_card() -> dict[str, Any]:
    return {"id": get_settings().model_name, "object": "model", "created": 0, "owned_by": "inferq"}


@router.get("/models")
def list_models(_tenant: Tenant) -> dict[str, Any]:
    """The served model (one per deployment)."""
    return {"object": "list", "data": [_model_card()]}


@router.get("/models/{model_id:path}")
def get_model(model_id: str, _tenant: Tenant) -> dict[str, Any]:
    jobs.check_model(model_id)
    return _model_card()


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: Tenant
) -> JSONResponse | StreamingResponse:
    """Chat completion as a job; ``stream: true`` relays tokens as they are produced."""
    return await _complete(body, request, tenant)


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, tenant: Tenant
) -> JSONResponse | StreamingResponse:
    """Text completion as a job; ``stream: true`` relays tokens as they are produced."""
    return await _complete(body, request, tenant)


# --- the job behind a call ------------------------------------------------------------------


def _submit(tenant: str, body: ChatCompletionRequest | CompletionRequest) -> Job:
    job_body = body.job()
    jobs.require_broker()
    with session_scope() as session:
        job, _ = jobs.submit(session, tenant, job_body, relay="tokens" if body.stream else "end")
        jobs.send(session, [(job.id, job.lane)])
    return job


def _load(job_id: str) -> Job:
    with session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None  # jobs are not deleted while their caller waits
        return job


def _abandon(tenant: str, job_id: str) -> None:
    """The caller went away: cancel its job, from a thread (this task may be cancelled)."""

    def cancel() -> None:
        try:
            with session_scope() as session:
                jobs.cancel(session, tenant, job_id)
        except Exception:
            log.exception("could not cancel job %s after its caller left", job_id)

    threading.Thread(target=cancel, name=f"abandon-{job_id}", daemon=True).start()


async def _complete(
    body: ChatCompletionRequest | CompletionRequest, request: Request, tenant: str
) -> JSONResponse | StreamingResponse:
    job = await run_in_threadpool(_submit, tenant, body)
    headers = {JOB_HEADER: job.id}
    stream = relay.follow(job.id)
    first: relay.Entry | None = None
    final: Job | None = None
    try:
        # Until the first piece of output (streaming) or the end (not streaming).
        async for entry in stream:
            if entry is not None and entry.text is not None:
                first = entry
                break
            row = await run_in_threadpool(_load, job.id)
            if row.status in TERMINAL:
                final = row
                break
            if await request.is_disconnected():
                _abandon(tenant, job.id)
                return JSONResponse({}, 499)
    except BaseException:
        _abandon(tenant, job.id)
        await _close(stream)
        raise
    if final is not None:
        await _close(stream)
        if final.status != JobStatus.SUCCEEDED:
            raise job_error(final)
        if not body.stream:
            return JSONResponse(response_body(final), headers=headers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _events(request, tenant, job, stream, first, final, include_usage)
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _close(stream: AsyncGenerator[relay.Entry | None, None]) -> None:
    """Close the relay reader, also from a task that is being cancelled."""
    with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
        await stream.aclose()


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(
    request: Request,
    tenant: str,
    job: Job,
    stream: AsyncGenerator[relay.Entry | None, None],
    first: relay.Entry | None,
    final: Job | None,
    include_usage: bool,
) -> AsyncIterator[str]:
    """The SSE body: role, pieces as they come, the rest of the committed text, finish, usage."""
    sent: list[str] = []
    token = first.token if first is not None else None
    done = False
    try:
        if endpoint_of(job) == CHAT:
            yield _sse(chunk(job, role=True, text=""))
        if first is not None and first.text:
            sent.append(first.text)
            yield _sse(chunk(job, text=first.text))
        while final is None:
            entry = await anext(stream)
            if entry is None or entry.text is None:
                row = await run_in_threadpool(_load, job.id)
                if row.status in TERMINAL:
                    final = row
                elif await request.is_disconnected():
                    return
                else:
                    yield ": waiting\n\n"  # an SSE comment: keeps proxies from timing out
                continue
            if entry.token != token:
                # The job was handed to another worker and starts over: what was sent cannot
                # be taken back. The job itself goes on; its result is at GET /v1/jobs/{id}.
                yield _sse(
                    error_body(
                        409,
                        "job_restarted",
                        f"the job restarted on another worker; see GET /v1/jobs/{job.id}",
                        None,
                    )
                )
                yield _sse("[DONE]")
                done = True
                return
            if entry.text:
                sent.append(entry.text)
                yield _sse(chunk(job, text=entry.text))
            if await request.is_disconnected():
                return
        if final.status == JobStatus.SUCCEEDED:
            text, result = "".join(sent), final.result_text or ""
            if len(result) > len(text) and result.startswith(text):
                # Pieces the relay lost (Redis restarted, say): the row has the whole text.
                yield _sse(chunk(final, text=result[len(text) :]))
            yield _sse(chunk(final, finish_reason=final.finish_reason))
            if include_usage:
                yield _sse(chunk(final, with_usage=True))
        else:
            error = job_error(final)
            yield _sse(error_body(error.status, error.code, error.message, None))
        yield _sse("[DONE]")
        done = True
    finally:
        if not done:
            _abandon(tenant, job.id)
        await _close(stream)
