"""Batches as the API serves them: create, read, list, cancel, and live request counts.

Life of a batch (the ops worker's part: app/batches/validation.py and app/batches/finalize.py)::

    validating ──► in_progress ──► finalizing ──► completed | expired
        │               │
        ▼               ▼
      failed       cancelling ──► cancelled

``POST /v1/batches`` writes the row (``validating``) and asks the ops worker to start it. Cancel
marks the batch ``cancelling``, ends its queued lines and aborts its running ones; the ops
worker's sweep finalizes it once none is left to run. Every status change is
app/batches/transitions.py's, made through ``changes`` (app/core/lifecycle/changes.py).
"""

from __future__ import annotations

import re

from sqlalchemy import func, select
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from app.batches import transitions as batch_transitions
from app.batches.schemas import BatchCreate, RequestCounts
from app.core import queries
from app.core.errors import DomainError, Kind
from app.core.lifecycle import transitions
from app.core.lifecycle.changes import changes
from app.core.models import (
    BATCH_TERMINAL,
    TERMINAL,
    Batch,
    BatchStatus,
    Job,
    JobStatus,
    new_id,
    now,
)
from app.core.openai import openai_format, pooling_format
from app.core.settings import get_settings
from app.core.storage import files
from app.core.webhooks import rules

# What a batch may run: OpenAI's generation endpoints and the pooled ones (docs/openai.md).
ENDPOINTS = (*openai_format.ENDPOINTS, *pooling_format.ENDPOINTS)
_WINDOW = re.compile(r"^(\d+)([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(value: str) -> float:
    """A ``completion_window`` ("24h", "30m", "90s") in seconds, within the setting's bound."""
    match = _WINDOW.match(value)
    top = get_settings().batch_max_window_s
    seconds = int(match[1]) * _UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= top:
        raise DomainError(
            Kind.INVALID,
            "invalid_completion_window",
            f'completion_window must be a duration such as "24h", "30m" or "90s", '
            f"at most {int(top)} seconds (got {value!r})",
            param="completion_window",
        )
    return float(seconds)


def create(session: Session, tenant: str, body: BatchCreate) -> Batch:
    if body.endpoint not in ENDPOINTS:
        raise DomainError(
            Kind.INVALID,
            "invalid_endpoint",
            f"endpoint must be one of {', '.join(ENDPOINTS)} (got {body.endpoint!r})",
            param="endpoint",
        )
    window = window_seconds(body.completion_window)
    source = files.get(session, tenant, body.input_file_id)
    if source.purpose != "batch":
        raise DomainError(
            Kind.INVALID,
            "invalid_input_file",
            f"file {source.id} has purpose {source.purpose!r}; a batch reads purpose 'batch'",
            param="input_file_id",
        )
    # Its lines could not be read: refused now, not a batch that fails in validation.
    files.here(source, "start a batch on", param="input_file_id")
    rules.check_webhook_url(body.webhook_url)
    stamp = now()
    with changes("api", session=session) as tx:
        batch = batch_transitions.create(
            tx,
            new_id("batch"),
            stamp,
            tenant=tenant,
            endpoint=body.endpoint,
            input_file_id=source.id,
            completion_window=body.completion_window,
            meta=dict(body.metadata or {}),
            webhook_url=body.webhook_url,
            expires_at=stamp + window,
        )
    # What was committed, `validating` (a re-read could race the ops worker's start).
    return batch


def get(session: Session, tenant: str | None, batch_id: str) -> Batch:
    return queries.owned(session, Batch, tenant, batch_id, "batch")


def list_page(
    session: Session, tenant: str | None, *, limit: int, after: str | None
) -> tuple[list[Batch], bool]:
    query = queries.scoped(session, select(Batch), Batch.tenant, tenant)
    return queries.page(session, query, Batch.id, limit, after)


def counts(
    session: Session, batch: Batch, by_status: dict[str, int] | None = None
) -> RequestCounts:
    """Live counts while the batch runs; frozen ones once it has ended. ``by_status``: its
    lines by status (:func:`lines_by_status`) when the caller has read them already."""
    if batch.status in BATCH_TERMINAL or batch.status == BatchStatus.VALIDATING:
        return RequestCounts(
            total=batch.request_total,
            completed=batch.request_completed,
            failed=batch.request_failed,
        )
    if by_status is None:
        by_status = lines_by_status(session, batch.id)
    completed = by_status.get(JobStatus.SUCCEEDED, 0)
    ended = sum(n for status, n in by_status.items() if status in TERMINAL)
    return RequestCounts(total=batch.request_total, completed=completed, failed=ended - completed)


def lines_by_status(session: Session, batch_id: str) -> dict[str, int]:
    """How many of the batch's lines are in each status: a job's, for the lines it carries
    (several, for grouped embedding lines), less those of a succeeded job that failed on
    their own, which count as failed."""
    rows = session.execute(
        select(Job.status, func.sum(Job.line_count), func.sum(Job.failed_lines))
        .where(Job.batch_id == batch_id)
        .group_by(Job.status)
    ).all()
    found: dict[str, int] = {}
    for status, lines, failed in rows:
        found[status] = found.get(status, 0) + int(lines or 0)
        if status == JobStatus.SUCCEEDED and failed:
            found[status] -= int(failed)
            found[JobStatus.FAILED] = found.get(JobStatus.FAILED, 0) + int(failed)
    return found


def cancel(session: Session, tenant: str | None, batch_id: str) -> Batch:
    """Stop a batch: queued lines never run, running ones are aborted, finished ones are kept."""
    batch = get(session, tenant, batch_id)
    if batch.status == BatchStatus.CANCELLING:
        return batch
    if batch.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        raise DomainError(
            Kind.CONFLICT,
            "batch_not_cancellable",
            f"a batch that is {batch.status} cannot be cancelled",
            param="batch_id",
        )
    stamp = now()
    with changes("api", session=session) as tx:
        moved = batch_transitions.cancel(tx, batch.id, batch.status, stamp)
        if moved:
            transitions.stop_batch(
                tx, batch.id, stamp, to=JobStatus.CANCELLED, code="batch_cancelled"
            )
    if not moved:
        session.refresh(batch)
        return cancel(session, tenant, batch_id)  # it moved on meanwhile: judge it again
    # The answer is what this call committed, `cancelling` as OpenAI answers. Re-reading the row
    # raced the ops worker, which can finish the batch within milliseconds once its workers
    # have aborted the running lines; GET shows that.
    for name, value in (
        ("status", BatchStatus.CANCELLING),
        ("cancelling_at", stamp),
        ("updated_at", stamp),
    ):
        set_committed_value(batch, name, value)
    return batch
