"""The job service: submit, read, list and cancel, with the transactions they need.

Routes call these functions; they own the commits. Submission writes the job row (and its
Idempotency-Key) in one transaction and enqueues only after that commit, so a worker can never
receive an id whose row is not there yet. Status changes are made by app/core/transitions.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core import catalog, dispatch, fairshare, queries, transitions, webhooks
from app.core.errors import DomainError, Kind, unavailable
from app.core.models import TERMINAL, IdempotencyKey, Job, JobStatus, new_id, now
from app.core.schemas import JobCreate, storable
from app.core.settings import get_settings

MAX_IDEMPOTENCY_KEY = 255


def _fingerprint(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_webhook_url(url: str | None, checked: set[str] | None = None) -> None:
    """Refuse a webhook_url the ops worker would not call; ``checked`` skips repeats."""
    if url is None or (checked is not None and url in checked):
        return
    try:
        webhooks.check_url(url, get_settings().webhook_allow_private)
    except webhooks.WebhookUrlError as exc:
        if exc.temporary:  # DNS did not answer: the URL may well be fine
            raise unavailable("dns_unavailable", str(exc), param="webhook_url") from None
        raise DomainError(
            Kind.INVALID, "webhook_url_refused", str(exc), param="webhook_url"
        ) from None
    if checked is not None:
        checked.add(url)


def job_values(
    tenant: str,
    body: JobCreate,
    *,
    checked: set[str] | None = None,
    relay: str | None = None,
    reply_to: str | None = None,
    created: float | None = None,
) -> dict[str, Any]:
    """The row of a new queued job for ``body`` (``transitions.new_row``); the jobs of one
    request share ``created``, so that with one timeout they share a deadline too (and the
    dispatcher sends those of one prompt prefix together)."""
    settings = get_settings()
    check_webhook_url(body.webhook_url, checked)
    created = now() if created is None else created
    timeout_s = body.timeout_s or settings.lane_default_timeout_s.get(body.lane.value)
    params = body.params.stored()
    params["max_tokens"] = body.params.max_tokens or settings.default_max_tokens
    constraint = body.tool_constraint()
    if constraint is not None:  # tool_choice required or named: vLLM's way (README, "Tools")
        params["structured_outputs"] = {"json": constraint}
    return transitions.new_row(
        id=new_id("job"),
        tenant=tenant,
        lane=body.lane.value,
        model=catalog.resolve(body.model),
        prompt=body.prompt,
        messages=[m.model_dump(exclude_none=True) for m in body.messages]
        if body.messages is not None
        else None,
        params=params,
        webhook_url=body.webhook_url,
        meta=dict(body.metadata),
        end_user=body.user,
        tools=body.tool_spec(),
        relay=relay,
        reply_to=reply_to,
        timeout_s=timeout_s,
        deadline_at=created + timeout_s if timeout_s else None,
        cost=fairshare.cost(body),
        prefix=fairshare.prefix_of(body),
        created_at=created,
        updated_at=created,
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
    idempotency_key: str | None = None,
    *,
    relay: str | None = None,
    reply_to: str | None = None,
) -> tuple[Job, bool]:
    """Commit and enqueue a queued job. Returns (job, created); created is False for an
    idempotent replay, which enqueues nothing."""
    if idempotency_key is not None and not (
        0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY and storable(idempotency_key)
    ):
        raise DomainError(
            Kind.INVALID,
            "invalid_idempotency_key",
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters",
            param="Idempotency-Key",
        )
    row = job_values(tenant, body, relay=relay, reply_to=reply_to)
    fingerprint = _fingerprint(body) if idempotency_key is not None else ""
    if idempotency_key is not None:
        existing = _replay(session, tenant, idempotency_key, fingerprint)
        if existing is not None:
            session.commit()
            return existing, False
    # One job whose queue is empty goes straight to it: nobody waits, so no order is at stake
    # and the dispatcher's step is saved (docs/architecture.md, "Fair share").
    direct = get_settings().dispatch_direct and dispatch.queue_is_empty(
        dispatch.queue_of(row["lane"], row["model"])
    )
    after = transitions.create(session.connection(), [row], by="api", direct=direct)
    if idempotency_key is not None:
        session.add(
            IdempotencyKey(
                tenant=tenant,
                key=idempotency_key,
                request_hash=fingerprint,
                job_id=row["id"],
                created_at=row["created_at"],
                expires_at=row["created_at"] + get_settings().idempotency_ttl_s,
            )
        )
    try:
        session.commit()
    except IntegrityError:
        if idempotency_key is None:
            raise
        # A concurrent request with the same key won the insert: answer as its replay.
        session.rollback()
        existing = _replay(session, tenant, idempotency_key, fingerprint)
        session.commit()
        if existing is None:
            raise
        return existing, False
    after.run()
    return transitions.as_job(row), True


def submit_many(session: Session, tenant: str, bodies: list[JobCreate]) -> list[Job]:
    """Commit many queued jobs in one transaction (all of them or none), then enqueue them."""
    rows = []
    checked: set[str] = set()
    created = now()
    for i, body in enumerate(bodies):
        try:
            rows.append(job_values(tenant, body, checked=checked, created=created))
        except DomainError as exc:
            raise exc.within(f"jobs[{i}]") from None
    try:
        after = transitions.create(session.connection(), rows, by="api")
        session.commit()
    except Exception:
        session.rollback()
        raise
    after.run()
    return [transitions.as_job(row) for row in rows]


def get(session: Session, tenant: str, job_id: str) -> Job:
    return queries.owned(session, Job, tenant, job_id, "job")


def list_page(
    session: Session,
    tenant: str,
    *,
    status: str | None,
    lane: str | None,
    limit: int,
    after: str | None,
) -> tuple[list[Job], bool]:
    """Newest first. ``after`` is the last id of the previous page (ids sort by time)."""
    query = select(Job).where(Job.tenant == tenant)
    if status is not None:
        query = query.where(Job.status == status)
    if lane is not None:
        query = query.where(Job.lane == lane)
    return queries.page(session, query, Job.id, limit, after)


def cancel(session: Session, tenant: str, job_id: str) -> tuple[Job, bool]:
    """Cancel a job. Returns (job, running): True when its worker was told to abort it."""
    job = get(session, tenant, job_id)
    after = transitions.cancel(session.connection(), job.id, now())
    session.commit()
    after.run()
    session.refresh(job)
    return job, bool(after.abort) and job.status == JobStatus.RUNNING


def wait_until_terminal(session: Session, job: Job, timeout_s: float) -> Job:
    """Poll the row briefly so a cancel usually answers with the final state."""
    deadline = time.monotonic() + timeout_s
    while job.status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.05)
        session.refresh(job)
        session.commit()
    return job
