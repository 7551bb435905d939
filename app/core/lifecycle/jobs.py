"""The job service: submit, read, list and cancel jobs.

Routes (and the OpenAI call service, app/api/completions.py) call these functions, which own
the commits: every change goes through ``changes`` (app/core/lifecycle/changes.py), so a job is
sent, or its dispatcher woken, only after the row is committed, and a worker never receives an id
whose row is not there yet. Status changes are app/core/lifecycle/transitions.py's.

A request becomes a row once, in :func:`new_job`, from its body and its model as the caller
resolved it (``catalog.resolve``, once per request): the :class:`NewJob` is what is inserted
and what the API answers with (``JobOut.from_row``, ``openai_format.JobView``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Text, bindparam, cast, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core import queries
from app.core.contract.jobs import JobCreate
from app.core.errors import DomainError, Kind
from app.core.lifecycle import retention, transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import broker
from app.core.messaging.names import queue_of
from app.core.models import (
    TERMINAL,
    IdempotencyKey,
    Job,
    JobKind,
    JobStatus,
    Lane,
    NewJob,
    new_id,
    now,
    storable,
)
from app.core.scheduling import catalog, fairshare, limits
from app.core.settings import get_settings
from app.core.webhooks import rules

MAX_IDEMPOTENCY_KEY = 255


@dataclass(frozen=True, slots=True)
class BatchLine:
    """Where a batch line's job comes from: its batch, ``custom_id`` and line number; its
    deadline is the batch's expiry (app/batches/validation.py)."""

    batch_id: str
    custom_id: str | None  # None: a job of several lines, whose ``lines`` name them
    number: int
    deadline_at: float


def _fingerprint(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def new_job(
    tenant: str,
    body: JobCreate,
    model: str,
    *,
    checked: set[str] | None = None,
    relay: str | None = None,
    reply_to: str | None = None,
    created: float | None = None,
    line: BatchLine | None = None,
    prompt_tokens: int | None = None,
) -> NewJob:
    """The row of a new job for ``body``, on ``model`` (resolved by the caller). The jobs of one
    request share ``created``, so that with one timeout they share a deadline too (and the
    dispatcher sends those of one prompt prefix together). A batch ``line`` runs on the bulk
    lane until the batch's deadline. ``prompt_tokens``: as ``limits.admit`` counted them (the
    job's charge in the fair share); none, an estimate."""
    settings = get_settings()
    rules.check_webhook_url(body.webhook_url, checked)
    created = now() if created is None else created
    kind = body.kind
    if kind != JobKind.GENERATE:
        # A pooled job's params are its pooling options (dimensions, truncate_prompt_tokens).
        params = body.pooling_options()
    else:
        params = body.params.stored()
        params["max_tokens"] = body.params.max_tokens or settings.default_max_tokens
    constraint = body.tool_constraint()
    # tool_choice required or named: vLLM's way (docs/openai.md, "Tools").
    if constraint is not None:
        params["structured_outputs"] = {"json": constraint}
    batch: tuple[str | None, str | None, int | None] = (None, None, None)
    # One text prompt in ``prompt``; token ids or several prompts in ``inputs``.
    prompt, prompts = body.prompt_row()
    if line is None:
        lane = body.lane.value
        timeout_s = body.timeout_s or settings.lane_default_timeout_s.get(lane)
        deadline_at = created + timeout_s if timeout_s else None
    else:
        lane, timeout_s, deadline_at = Lane.BULK.value, None, line.deadline_at
        batch = (line.batch_id, line.custom_id, line.number)
    return NewJob(
        id=new_id("job"),
        tenant=tenant,
        lane=lane,
        model=model,
        prompt=prompt,
        messages=[m.model_dump(exclude_none=True) for m in body.messages]
        if body.messages is not None
        else None,
        params=params,
        tools=body.tool_spec(),
        webhook_url=body.webhook_url,
        meta=dict(body.metadata),
        end_user=body.user,
        relay=relay,
        reply_to=reply_to,
        timeout_s=timeout_s,
        deadline_at=deadline_at,
        cost=fairshare.cost(body, prompt_tokens),
        prefix=fairshare.prefix_of(body),
        created_at=created,
        batch_id=batch[0],
        custom_id=batch[1],
        batch_line=batch[2],
        kind=kind,
        inputs=body.pooled_inputs() if prompts is None else prompts,
    )


def _replay(session: Session, tenant: str, key: str, fingerprint: str) -> Job | None:
    row = session.get(IdempotencyKey, (tenant, key))
    if row is None:
        return None
    if row.expires_at <= now():
        session.delete(row)
        session.flush()
        return None
    if row.request_hash != fingerprint:
        raise DomainError(
            Kind.INVALID,
            "idempotency_key_reused",
            "this Idempotency-Key was used with a different request body",
            param="Idempotency-Key",
        )
    job = session.get(Job, row.job_id)
    assert job is not None  # the key row cascades with its job
    return job


def submit(
    session: Session,
    tenant: str,
    body: JobCreate,
    model: str,
    caller: limits.Limits,
    idempotency_key: str | None = None,
    *,
    relay: str | None = None,
    reply_to: str | None = None,
    attach: Callable[[NewJob], list[Any]] | None = None,
) -> tuple[NewJob | Job, bool]:
    """Admit (``limits.admit``), commit and send a queued job on ``model``. Returns (job,
    created); created is False for an idempotent replay (the stored job), which sends nothing.
    ``attach`` gives rows that belong to the job (a stored response), committed with it."""
    catalog.check_task(model, body.kind)
    [prompt_tokens] = limits.admit(session, tenant, caller, [body], [model])
    if idempotency_key is not None and not (
        0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY and storable(idempotency_key)
    ):
        raise DomainError(
            Kind.INVALID,
            "invalid_idempotency_key",
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters",
            param="Idempotency-Key",
        )
    job = new_job(tenant, body, model, relay=relay, reply_to=reply_to, prompt_tokens=prompt_tokens)
    fingerprint = _fingerprint(body) if idempotency_key is not None else ""
    if idempotency_key is not None:
        existing = _replay(session, tenant, idempotency_key, fingerprint)
        if existing is not None:
            session.commit()
            return existing, False
    # One job whose queue is empty goes straight to it: nobody waits, so no order is at stake
    # and the dispatcher's step is saved (docs/architecture.md, "Fair share"). Not a job with a
    # prompt prefix in a lane sent by affinity: the dispatcher chooses its worker
    # (docs/scheduling.md, "Prefix affinity").
    settings = get_settings()
    direct = (
        settings.dispatch_direct
        and not (job.prefix and job.lane in settings.affine_lanes)
        and broker.queue_is_empty(queue_of(job.lane, model))
    )
    try:
        with changes("api", session=session) as tx:
            transitions.create(tx, [job], direct=direct)
            if attach is not None:
                session.add_all(attach(job))
            if idempotency_key is not None:
                session.add(
                    IdempotencyKey(
                        tenant=tenant,
                        key=idempotency_key,
                        request_hash=fingerprint,
                        job_id=job.id,
                        created_at=job.created_at,
                        expires_at=job.created_at + get_settings().idempotency_ttl_s,
                    )
                )
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent request with the same key won the insert: answer as its replay.
        existing = _replay(session, tenant, idempotency_key, fingerprint)
        session.commit()
        if existing is None:
            raise
        return existing, False
    return job, True


def submit_many(
    session: Session, tenant: str, bodies: list[JobCreate], models: list[str], caller: limits.Limits
) -> list[NewJob]:
    """Admit, then commit many queued jobs in one transaction (all of them or none), then wake
    their dispatcher. ``models``: each body's, resolved."""
    for i, (body, model) in enumerate(zip(bodies, models, strict=True)):
        try:
            catalog.check_task(model, body.kind)
        except DomainError as exc:
            raise exc.within(f"jobs[{i}]") from None
    counted = limits.admit(session, tenant, caller, bodies, models, "jobs")
    jobs: list[NewJob] = []
    checked: set[str] = set()
    created = now()
    for i, (body, model, prompt_tokens) in enumerate(zip(bodies, models, counted, strict=True)):
        try:
            jobs.append(
                new_job(
                    tenant,
                    body,
                    model,
                    checked=checked,
                    created=created,
                    prompt_tokens=prompt_tokens,
                )
            )
        except DomainError as exc:
            raise exc.within(f"jobs[{i}]") from None
    with changes("api", session=session) as tx:
        transitions.create(tx, jobs)
    return jobs


def get(session: Session, tenant: str | None, job_id: str) -> Job:
    """The tenant's job; 404 ``job_expired`` for one retention has deleted
    (app/core/lifecycle/retention.py), else 404 ``job_not_found``."""
    try:
        return queries.owned(session, Job, tenant, job_id, "job")
    except DomainError:
        gone = retention.expired(session, tenant, job_id)
        if gone is None:
            raise
        raise DomainError(
            Kind.NOT_FOUND,
            "job_expired",
            f"job {job_id!r} has expired: {retention.kept_for(gone)}",
            param="id",
        ) from None


@dataclass(frozen=True)
class Listed:
    """A page of jobs. ``searched_to``: a search that read its whole window (the scope's
    ``console_search_window`` newest jobs after the cursor) without filling the page names the
    oldest job it read, and the next window starts below it (``after``); None when it read to
    the scope's first job or filled the page."""

    rows: list[Job]
    has_more: bool
    searched_to: str | None = None


def list_page(
    session: Session,
    tenant: str | None,
    *,
    status: str | None,
    lane: str | None,
    limit: int,
    after: str | None,
    model: str | None = None,
    batch_id: str | None = None,
    search: str | None = None,
) -> Listed:
    """Newest first. ``after`` is the last id of the previous page (ids sort by time);
    ``search`` finds a text in a job's id or its metadata (keys and values), in a window of the
    scope's newest jobs, so that a text no job has reads a bounded number of rows, not every
    job retention keeps (docs/console.md, "Jobs")."""
    scope = queries.scoped(session, select(Job), Job.tenant, tenant)
    query = scope
    if status is not None:
        # Written into the statement as a literal (quoted by the dialect), so that even a
        # generic plan knows how rare the status is and takes ix_jobs_tenant_status: with
        # ``status = $1`` it walked the tenant's whole history for a status none of it has
        # (tests/integration/test_query_plans.py; models.live says why generic plans).
        query = query.where(Job.status == bindparam("status", status, literal_execute=True))
    if lane is not None:
        query = query.where(Job.lane == lane)
    if model is not None:
        query = query.where(Job.model == model)
    if batch_id is not None:
        query = query.where(Job.batch_id == batch_id)
    if not search:
        return Listed(*queries.page(session, query, Job.id, limit, after))
    # The window's oldest id: the scope's index (the primary key, or ix_jobs_tenant_id) walked
    # ``window`` entries, whatever the other filters; they and the text apply inside it.
    window = get_settings().console_search_window
    bound_query = scope.with_only_columns(Job.id).order_by(Job.id.desc())
    if queries.cursor(after) is not None:
        bound_query = bound_query.where(Job.id < after)
    # The window's oldest and the job below it: none below, the window reached the first job.
    edge = list(session.scalars(bound_query.offset(window - 1).limit(2)))
    bound = edge[0] if edge else None
    if bound is not None:
        query = query.where(Job.id >= bound)
    query = query.where(
        or_(
            Job.id.contains(search, autoescape=True),
            cast(Job.meta, Text).contains(search, autoescape=True),
        )
    )
    rows, has_more = queries.page(session, query, Job.id, limit, after)
    return Listed(rows, has_more, bound if len(edge) == 2 and not has_more else None)


def cancel(session: Session, tenant: str | None, job_id: str) -> tuple[Job, bool]:
    """Cancel a job. Returns (job, running): True when its worker was told to abort it."""
    job = get(session, tenant, job_id)
    with changes("api", session=session) as tx:
        transitions.cancel(tx, job.id, now())
    session.refresh(job)
    return job, bool(tx.after.abort) and job.status == JobStatus.RUNNING


def wait_until_terminal(session: Session, job: Job, timeout_s: float) -> Job:
    """Poll the row briefly so a cancel usually answers with the final state."""
    deadline = time.monotonic() + timeout_s
    while job.status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.05)
        session.refresh(job)
        session.commit()
    return job
