"""OpenAI's Responses API: /v1/responses. A response runs as a job (app/core/openai/responses.py);
a foreground one answers when its job ends (app/api/completions.py), a background one at once
with ``status: "queued"``, to be polled from any API process (docs/openai.md, "Responses")."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from app.api import completions, response_stream
from app.api.auth import Tenant, caller_limits
from app.api.deps import SessionDep
from app.api.schemas import ErrorBody
from app.core import queries
from app.core.db import session_scope
from app.core.errors import DomainError, Kind
from app.core.messaging import relay
from app.core.models import Job, JobStatus, StoredResponse, response_id_of
from app.core.openai import responses
from app.core.openai.openai_format import job_error
from app.core.openai.responses_format import ResponseCreate

router = APIRouter(prefix="/v1", tags=["responses"], responses={"default": {"model": ErrorBody}})


def _prepare(tenant: str, body: ResponseCreate) -> responses.Prepared:
    with session_scope() as session:
        return responses.prepare(session, tenant, body)


@router.post("/responses", response_model=None)
async def create_response(body: ResponseCreate, request: Request, tenant: Tenant) -> Response:
    """A response; ``background: true`` answers at once (``queued``), else when it has ended;
    ``stream: true`` answers with OpenAI's events as it runs."""
    prepared = await run_in_threadpool(_prepare, tenant, body)
    if body.stream and not body.background:
        return await response_stream.foreground(prepared, request, tenant)
    if body.background:
        # Streamed: its job relays to a kept log that any API process can follow.
        chat = prepared.chat.model_copy(update={"stream": body.stream})
        reply_to = relay.log_address() if body.stream else None
        job = await run_in_threadpool(
            completions.enqueue, chat, tenant, caller_limits(request), prepared.attach, reply_to
        )
        if body.stream:
            row, stored = await run_in_threadpool(_stored, tenant, response_id_of(job.id))
            return await response_stream.follow(row, stored, request, None)
        return JSONResponse(prepared.render(job), headers={completions.JOB_HEADER: job.id})
    ended = await completions.outcome(prepared.chat, request, tenant, prepared.attach)
    if ended is None:
        return Response(status_code=499)  # the caller left: its job is cancelled
    if ended.status != JobStatus.SUCCEEDED:
        raise job_error(ended)
    return JSONResponse(prepared.render(ended), headers={completions.JOB_HEADER: ended.id})


def _stored(tenant: str, response_id: str) -> tuple[StoredResponse, Job]:
    """The tenant's stored response and its job, read once, for use outside the session."""
    with session_scope() as session:
        row, job = responses.get(session, tenant, response_id)
        session.expunge_all()
        return row, job


@router.get("/responses/{response_id}", response_model=None)
async def get_response(
    response_id: str,
    tenant: Tenant,
    request: Request,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=-1)] = None,
) -> Response:
    """A stored response as it is now (poll a background one until it has ended); with
    ``stream=true``, its events, after ``starting_after`` (a resumed stream)."""
    row, job = await run_in_threadpool(_stored, tenant, response_id)
    if stream:
        return await response_stream.follow(row, job, request, starting_after)
    if starting_after is not None:
        raise DomainError(
            Kind.INVALID,
            "invalid_starting_after",
            "starting_after goes with stream=true",
            param="starting_after",
        )
    return JSONResponse(responses.render(row, job))


@router.post("/responses/{response_id}/cancel")
def cancel_response(response_id: str, tenant: Tenant, session: SessionDep) -> dict[str, Any]:
    """Cancel a background response (queued: at once; running: aborted in the engine)."""
    return responses.render(*responses.cancel(session, tenant, response_id))


@router.delete("/responses/{response_id}")
def delete_response(response_id: str, tenant: Tenant, session: SessionDep) -> dict[str, Any]:
    responses.delete(session, tenant, response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.get("/responses/{response_id}/input_items")
def input_items(
    response_id: str,
    tenant: Tenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1)] = 20,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """The input items of a stored response, newest first unless ``order=asc``."""
    items, has_more = responses.input_items(
        session, tenant, response_id, order=order, limit=queries.check_limit(limit), after=after
    )
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }
