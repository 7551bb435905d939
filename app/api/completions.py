"""An OpenAI call served as a job: submit it, follow its relay, answer with the committed outcome.

Each call is a job (realtime lane unless the body says ``lane``): it registers for its job's
relay (app/core/messaging/relay.py), submits the job with that address, and answers with what the
worker committed (the relay's end message carries it; the row is the backstop). With
``stream: true`` the answer is server-sent events in OpenAI's chunk format, relayed as the
engine produces them, ending with ``data: [DONE]``. The response headers wait for the first
piece of output, so a job that fails before producing any (a prompt longer than the context)
is a plain HTTP error, as with OpenAI. A caller that goes away cancels its job, which aborts
it in the engine. A call for a model that no live worker serves (scaled to zero) waits
``INFERQ_MODEL_WAIT_S`` for one and then answers 503 with nothing written: the caller waits on
the line, and a job that might start minutes later would answer nobody
(app/core/scheduling/catalog.py).
"""

from __future__ import annotations

import functools
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from app.api.auth import caller_limits
from app.api.errors import body_of, error_body
from app.core.contract.jobs import JobCreate
from app.core.db import session_scope
from app.core.errors import DomainError, Kind
from app.core.lifecycle import jobs
from app.core.messaging import relay
from app.core.models import TERMINAL, Job, JobStatus, NewJob
from app.core.openai.openai_format import (
    CHAT,
    REQUEST_ERRORS,
    ChatCompletionRequest,
    CompletionRequest,
    Ended,
    JobView,
    chat_logprobs,
    choices_of,
    chunk,
    completion_logprobs,
    endpoint_of,
    job_error,
    response_body,
    unsent,
)
from app.core.scheduling import catalog
from app.core.scheduling.limits import Limits
from app.core.settings import get_settings

log = logging.getLogger("inferq.api")
JOB_HEADER = "inferq-job-id"
ROW_CHECK_S = 5.0  # while the relay is quiet, the job's row is read this often
MODEL_RETRY_S = 10  # Retry-After of a call whose model has no worker: a worker's start


class CallBody(Protocol):
    """An OpenAI call's body, as a job: chat, completions, or a pooled endpoint's
    (app/api/pooling.py)."""

    @property
    def model(self) -> str: ...
    @property
    def stream(self) -> bool: ...
    def job(self) -> JobCreate: ...


def _submit(
    tenant: str,
    body: CallBody,
    model: str,
    caller: Limits,
    reply_to: str | None,
    attach: Callable[[NewJob], list[Any]] | None = None,
) -> NewJob | Job:
    """Commit the call's job; with ``reply_to``, its worker relays to that address (every
    piece of output when streaming, else the end)."""
    relay_mode = None if reply_to is None else "tokens" if body.stream else "end"
    with session_scope() as session:
        try:
            job, _ = jobs.submit(
                session,
                tenant,
                body.job(),
                model,
                caller,
                relay=relay_mode,
                reply_to=reply_to,
                attach=attach,
            )
        except DomainError as exc:
            # OpenAI answers a prompt longer than the context as an invalid request (400), and
            # so does the engine's refusal here (job_error); /v1/jobs keeps 422.
            if exc.code in REQUEST_ERRORS:
                raise exc.replace(kind=Kind.MALFORMED) from None
            raise
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


class _Left(Exception):
    """The caller disconnected."""


class _Call:
    """One caller waiting on its job: the relay, the row as backstop, and the cleanup."""

    def __init__(
        self, request: Request, tenant: str, job: NewJob | Job, waiter: relay.Waiter
    ) -> None:
        self.request = request
        self.tenant = tenant
        self.job = job
        self.waiter = waiter
        self.finished = False  # the caller got the job's end: nothing to cancel
        self._checked = time.monotonic()

    async def next(self) -> relay.Entry | JobView:
        """The next piece of output, or the job as committed once it has ended (raises
        _Left)."""
        while True:
            entry = await self.waiter.next()
            if entry is not None and entry.text is not None:
                return entry
            if entry is not None and entry.ended is not None:
                self.finished = True
                return Ended.of(self.job, entry.ended)
            # A quiet second: the row is the backstop for an end message that was lost
            # (Redis restarted, say); it costs a query every ROW_CHECK_S.
            if time.monotonic() - self._checked >= ROW_CHECK_S:
                self._checked = time.monotonic()
                try:
                    row = await run_in_threadpool(_load, self.job.id)
                except (OperationalError, InterfaceError) as exc:
                    # The database is away: the job is not, and neither is its caller. Keep
                    # waiting (the relay may still bring the end); the row is read again later.
                    log.warning("could not read job %s while waiting: %s", self.job.id, exc)
                    continue
                if row.status in TERMINAL:
                    self.finished = True
                    return row
            if await self.request.is_disconnected():
                raise _Left

    def let_go(self) -> None:
        """The caller was told that the job goes on without it (it restarted on another
        worker, and what was streamed cannot be taken back): closing cancels nothing."""
        self.finished = True

    async def close(self) -> None:
        """Stop listening; a caller that leaves before its job ends cancels the job."""
        self.waiter.close()
        if not self.finished:
            _abandon(self.tenant, self.job.id)


