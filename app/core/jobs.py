"""The job service: submit, read, list and cancel, with the transactions they need.

Routes call these functions; they own the commits. Submission writes the job row (and its
Idempotency-Key) in one transaction; the caller enqueues only after that commit, so a worker can
never receive an id whose row is not there yet.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any, cast

from sqlalchemy import Table, insert, inspect, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.api.errors import ApiError
from app.core import dispatch, outbox, queries, transitions, webhooks
from app.core.models import TERMINAL, IdempotencyKey, Job, JobStatus, job_update, new_id, now
from app.core.schemas import JobCreate, storable
from app.core.settings import get_settings
from app.core.transitions import Transition

MAX_IDEMPOTENCY_KEY = 255


def _fingerprint(body: JobCreate) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def require_broker() -> None:
    """Refuse work up front when Redis is down, so a 202 is never a job that cannot start."""
    if not dispatch.redis_ok():
        raise ApiError(
            503,
            "broker_unavailable",
            "the queue (Redis) is unavailable; retry later",
            headers={"Retry-After": "5"},
        )


def check_model(requested: str | None) -> str:
    served = get_settings().model_name
    if requested is not None and requested != served:
        raise ApiError(
            422,
            "model_not_found",
            f"model {requested!r} is not served here; use {served!r}",
            param="model",
        )
    return served


def check_webhook_url(url: str | None, checked: set[str] | None = None) -> None:
    """Refuse a webhook_url the ops worker would not call (422); ``checked`` skips repeats."""
    if url is None or (checked is not None and url in checked):
        return
    try:
        webhooks.check_url(url, get_settings().webhook_allow_private)
    except webhooks.WebhookUrlError as exc:
        if exc.temporary:  # DNS did not answer: the URL may well be fine
            raise ApiError(
                503, "dns_unavailable", str(exc), param="webhook_url", headers={"Retry-After": "5"}
            ) from None
        raise ApiError(422, "webhook_url_refused", str(exc), param="webhook_url") from None
    if checked is not None:
        checked.add(url)


def job_values(
    tenant: str,
    body: JobCreate,
    *,
    checked: set[str] | None = None,
    relay: str | None = None,
) -> dict[str, Any]:
    """The attributes of a new queued job for ``body``: ``Job(**values)`` or an insert."""
    settings = get_settings()
    check_webhook_url(body.webhook_url, checked)
    created = now()
    timeout_s = body.timeout_s or settings.lane_default_timeout_s.get(body.lane.value)
    params: dict[str, Any] = body.params.model_dump()
    params["max_tokens"] = params["max_tokens"] or settings.default_max_tokens
    return {
        "id": new_id("job"),
        "tenant": tenant,
        "lane": body.lane.value,
        "model": check_model(body.model),
        "prompt": body.prompt,
        "messages": [m.model_dump(exclude_none=True) for m in body.messages]
        if body.messages is not None
        else None,
        "params": params,
        "webhook_url": body.webhook_url,
        "meta": dict(body.metadata),
        "relay": relay,
        "status": JobStatus.QUEUED,
        "attempts": 0,
        "lease_token": 0,
        "timeout_s": timeout_s,
        "deadline_at": created + timeout_s if timeout_s else None,
        "created_at": created,
        "updated_at": created,
    }


def _replay(session: Session, tenant: str, key: str, fingerprint: str) -> Job | None:
    row = session.get(IdempotencyKey, (tenant, key))
    if row is None:
        return None
    if row.expires_at <= now():
        session.delete(row)
        session.flush()
        return None
    if row.request_hash != fingerprint:
        raise ApiError(
            422,
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
) -> tuple[Job, bool]:
    """Insert a queued job. Returns (job, created); created is False for an idempotent replay."""
    if idempotency_key is not None and not (
        0 < len(idempotency_key) <= MAX_IDEMPOTENCY_KEY and storable(idempotency_key)
    ):
        raise ApiError(
            422,
            "invalid_idempotency_key",
            f"Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} characters",
            param="Idempotency-Key",
        )
    job = Job(**job_values(tenant, body, relay=relay))
    if idempotency_key is None:
        session.add(job)
        session.commit()
        _submitted([job])
        return job, True

    fingerprint = _fingerprint(body)
    existing = _replay(session, tenant, idempotency_key, fingerprint)
    if existing is not None:
        session.commit()
        return existing, False
    session.add(job)
    session.flush()  # the key row references the job row
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
    try:
        session.commit()
    except IntegrityError:
        # A concurrent request with the same key won the insert: answer as its replay.
        session.rollback()
        existing = _replay(session, tenant, idempotency_key, fingerprint)
        session.commit()
        if existing is None:
            raise
        return existing, False
    _submitted([job])
    return job, True


def _submitted(new: list[Job]) -> None:
    transitions.emit(
        [Transition(job.id, job.lane, job.tenant, JobStatus.QUEUED) for job in new], by="api"
    )


INSERT_CHUNK = 500


def submit_many(session: Session, tenant: str, bodies: list[JobCreate]) -> list[Job]:
    """Insert many queued jobs in one transaction (in chunks): all of them or none."""
    values = []
    checked: set[str] = set()
    for i, body in enumerate(bodies):
        try:
            values.append(job_values(tenant, body, checked=checked))
        except ApiError as exc:
            exc.param = f"jobs[{i}].{exc.param}" if exc.param else f"jobs[{i}]"
            raise
    try:
        insert_rows(session.connection(), values)
        session.commit()
    except Exception:
        session.rollback()
        raise
    created = [Job(**v) for v in values]
    _submitted(created)
    return created


def insert_rows(connection: Connection, values: list[dict[str, Any]]) -> None:
    """Insert new jobs (:func:`job_values`) in the caller's transaction, in chunks."""
    if not values:
        return
    names = {attr.key: attr.columns[0].name for attr in inspect(Job).column_attrs}
    table = cast(Table, Job.__table__)
    # Core executemany, not the ORM unit of work: it was a third of a bulk request's cost.
    for start in range(0, len(values), INSERT_CHUNK):
        chunk = values[start : start + INSERT_CHUNK]
        connection.execute(insert(table), [{names[k]: v for k, v in row.items()} for row in chunk])


