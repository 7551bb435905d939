"""Finishing batches (ops worker): expiry, finalization, and OpenAI's output file format.

The ops worker's beat sweep (:func:`sweep`) restarts batches whose start message was lost,
expires a batch whose window passed with lines left (its queued lines end ``expired``, its
running ones are aborted), and finalizes a batch once none of its jobs is left to run: it
streams the jobs into an output file (succeeded lines) and an error file (the rest), freezes
``request_counts`` and moves the batch to its final status; a ``webhook_url`` (inferq's
addition) gets the ``batch.<status>`` event in that same transaction.
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select

from app.batches import transitions as batch_transitions
from app.batches.service import lines_by_status
from app.core.db import session_scope
from app.core.errors import DomainError, Kind
from app.core.lifecycle import transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import broker
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
from app.core.openai.openai_format import failure, job_error, response_body
from app.core.openai.pooling_format import (
    RERANK,
    SCORE,
    Pooled,
    dumps,
    embedding_response,
    pooled_of,
    rerank_response,
    score_response,
)
from app.core.status_codes import status_of
from app.core.storage import files, store

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
    try:
        output_id, error_id, completed, failed, sizes = _write_outputs(batch, final)
    except DomainError as exc:
        if exc.kind != Kind.UNAVAILABLE:
            raise
        # The file store is down: nothing is visible (an aborted write leaves no object). Give
        # the batch back, still finalizing, so the next sweep tries again at once rather than
        # after the lease (docs/files.md, "When the store is down").
        with changes("ops", batch_id=batch_id) as tx:
            batch_transitions.release(tx, batch_id, held)
        log.warning("batch %s waits for the file store: %s", batch_id, exc.message)
        return False
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
                    files.add_output(
                        session, batch.tenant, file_id, f"{batch.id}_{name}.jsonl", sizes[file_id]
                    )
    if not done:  # our lease ran out and another ops worker took over
        for file_id in (output_id, error_id):
            if file_id is not None:
                store.delete(file_id)
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
        by_status = lines_by_status(session, batch_id)
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


def _write_outputs(
    batch: Batch, final: str
) -> tuple[str | None, str | None, int, int, dict[str, int]]:
    """Stream the batch's jobs into an output and an error file; (ids or None, counts, each
    file's size by id).

    Jobs are read a page per short transaction (on SQLite every transaction holds the write
    lock), in input order.
    """
    output_id, error_id = new_id("file"), new_id("file")
    completed = failed = 0
    last = 0
    with store.writer(output_id) as out, store.writer(error_id) as err:
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
                written = (
                    pooled_output_lines(job, final, batch.endpoint)
                    if job.lines is not None
                    else [(job.status == JobStatus.SUCCEEDED, output_line(job, final))]
                )
                for ok, line in written:
                    if ok:
                        completed += 1
                        out.write(line)
                    else:
                        failed += 1
                        err.write(line)
            last = page[-1].batch_line or last
    if not completed:
        store.delete(output_id)
    if not failed:
        store.delete(error_id)
    sizes = {output_id: out.size, error_id: err.size}
    return (
        output_id if completed else None,
        error_id if failed else None,
        completed,
        failed,
        sizes,
    )


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
    # A batch's lines run in bulk: the flex tier (docs/openai.md, "Service tiers").
    body = response_body(job, tier="flex") if job.status == JobStatus.SUCCEEDED else None
    return _line(job, final, _line_id(job), job.custom_id, body)


def pooled_output_lines(job: Job, final: str, endpoint: str) -> list[tuple[bool, bytes]]:
    """The output lines of a pooled batch job, one per line it carries (``Job.lines``), each
    with whether it succeeded: a line's answer is its endpoint's, of its own inputs' rows, or
    the error of its own failed input (``Job.line_results``)."""
    results = job.line_results or {}
    pooled = None
    if job.status == JobStatus.SUCCEEDED and job.pooled is not None and job.pooled_width:
        pooled = pooled_of(
            job.id, job.created_at, job.model, job.pooled, job.pooled_width, job.prompt_tokens
        )
    written: list[tuple[bool, bytes]] = []
    start = 0
    for meta in job.lines or ():
        rows = range(start, start + meta["inputs"])
        start += meta["inputs"]
        result = results.get(str(meta["line"]), {})
        line_id = _line_id(job, meta["line"] if job.line_count > 1 else None)
        body = None
        if pooled is not None and "error" not in result:
            mine = Pooled(
                pooled.id,
                pooled.created_at,
                pooled.model,
                pooled.rows[rows.start : rows.stop],
                result.get("prompt_tokens", pooled.prompt_tokens),
            )
            body = _pooled_body(mine, endpoint, job, meta)
        error = result.get("error")
        failed = None if error is None else failure(error["code"], error["message"])
        record = _line(job, final, line_id, meta["custom_id"], body, failed)
        written.append((body is not None, record))
    return written


def _pooled_body(pooled: Pooled, endpoint: str, job: Job, meta: dict[str, Any]) -> dict[str, Any]:
    """A pooled line's response body: the endpoint's own answer."""
    if endpoint == RERANK:
        documents = job.inputs["documents"]
        return rerank_response(
            pooled, documents, meta.get("top_n", 0), meta.get("return_documents", True)
        )
    if endpoint == SCORE:
        return score_response(pooled)
    return embedding_response(pooled, meta.get("encoding_format", "float"))


def _line_id(job: Job, line: int | None = None) -> str:
    """A line's ``id``: from its job's, and its line number when the job carries several."""
    base = "batch_req_" + job.id.removeprefix("job_")
    return base if line is None else f"{base}_{line}"


def _line(
    job: Job,
    final: str,
    line_id: str,
    custom_id: str | None,
    body: dict[str, Any] | None,
    failed: DomainError | None = None,
) -> bytes:
    """One line of OpenAI's output format, ``{id, custom_id, response, error}``: ``body`` when
    the line succeeded, else the error of its job (or ``failed``, the line's own)."""
    record: dict[str, Any] = {
        "id": line_id,
        "custom_id": custom_id,
        "response": None,
        "error": None,
    }
    stopped = STOPPED_LINES.get(final)
    if body is not None:
        record["response"] = {"status_code": 200, "request_id": job.id, "body": body}
    elif (
        failed is None
        and stopped is not None
        and job.status in (JobStatus.CANCELLED, JobStatus.EXPIRED)
    ):
        # Aborted by the batch's cancel or by its deadline, whichever reached the job first.
        record["error"] = {"code": stopped[0], "message": stopped[1]}
    else:
        # The answer the realtime endpoint would have given (app/core/status_codes.py).
        error = failed or job_error(job)
        record["response"] = {
            "status_code": status_of(error),
            "request_id": job.id,
            "body": {"error": {"code": error.code, "message": error.message}},
        }
    return dumps(record) + b"\n"