class EventStream(StreamingResponse):
    """SSE whose end, however it comes (done, disconnect, cancellation), closes the call."""

    def __init__(self, call: _Call, events: AsyncGenerator[str, None], headers: dict[str, str]):
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.call = call
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()
                await self.call.close()


async def _served(requested: str | None) -> str:
    """The model the call names, resolved (``catalog.resolve``, once a call); refuses an
    unknown model (404), or one with no live worker once ``INFERQ_MODEL_WAIT_S`` has passed
    without one announcing itself (503)."""
    model = catalog.resolve(requested)
    if catalog.ready(model):
        return model
    wait_s = get_settings().model_wait_s
    if not await run_in_threadpool(catalog.wait_ready, model, wait_s):
        raise DomainError(
            Kind.UNAVAILABLE,
            "model_not_ready",
            f"no worker serves {model!r} right now (waited {wait_s:g} s); retry later, or "
            "submit it to /v1/jobs, where it waits for a worker",
            param="model",
            retry_after_s=MODEL_RETRY_S,
        )
    return model


async def start(
    body: CallBody,
    request: Request,
    tenant: str,
    attach: Callable[[NewJob], list[Any]] | None = None,
) -> tuple[_Call, relay.Entry | JobView | None]:
    """Submit the call's job and wait for its first piece of output (streaming) or its end;
    None when the caller left first (the call is closed then, which cancels the job)."""
    model = await _served(body.model)
    waiter = await relay.replies().register()
    try:
        job = await run_in_threadpool(
            _submit, tenant, body, model, caller_limits(request), waiter.reply_to, attach
        )
    except BaseException:
        waiter.close()
        raise
    call = _Call(request, tenant, job, waiter)
    try:
        # The first piece of output (streaming) or the end: an error before the first piece
        # is a plain HTTP error, as with OpenAI.
        return call, await call.next()
    except _Left:
        await call.close()
        return call, None
    except BaseException:
        await call.close()
        raise


async def outcome(
    body: ChatCompletionRequest,
    request: Request,
    tenant: str,
    attach: Callable[[NewJob], list[Any]] | None = None,
) -> JobView | None:
    """A call answered once its job has ended: the job as committed (None: the caller left).
    ``attach``: rows committed with the job (a stored response)."""
    call, ended = await start(body, request, tenant, attach)
    if ended is None:
        return None  # _start closed the call: the job is cancelled
    await call.close()
    assert not isinstance(ended, relay.Entry)  # not streamed: the relay brings only the end
    return ended


def enqueue(
    body: ChatCompletionRequest,
    tenant: str,
    caller: Limits,
    attach: Callable[[NewJob], list[Any]] | None = None,
    reply_to: str | None = None,
) -> NewJob | Job:
    """A call that answers at once (a background response): its job is committed and waits,
    like any job, for a worker of its model; nobody waits on the line, so it relays only to a
    kept log (``reply_to``: ``relay.log_address()``), if to anything."""
    return _submit(tenant, body, catalog.resolve(body.model), caller, reply_to, attach)


async def followed(
    call: _Call, first: relay.Entry | JobView
) -> AsyncGenerator[relay.Entry | JobView, None]:
    """A streamed call's pieces of output as they come, then its job as committed; stops
    early when the caller leaves (``EventStream`` then closes the call, cancelling the job)."""
    item = first
    try:
        while isinstance(item, relay.Entry):
            yield item
            item = await call.next()
    except _Left:
        return
    yield item