def send(session: Session, jobs: list[tuple[str, str]]) -> None:
    """Enqueue committed (job id, lane) pairs and stamp the ones that went out.

    A job whose message could not be sent keeps ``enqueued_at`` empty; the reaper sends it.
    """
    failed = set(dispatch.enqueue(jobs))
    sent = [job_id for job_id, _ in jobs if job_id not in failed]
    if sent:
        table = cast(Table, Job.__table__)
        session.connection().execute(
            update(table).where(table.c.id.in_(sent)).values(enqueued_at=now())
        )
        session.commit()


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
    """Cancel a job. Returns (job, running): True when the workers were told to abort it."""
    job = get(session, tenant, job_id)
    stamp = now()
    if job.status == JobStatus.QUEUED:
        done = session.execute(
            job_update(
                job_id,
                expect=JobStatus.QUEUED,
                to=JobStatus.CANCELLED,
                finished_at=stamp,
                updated_at=stamp,
                cancel_requested_at=stamp,
            )
        )
        if done.rowcount:  # type: ignore[attr-defined]
            events = outbox.record_job_events(session.connection(), [job_id], stamp)
            session.commit()
            transitions.emit(
                [Transition(job.id, job.lane, tenant, JobStatus.CANCELLED, JobStatus.QUEUED)],
                by="api",
            )
            outbox.announce(events)
            session.refresh(job)
            return job, False
        session.commit()
        session.refresh(job)  # a worker claimed it meanwhile: cancel it as running
    if job.status == JobStatus.RUNNING:
        session.execute(
            job_update(
                job_id, expect=JobStatus.RUNNING, cancel_requested_at=stamp, updated_at=stamp
            )
        )
        session.commit()
        session.refresh(job)
        if job.status == JobStatus.RUNNING:
            dispatch.publish_control("cancel", job_id=job.id)
            return job, True
        return job, False
    session.commit()
    return job, False


def wait_until_terminal(session: Session, job: Job, timeout_s: float) -> Job:
    """Poll the row briefly so a cancel usually answers with the final state."""
    deadline = time.monotonic() + timeout_s
    while job.status not in TERMINAL and time.monotonic() < deadline:
        time.sleep(0.05)
        session.refresh(job)
        session.commit()
    return job
