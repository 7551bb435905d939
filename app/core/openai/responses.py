"""Stored responses of OpenAI's Responses API: each one is a job of the chat kind (it runs with
everything a job has: leases, the reaper, fair share, metrics) and a row beside it
(``StoredResponse``, committed with the job) with what the job does not hold.

- **Ids**: a response's id is its job's with another prefix (``resp_X`` runs as ``job_X``), so
  ``GET /v1/jobs/job_X`` shows its timings and attempts.
- **A conversation** (``previous_response_id``) goes on from a stored, completed response of
  the same tenant: the next job's messages are the previous one's conversation (its input
  items, after its own previous ones), its output as the assistant's turn, then the new input;
  the previous ``instructions`` are not carried on (OpenAI's rule).
- **Not stored** (``store: false``): the job runs and answers its caller, and no row is
  written: it cannot be retrieved or continued, as with OpenAI.
- **Cancel** is for background responses (a caller waiting on a foreground one cancels it by
  going away); **delete** removes the response with its job, once it has ended.

docs/openai.md, "Responses".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from app.core.errors import DomainError, Kind
from app.core.lifecycle import jobs, retention, transitions
from app.core.lifecycle.changes import changes
from app.core.models import (
    TERMINAL,
    Job,
    JobStatus,
    NewJob,
    StoredResponse,
    response_id_of,
    storable,
)
from app.core.openai.openai_format import ChatCompletionRequest, Ended, JobView
from app.core.openai.responses_format import (
    ResponseCreate,
    assistant_turn,
    item_id,
    response_object,
)


@dataclass(frozen=True)
class Prepared:
    """A request made ready to submit: the chat request it runs as, and the rows to commit
    with its job (none when it is not stored)."""

    body: ResponseCreate
    chat: ChatCompletionRequest
    context: list[dict[str, Any]]  # the conversation this response's job continues

    def attach(self, job: NewJob) -> list[Any]:
        if not self.body.store:
            return []
        response_id = response_id_of(job.id)
        conversation = self.context + self.body.input_messages()
        return [
            StoredResponse(
                id=response_id,
                tenant=job.tenant,
                job_id=job.id,
                previous_response_id=self.body.previous_response_id,
                request=json.dumps(self.body.echo()),
                input=json.dumps(_input_items(response_id, self.body)),
                context=json.dumps(conversation),
                service_tier=self.chat.tier_used,
                background=self.body.background,
                created_at=job.created_at,
            )
        ]

    def render(self, job: JobView | NewJob | Job) -> dict[str, Any]:
        """The Response object of this request's job: as it ended, or just committed."""
        if isinstance(job, NewJob):
            job = _queued(job)
        return response_object(response_id_of(job.id), job, self.body.echo(), self.chat.tier_used)


def prepare(session: Session, tenant: str, body: ResponseCreate) -> Prepared:
    """The chat request a response runs as, with the conversation it continues; refuses a
    ``previous_response_id`` that cannot be continued, naming it (nothing is written)."""
    context = _previous_context(session, tenant, body.previous_response_id)
    return Prepared(body, body.chat(context), context)


def _previous_context(
    session: Session, tenant: str, previous_id: str | None
) -> list[dict[str, Any]]:
    if previous_id is None:
        return []
    row, job = get(session, tenant, previous_id, param="previous_response_id")
    if job.status not in TERMINAL:
        raise DomainError(
            Kind.CONFLICT,
            "previous_response_in_progress",
            f"response {previous_id!r} has not finished: continue it once it has",
            param="previous_response_id",
        )
    if job.status != JobStatus.SUCCEEDED:
        raise DomainError(
            Kind.INVALID,
            "previous_response_not_completed",
            f"response {previous_id!r} ended {job.status} with no output to continue from",
            param="previous_response_id",
        )
    turns: list[dict[str, Any]] = json.loads(row.context)
    return [*turns, assistant_turn(job)]


def get(
    session: Session, tenant: str, response_id: str, *, param: str = "response_id"
) -> tuple[StoredResponse, Job]:
    """The tenant's stored response and its job, else 404 ``response_not_found``."""
    row = session.get(StoredResponse, response_id) if storable(response_id) else None
    job = session.get(Job, row.job_id) if row is not None and row.tenant == tenant else None
    if row is None or job is None:
        # A response's id is its job's with another prefix (response_id_of).
        own = response_id.startswith("resp_")
        gone = (
            retention.expired(session, tenant, "job_" + response_id.removeprefix("resp_"))
            if own
            else None
        )
        if gone is not None:
            raise DomainError(
                Kind.NOT_FOUND,
                "response_expired",
                f"stored response {response_id!r} has expired: {retention.kept_for(gone)}",
                param=param,
            )
        raise DomainError(
            Kind.NOT_FOUND,
            "response_not_found",
            f"no stored response {response_id!r} (a response made with store: false is not kept)",
            param=param,
        )
    return row, job


def render(row: StoredResponse, job: JobView) -> dict[str, Any]:
    return response_object(row.id, job, json.loads(row.request), row.service_tier)


def opening(row: StoredResponse, job: Job) -> dict[str, Any]:
    """The response as it was created (queued, no output): what its stream's first events
    carry, the same whenever the stream is read."""
    return render(row, _queued(job))


def _queued(job: NewJob | Job) -> Ended:
    return Ended(
        job.id, job.created_at, job.model, job.messages, JobStatus.QUEUED,
        None, None, None, None, None, None, None,
    )  # fmt: skip


def cancel(session: Session, tenant: str, response_id: str) -> tuple[StoredResponse, Job]:
    """Cancel a background response: a queued one ends at once, a running one is aborted in
    the engine; a finished one is left as it is (OpenAI answers it unchanged)."""
    row, job = get(session, tenant, response_id)
    if not json.loads(row.request).get("background"):
        raise DomainError(
            Kind.CONFLICT,
            "response_not_background",
            "only a background response can be cancelled: a caller waiting on one cancels "
            "it by closing the connection",
            param="response_id",
        )
    job, _ = jobs.cancel(session, tenant, job.id)
    return row, jobs.wait_until_terminal(session, job, 2.0)


def delete(session: Session, tenant: str, response_id: str) -> None:
    """Remove a finished response with its job; 409 while it runs (cancel it first)."""
    _, job = get(session, tenant, response_id)
    with changes("api", session=session) as tx:
        removed = transitions.delete_finished(tx, Job.id == job.id)
    if not removed:
        raise DomainError(
            Kind.CONFLICT,
            "response_in_progress",
            f"response {response_id!r} is {job.status}: cancel it, or delete it once it ends",
            param="response_id",
        )


def input_items(
    session: Session, tenant: str, response_id: str, *, order: str, limit: int, after: str | None
) -> tuple[list[dict[str, Any]], bool]:
    """The response's input items, ``desc`` (newest first, OpenAI's default) or ``asc``."""
    row, _ = get(session, tenant, response_id)
    items: list[dict[str, Any]] = json.loads(row.input)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise DomainError(
                Kind.INVALID, "invalid_cursor", f"no input item {after!r}", param="after"
            )
        items = items[ids.index(after) + 1 :]
    return items[:limit], len(items) > limit


def _input_items(response_id: str, body: ResponseCreate) -> list[dict[str, Any]]:
    return [
        {"id": item_id(response_id, "msg" if item["type"] == "message" else "item", i), **item}
        for i, item in enumerate(body.input_items())
    ]