async def complete(
    body: ChatCompletionRequest | CompletionRequest, request: Request, tenant: str
) -> Response:
    call, first = await start(body, request, tenant)
    if first is None:
        return Response(status_code=499)
    headers = {JOB_HEADER: call.job.id}
    if not isinstance(first, relay.Entry):
        await call.close()
        if first.status != JobStatus.SUCCEEDED:
            raise job_error(first)
        if not body.stream:
            return JSONResponse(response_body(first, body.tier_used), headers=headers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return EventStream(
        call,
        _events(call, first, include_usage, body.tier_used, body.n),
        {**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _missed(calls: list[dict[str, Any]], sent: dict[int, list[str]]) -> list[dict[str, Any]]:
    """The pieces of a choice's committed ``calls`` that were not streamed (``sent``: the
    argument pieces sent, by call): a call none of whose pieces came whole, the rest of one
    whose arguments came in part."""
    rest: list[dict[str, Any]] = []
    for at, made in enumerate(calls):
        arguments = made["function"]["arguments"]
        if at not in sent:
            rest.append({"index": at, **made})
            continue
        missed = unsent(arguments, "".join(sent[at]))
        if missed:
            rest.append({"index": at, "function": {"arguments": missed}})
    return rest


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _events(
    call: _Call, first: relay.Entry | JobView, include_usage: bool, tier: str, n: int
) -> AsyncGenerator[str, None]:
    """The SSE body: each choice's role, pieces as they come (each with its choice's index:
    text, or a message's content and pieces of its tool calls, and its tokens' logprobs), the
    rest of each committed message, each finish, usage; every chunk echoes the service
    ``tier``."""
    job = call.job
    tiered = functools.partial(chunk, tier=tier)
    chat = endpoint_of(job) == CHAT
    if chat:
        for index in range(n):
            yield _sse(tiered(job, role=True, text="", index=index))
    sent: dict[int, list[str]] = {}
    # by choice, then by call: the arguments sent so far
    sent_calls: dict[int, dict[int, list[str]]] = {}
    sent_logprobs: dict[int, list[dict[str, Any]]] = {}  # by choice: its tokens' sent so far

    def rendered(index: int, tokens: list[dict[str, Any]]) -> dict[str, Any] | None:
        """``tokens``' logprobs as a chunk of choice ``index`` has them (None: none)."""
        if not tokens:
            return None
        before = sent_logprobs.setdefault(index, [])
        at = sum(len(t["token"]) for t in before)
        before += tokens
        return chat_logprobs(tokens) if chat else completion_logprobs(tokens, at)

    token = first.token if isinstance(first, relay.Entry) else None
    final: JobView | None = None
    async for item in followed(call, first):
        if not isinstance(item, relay.Entry):
            final = item
        elif item.token != token:
            # The job was handed to another worker and starts over: what was sent cannot be
            # taken back. The job itself goes on; its result is at GET /v1/jobs/{id}.
            message = f"the job restarted on another worker; see GET /v1/jobs/{job.id}"
            call.let_go()
            yield _sse(error_body(409, "job_restarted", message, None))
            yield _sse("[DONE]")
            return
        elif item.text or item.calls or item.logprobs:
            if item.text:
                sent.setdefault(item.index, []).append(item.text)
            for piece in item.calls:
                made = sent_calls.setdefault(item.index, {}).setdefault(piece["index"], [])
                made.append(piece.get("function", {}).get("arguments") or "")
            yield _sse(
                tiered(
                    job,
                    text=item.text or None,
                    index=item.index,
                    calls=item.calls,
                    logprobs=rendered(item.index, item.logprobs),
                )
            )
    if final is None:
        return  # the caller left: EventStream closes the call, which cancels the job
    if final.status == JobStatus.SUCCEEDED:
        for choice in choices_of(final):
            index = choice["index"]
            # A choice with tool calls says its content apart from its text.
            result = (choice["content"] if "content" in choice else choice["text"]) or ""
            text = "".join(sent.get(index, []))
            # Pieces the relay lost (Redis restarted, say): the row has the whole message.
            missed = unsent(result, text)
            rest = _missed(choice.get("tool_calls") or [], sent_calls.get(index, {}))
            tokens = (choice.get("logprobs") or [])[len(sent_logprobs.get(index, [])) :]
            if missed or rest or tokens:
                yield _sse(
                    tiered(
                        final,
                        text=missed or None,
                        index=index,
                        calls=rest,
                        logprobs=rendered(index, tokens),
                    )
                )
            yield _sse(
                tiered(
                    final,
                    finish_reason=choice["finish_reason"],
                    index=index,
                    stop_reason=choice.get("stop_reason"),
                )
            )
        if include_usage:
            yield _sse(tiered(final, with_usage=True))
    else:
        yield _sse(body_of(job_error(final)))
    yield _sse("[DONE]")
