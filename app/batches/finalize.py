"""Finishing batches (ops worker): expiry, finalization, and OpenAI's output file format.

The ops worker's beat sweep (:func:`sweep`) restarts batches whose start message was lost,
expires a batch whose window passed with lines left (its queued lines end ``expired``, its
running ones are aborted), and finalizes a batch once none of its jobs is left to run: it
streams the jobs into an output file (succeeded lines) and an error file (the rest), freezes
``request_counts`` and moves the batch to its final status; a ``webhook_url`` (inferq's
addition) gets the ``batch.<status>`` event in that same transaction.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from sqlalchemy import select

from app.batches import transitions as batch_transitions
from app.batches.service import jobs_by_status
from app.core import broker, files, storage, transitions
from app.core.changes import changes
from app.core.db import session_scope
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
from app.core.openai_format import job_error, response_body
from app.core.status_codes import status_of

log = logging.getLogger("inferq.batches")

READ_PAGE = 1000  # jobs per page while writing outputs
RESTART_AFTER_S = 60.0  # a batch nobody started this long after creation (lost message)
# Statuses in which a batch is finalized once none of its jobs is left to run.
FINALIZABLE = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)


def sweep() -> int:
    """Start lost batches, finalize finished ones, expire overdue ones; returns batches moved."""
    stamp = now()
    moved = 0
    with session_scope() as session:
        rows = session.execute(
            select(Batch.id, Batch.status, Batch.expires_at, Batch.created_at, Batch.claimed_at)
            .where(Batch.status.not_in(list(BATCH_TERMINAL)))
            .order_by(Batch.id)
        ).all()
    for row in rows:
        try:
            if row.status == BatchStatus.VALIDATING:
                lost = row.claimed_at is None and row.created_at < stamp - RESTART_AFTER_S
                held_too_long = stamp - batch_transitions.LEASE_S
                if lost or (row.claimed_at is not None and row.claimed_at < held_too_long):
                    moved += broker.send_start_batch(row.id)
                continue
            if finalize(row.id):
                moved += 1
            elif row.status == BatchStatus.IN_PROGRESS and row.expires_at <= stamp:
                _expire(row.id, stamp)
        except Exception:
            log.exception("sweeping batch %s failed", row.id)
    return moved


def _expire(batch_id: str, stamp: float) -> None:
    """The window has passed with lines left: stop them; the batch ends ``expired``."""
    with changes("ops", batch_id=batch_id) as tx:
        if batch_transitions.mark_expired(tx, batch_id, stamp):
            transitions.stop_batch(tx, batch_id, stamp, to=JobStatus.EXPIRED, code="batch_expired")


def finalize(batch_id: str) -> bool:
    """Write the outputs of a batch none of whose jobs is left to run; False if it is not done.

    The claim (``in_progress → finalizing``, or the lease on a ``cancelling`` or abandoned
    ``finalizing`` batch) makes one ops worker do it; status, output files and the webhook
    event commit together.
    """
    held = now()
    taken = _take_if_done(batch_id, held)
    if taken is None:
        return False
    batch, status, final = taken
    output_id, error_id, completed, failed = _write_outputs(batch, final)
    stamp = now()
    with session_scope() as session, changes("ops", session=session) as tx:
        done = batch_transitions.finish(
            tx,
            batch_id,
            status,
            final,
            held,
            stamp,
            ended_at=_ended_at(batch, final, stamp),
            output_file_id=output_id,
            error_file_id=error_id,
            request_completed=completed,
            request_failed=failed,
        )
        if done:
            for file_id, name in ((output_id, "output"), (error_id, "errors")):
                if file_id is not None:
                    files.add_output(session, batch.tenant, file_id, f"{batch.id}_{name}.jsonl")
    if not done:  # our lease ran out and another ops worker took over
        for file_id in (output_id, error_id):
            if file_id is not None:
                storage.delete(file_id)
        return False
    log.info("batch %s %s: %d completed, %d failed", batch_id, final, completed, failed)
    return True


def _ended_at(batch: Batch, final: BatchStatus, stamp: float) -> float:
    """An expired batch ended when its window did (or the sweep stopped it); others now."""
    if final == BatchStatus.EXPIRED:
        return batch.expired_at or batch.expires_at
    return stamp


def _take_if_done(batch_id: str, held: float) -> tuple[Batch, str, BatchStatus] | None:
    """Hold a finalizable batch none of whose jobs is left to run: (batch, its status now,
    its final status)."""
    with session_scope() as session, changes("ops", session=session) as tx:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in FINALIZABLE:
            return None
        by_status = jobs_by_status(session, batch_id)
        if any(status not in TERMINAL for status in by_status):
            return None
        status = batch.status
        to = BatchStatus.FINALIZING if status == BatchStatus.IN_PROGRESS else None
        if not batch_transitions.take(tx, batch_id, status, held, to=to):
            return None
        session.expunge(batch)
    now_status = to or status
    if status == BatchStatus.CANCELLING:
        return batch, now_status, BatchStatus.CANCELLED
    # A line's only deadline is the batch's expiry: one that expired means the window ended
    # first, whether the sweep or the worker holding it noticed.
    if batch.expired_at is not None or JobStatus.EXPIRED in by_status:
        return batch, now_status, BatchStatus.EXPIRED
    return batch, now_status, BatchStatus.COMPLETED


def _write_outputs(batch: Batch, final: str) -> tuple[str | None, str | None, int, int]:
    """Stream the batch's jobs into an output and an error file; (ids or None, counts).

    Jobs are read a page per short transaction (on SQLite every transaction holds the write
    lock), in input order.
    """
    output_id, error_id = new_id("file"), new_id("file")
    completed = failed = 0
    last = 0
    with storage.writer(output_id) as out, storage.writer(error_id) as err:
        while True:
            with session_scope() as session:
                page = list(
                    session.scalars(
                        select(Job)
                        .where(Job.batch_id == batch.id, Job.batch_line > last)
                        .order_by(Job.batch_line)
                        .limit(READ_PAGE)
                    )
                )
                session.expunge_all()
            if not page:
                break
            for job in page:
                line = output_line(job, final)
                if job.status == JobStatus.SUCCEEDED:
                    completed += 1
                    out.write(line)
                else:
                    failed += 1
                    err.write(line)
            last = page[-1].batch_line or last
    if not completed:
        storage.delete(output_id)
    if not failed:
        storage.delete(error_id)
    return (output_id if completed else None, error_id if failed else None, completed, failed)


# Lines the batch itself stopped (queued ones ended, running ones aborted), by how it ended.
STOPPED_LINES: dict[str, tuple[str, str]] = {
    BatchStatus.CANCELLED: (
        "batch_cancelled",
        "the batch was cancelled before this request finished",
    ),
    BatchStatus.EXPIRED: (
        "batch_expired",
        "this request could not be executed before the completion window expired",
    ),
}


def output_line(job: Job, final: str) -> bytes:
    """A line of OpenAI's output format: ``{id, custom_id, response, error}``."""
    record: dict[str, Any] = {
        "id": "batch_req_" + job.id.removeprefix("job_"),
        "custom_id": job.custom_id,
        "response": None,
        "error": None,
    }
    stopped = STOPPED_LINES.get(final)
    if job.status == JobStatus.SUCCEEDED:
        # A batch's lines run in bulk: the flex tier (docs/openai.md, "Service tiers").
        body = response_body(job, tier="flex")
        record["response"] = {"status_code": 200, "request_id": job.id, "body": body}
    elif stopped is not None and job.status in (JobStatus.CANCELLED, JobStatus.EXPIRED):
        # Aborted by the batch's cancel or by its deadline, whichever reached the job first.
        record["error"] = {"code": stopped[0], "message": stopped[1]}
    else:
        # The answer the realtime endpoint would have given (app/core/status_codes.py).
        error = job_error(job)
        record["response"] = {
            "status_code": status_of(error),
            "request_id": job.id,
            "body": {"error": {"code": error.code, "message": error.message}},
        }
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()
