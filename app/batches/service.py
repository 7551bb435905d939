"""Batches (OpenAI's Batch API): a file of requests that run as bulk jobs, and what they produce.

Life of a batch::

    validating ──► in_progress ──► finalizing ──► completed | expired
        │               │
        ▼               ▼
      failed       cancelling ──► cancelled

- ``POST /v1/batches`` writes the row (``validating``) and asks the ops worker to start it
  (:func:`start`). The file is read twice, streaming, never whole: the first pass checks every
  line (JSON, unique ``custom_id``, ``method`` POST, ``url`` equal to the batch's endpoint, a
  body the endpoint itself would accept, at most ``batch_max_lines``); any error fails the
  batch with line-numbered ``errors`` and nothing is enqueued. The second pass inserts one
  bulk job per line and moves the batch to ``in_progress`` in the same transaction, so the
  jobs exist exactly when the batch says so; they are enqueued after the commit, in chunks.
- Every batch job's deadline is the batch's ``expires_at``: a worker expires or aborts it like
  any job past its ``timeout_s``; at expiry the sweep also expires the jobs still queued.
- Cancel marks the batch ``cancelling``, cancels its queued jobs and aborts its running ones.
- The ops worker's beat sweep (:func:`sweep`) finalizes a batch once none of its jobs is left
  to run: it streams the jobs into an output file (succeeded lines) and an error file (the
  rest), freezes ``request_counts`` and moves the batch to its final status; a ``webhook_url``
  (inferq's addition) gets the ``batch.<status>`` event in that same transaction.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from pydantic import ValidationError
from sqlalchemy import func, or_, select, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value

from app.api.errors import ApiError, param_path
from app.core import dispatch, files, jobs, outbox, queries, storage, tokens, transitions
from app.core.db import session_scope
from app.core.models import (
    BATCH_TERMINAL,
    TERMINAL,
    Batch,
    BatchStatus,
    Job,
    JobStatus,
    Lane,
    can_transition,
    new_id,
    now,
)
from app.core.openai_format import ENDPOINTS, REQUEST_TYPES, job_error, response_body
from app.core.schemas import BatchCreate, JobCreate, RequestCounts, storable
from app.core.settings import get_settings
from app.core.transitions import Transition

log = logging.getLogger("inferq.batches")

MAX_ERRORS = 100  # validation stops after this many bad lines
MAX_CUSTOM_ID = 512
SEND_CHUNK = 5000  # (job id, lane) pairs per enqueue call
READ_PAGE = 1000  # jobs per page while writing outputs
RESTART_AFTER_S = 60.0  # a batch nobody started this long after creation (lost message)
LEASE_S = 300.0  # an ops worker's hold on a batch it validates or finalizes
# Statuses in which a batch is finalized once none of its jobs is left to run.
FINALIZABLE = (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING, BatchStatus.FINALIZING)
_WINDOW = re.compile(r"^(\d+)([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def window_seconds(value: str) -> float:
    match = _WINDOW.match(value)
    top = get_settings().batch_max_window_s
    seconds = int(match[1]) * _UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= top:
        raise ApiError(
            422,
            "invalid_completion_window",
            f'completion_window must be a duration such as "24h", "30m" or "90s", '
            f"at most {int(top)} seconds (got {value!r})",
            param="completion_window",
        )
    return float(seconds)


# --- API side --------------------------------------------------------------------------------


def create(session: Session, tenant: str, body: BatchCreate) -> Batch:
    if body.endpoint not in ENDPOINTS:
        raise ApiError(
            422,
            "invalid_endpoint",
            f"endpoint must be one of {', '.join(ENDPOINTS)} (got {body.endpoint!r})",
            param="endpoint",
        )
    window = window_seconds(body.completion_window)
    source = files.get(session, tenant, body.input_file_id)
    if source.purpose != "batch":
        raise ApiError(
            422,
            "invalid_input_file",
            f"file {source.id} has purpose {source.purpose!r}; a batch reads purpose 'batch'",
            param="input_file_id",
        )
    jobs.check_webhook_url(body.webhook_url)
    stamp = now()
    batch = Batch(
        id=new_id("batch"),
        tenant=tenant,
        endpoint=body.endpoint,
        input_file_id=source.id,
        completion_window=body.completion_window,
        status=BatchStatus.VALIDATING,
        meta=dict(body.metadata or {}),
        webhook_url=body.webhook_url,
        request_total=0,
        request_completed=0,
        request_failed=0,
        created_at=stamp,
        expires_at=stamp + window,
        updated_at=stamp,
    )
    session.add(batch)
    session.commit()
    dispatch.start_batch(batch.id)
    return batch


def get(session: Session, tenant: str, batch_id: str) -> Batch:
    return queries.owned(session, Batch, tenant, batch_id, "batch")


def list_page(
    session: Session, tenant: str, *, limit: int, after: str | None
) -> tuple[list[Batch], bool]:
    query = select(Batch).where(Batch.tenant == tenant)
    return queries.page(session, query, Batch.id, limit, after)


def counts(session: Session, batch: Batch) -> RequestCounts:
    """Live counts while the batch runs; frozen ones once it has ended."""
    if batch.status in BATCH_TERMINAL or batch.status == BatchStatus.VALIDATING:
        return RequestCounts(
            total=batch.request_total,
            completed=batch.request_completed,
            failed=batch.request_failed,
        )
    by_status = _jobs_by_status(session, batch.id)
    completed = by_status.get(JobStatus.SUCCEEDED, 0)
    ended = sum(n for status, n in by_status.items() if status in TERMINAL)
    return RequestCounts(total=batch.request_total, completed=completed, failed=ended - completed)


def _jobs_by_status(session: Session, batch_id: str) -> dict[str, int]:
    """How many of the batch's jobs are in each status."""
    rows = session.execute(
        select(Job.status, func.count()).where(Job.batch_id == batch_id).group_by(Job.status)
    ).all()
    return {status: int(n) for status, n in rows}


def cancel(session: Session, tenant: str, batch_id: str) -> Batch:
    """Stop a batch: queued lines never run, running ones are aborted, finished ones are kept."""
    batch = get(session, tenant, batch_id)
    if batch.status == BatchStatus.CANCELLING:
        return batch
    if batch.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS):
        raise ApiError(
            409,
            "batch_not_cancellable",
            f"a batch that is {batch.status} cannot be cancelled",
            param="batch_id",
        )
    stamp = now()
    moved = session.execute(
        update(Batch)
        .where(Batch.id == batch.id, Batch.status == batch.status)
        .values(status=BatchStatus.CANCELLING, cancelling_at=stamp, updated_at=stamp)
    )
    if not moved.rowcount:  # type: ignore[attr-defined]
        session.rollback()
        session.refresh(batch)
        return cancel(session, tenant, batch_id)  # it moved on meanwhile: judge it again
    stopped = _stop_jobs(session, batch.id, stamp, JobStatus.CANCELLED, "batch_cancelled")
    session.commit()
    _after_stop(stopped, "api")
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


@dataclass(frozen=True)
class Stopped:
    ended: list[Transition]  # queued jobs that ended
    running: list[str]  # running jobs the workers must abort


def _stop_jobs(session: Session, batch_id: str, stamp: float, to: str, code: str) -> Stopped:
    """End a batch's queued jobs with ``to`` and mark its running ones to be cancelled.

    Once this commits the caller passes the result to :func:`_after_stop`.
    """
    assert can_transition(JobStatus.QUEUED, to)
    why = {
        "batch_cancelled": "the batch was cancelled",
        "batch_expired": "the batch's completion window ended before this request ran",
    }[code]
    ended = session.execute(
        update(Job)
        .where(Job.batch_id == batch_id, Job.status == JobStatus.QUEUED)
        .values(
            status=to,
            finished_at=stamp,
            updated_at=stamp,
            cancel_requested_at=stamp,
            error_code=code,
            error_message=why,
        )
        .returning(Job.id, Job.lane, Job.tenant)
        .execution_options(synchronize_session=False)
    ).all()
    running = list(
        session.scalars(
            update(Job)
            .where(Job.batch_id == batch_id, Job.status == JobStatus.RUNNING)
            .values(cancel_requested_at=stamp, updated_at=stamp)
            .returning(Job.id)
            .execution_options(synchronize_session=False)
        )
    )
    return Stopped(transitions.of_rows(ended, to, JobStatus.QUEUED, code), running)


def _after_stop(stopped: Stopped, by: transitions.By) -> None:
    """Log the committed ends, and tell the workers to abort the running jobs now (their
    heartbeats would, later)."""
    transitions.emit(stopped.ended, by=by)
    for job_id in stopped.running:
        dispatch.publish_control("cancel", job_id=job_id)


# --- ops worker: validate and start ----------------------------------------------------------


class LineError(Exception):
    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


def _lines(source: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of the non-blank lines; bytes None for a line over ``limit``."""
    number = 0
    while True:
        raw = source.readline(limit + 1)
        if not raw:
            return
        number += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while (rest := source.readline(limit)) and not rest.endswith(b"\n"):
                pass  # skip the rest of an over-long line
            yield number, None
            continue
        if raw.strip():
            yield number, raw


def _parse(
    raw: bytes | None, endpoint: str, limit: int, *, count_tokens: bool
) -> tuple[str, JobCreate]:
    """One line's custom_id and job body; raises LineError naming what is wrong.

    ``count_tokens`` checks the prompt against the model's context: the first pass does, the
    second (which only reads lines the first accepted) need not tokenize them again.
    """
    if raw is None:
        raise LineError("line_too_long", f"the line is longer than {limit} bytes")
    try:
        line = json.loads(raw)
    except ValueError as exc:
        raise LineError("invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise LineError("invalid_line", "each line must be a JSON object")
    extra = set(line) - {"custom_id", "method", "url", "body"}
    if extra:
        raise LineError("invalid_line", f"unknown key {sorted(extra)[0]!r}", sorted(extra)[0])
    custom_id = line.get("custom_id")
    if (
        not isinstance(custom_id, str)
        or not 0 < len(custom_id) <= MAX_CUSTOM_ID
        or not storable(custom_id)
    ):
        raise LineError(
            "invalid_custom_id",
            f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters",
            "custom_id",
        )
    if line.get("method") != "POST":
        raise LineError("invalid_method", "method must be POST", "method")
    if line.get("url") != endpoint:
        raise LineError(
            "mismatched_url",
            f"url must be the batch's endpoint {endpoint} (got {line.get('url')!r})",
            "url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise LineError("invalid_body", "body must be a JSON object", "body")
    if body.get("stream"):
        raise LineError("invalid_body", "stream is not supported in a batch", "body.stream")
    try:
        request = REQUEST_TYPES[endpoint].model_validate(body)
        job = request.job()
        jobs.check_model(job.model)
        if count_tokens:
            tokens.check(dispatch.redis_client(), get_settings().model_name, [job])
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_path(("body", *first["loc"]))
        message = str(first["msg"]).removeprefix("Value error, ")
        raise LineError(str(first["type"]), f"body.{param}: {message}", f"body.{param}") from None
    except ApiError as exc:
        param = f"body.{exc.param}" if exc.param else "body"
        raise LineError(exc.code, f"body: {exc.message}", param) from None
    return custom_id, job


def _validate(batch: Batch) -> tuple[list[dict[str, Any]], int]:
    """First pass over the input: (errors, number of requests)."""
    settings = get_settings()
    limit, most = settings.max_body_bytes, settings.batch_max_lines
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0
    try:
        source = storage.open_file(batch.input_file_id)
    except FileNotFoundError:
        return [_error("file_not_found", f"file {batch.input_file_id} was deleted", None, None)], 0
    with source:
        for number, raw in _lines(source, limit):
            count += 1
            if count > most:
                errors.append(
                    _error(
                        "too_many_requests", f"a batch holds at most {most} requests", None, number
                    )
                )
                break
            try:
                custom_id, _ = _parse(raw, batch.endpoint, limit, count_tokens=True)
                if custom_id in seen:
                    raise LineError(
                        "duplicate_custom_id",
                        f"custom_id {custom_id!r} is used by an earlier line",
                        "custom_id",
                    )
                seen.add(custom_id)
            except LineError as exc:
                errors.append(_error(exc.code, exc.message, exc.param, number))
                if len(errors) >= MAX_ERRORS:
                    break
    if not errors and count == 0:
        errors.append(_error("empty_file", "the input file has no requests", None, None))
    return errors, count


def _error(code: str, message: str, param: str | None, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _claim(session: Session, batch_id: str, expect: str, stamp: float, **values: Any) -> bool:
    """Take the batch for this ops worker while it is ``expect`` and nobody holds it."""
    taken = session.execute(
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status == expect,
            or_(Batch.claimed_at.is_(None), Batch.claimed_at < stamp - LEASE_S),
        )
        .values(claimed_at=stamp, updated_at=stamp, **values)
    ).rowcount  # type: ignore[attr-defined]
    return bool(taken)


def _release(batch_id: str, claim: float) -> None:
    with session_scope() as session:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.claimed_at == claim)
            .values(claimed_at=None)
        )


def start(batch_id: str) -> str:
    """Validate a ``validating`` batch and start its jobs, or fail it (ops worker)."""
    claim = now()
    with session_scope() as session:
        if not _claim(session, batch_id, BatchStatus.VALIDATING, claim):
            return "not validating, or another ops worker has it"
        batch = session.get(Batch, batch_id)
        assert batch is not None
        session.expunge(batch)
    errors, count = _validate(batch)
    stamp = now()
    if errors:
        with session_scope() as session:
            failed = session.execute(
                update(Batch)
                .where(Batch.id == batch_id, Batch.claimed_at == claim)
                .where(Batch.status == BatchStatus.VALIDATING)
                .values(
                    status=BatchStatus.FAILED,
                    errors=errors,
                    failed_at=stamp,
                    updated_at=stamp,
                    claimed_at=None,
                )
            ).rowcount  # type: ignore[attr-defined]
            events = _record_event(session, batch_id, stamp) if failed else []
        if not failed:
            _release(batch_id, claim)  # cancelled meanwhile: the sweep finalizes it
            return "cancelled while validating"
        outbox.announce(events)
        log.info("batch %s failed validation (%d errors)", batch_id, len(errors))
        return "failed"
    ids = _insert_jobs(batch, count, stamp, claim)
    if ids is None:
        _release(batch_id, claim)
        return "cancelled while validating"
    transitions.emit(
        [Transition(job_id, Lane.BULK.value, batch.tenant, JobStatus.QUEUED) for job_id in ids],
        by="ops",
        batch_id=batch_id,
    )
    pairs = [(job_id, str(Lane.BULK)) for job_id in ids]
    with session_scope() as session:
        for i in range(0, len(pairs), SEND_CHUNK):
            jobs.send(session, pairs[i : i + SEND_CHUNK])
    log.info("batch %s in progress: %d requests", batch_id, count)
    return "in_progress"


def _insert_jobs(batch: Batch, count: int, stamp: float, claim: float) -> list[str] | None:
    """Second pass: one bulk job per line, and the batch in_progress, in one transaction."""
    limit = get_settings().max_body_bytes
    ids: list[str] = []
    with session_scope() as session:
        connection = session.connection()
        rows: list[dict[str, Any]] = []
        with storage.open_file(batch.input_file_id) as source:
            for number, raw in _lines(source, limit):
                custom_id, body = _parse(raw, batch.endpoint, limit, count_tokens=False)
                row = jobs.job_values(batch.tenant, body)
                row.update(
                    lane=Lane.BULK.value,
                    batch_id=batch.id,
                    custom_id=custom_id,
                    batch_line=number,
                    timeout_s=None,
                    deadline_at=batch.expires_at,
                )
                ids.append(row["id"])
                rows.append(row)
                if len(rows) == jobs.INSERT_CHUNK:
                    jobs.insert_rows(connection, rows)
                    rows = []
        jobs.insert_rows(connection, rows)
        started = connection.execute(
            update(Batch)
            .where(Batch.id == batch.id, Batch.status == BatchStatus.VALIDATING)
            .where(Batch.claimed_at == claim)
            .values(
                status=BatchStatus.IN_PROGRESS,
                in_progress_at=stamp,
                request_total=count,
                updated_at=stamp,
                claimed_at=None,
            )
        ).rowcount
        if not started:
            session.rollback()  # cancelled meanwhile: no job was ever visible
            return None
    return ids


# --- ops worker: expire and finalize ----------------------------------------------------------


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
                if lost or (row.claimed_at is not None and row.claimed_at < stamp - LEASE_S):
                    moved += dispatch.start_batch(row.id)
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
    with session_scope() as session:
        marked = session.execute(
            update(Batch)
            .where(
                Batch.id == batch_id,
                Batch.status == BatchStatus.IN_PROGRESS,
                Batch.expired_at.is_(None),
            )
            .values(expired_at=stamp, updated_at=stamp)
        ).rowcount  # type: ignore[attr-defined]
        stopped = (
            _stop_jobs(session, batch_id, stamp, JobStatus.EXPIRED, "batch_expired")
            if marked
            else Stopped([], [])
        )
    _after_stop(stopped, "ops")


def finalize(batch_id: str) -> bool:
    """Write the outputs of a batch none of whose jobs is left to run; False if it is not done.

    The claim (``in_progress → finalizing``, or the lease on a ``cancelling`` or abandoned
    ``finalizing`` batch) makes one ops worker do it; status, output files and the webhook
    event commit together.
    """
    claim = now()
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        if batch is None or batch.status not in FINALIZABLE:
            return False
        by_status = _jobs_by_status(session, batch_id)
        if any(status not in TERMINAL for status in by_status):
            return False
        # A line's only deadline is the batch's expiry: one that expired means the window
        # ended first, whether the sweep or the worker holding it noticed.
        window_ended = batch.expired_at is not None or JobStatus.EXPIRED in by_status
        status = batch.status
        extra: dict[str, Any] = {}
        if status == BatchStatus.IN_PROGRESS:
            extra = {"status": BatchStatus.FINALIZING, "finalizing_at": claim}
        if not _claim(session, batch_id, status, claim, **extra):
            return False
        session.expunge(batch)
    cancelled = status == BatchStatus.CANCELLING
    final = (
        BatchStatus.CANCELLED
        if cancelled
        else BatchStatus.EXPIRED
        if window_ended
        else BatchStatus.COMPLETED
    )
    output_id, error_id, completed, failed = _write_outputs(batch, final)
    stamp = now()
    ended_at = {
        BatchStatus.CANCELLED: "cancelled_at",
        BatchStatus.COMPLETED: "completed_at",
        BatchStatus.EXPIRED: "expired_at",
    }[final]
    with session_scope() as session:
        done = session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.claimed_at == claim)
            .values(
                status=final,
                output_file_id=output_id,
                error_file_id=error_id,
                request_completed=completed,
                request_failed=failed,
                updated_at=stamp,
                claimed_at=None,
                **{
                    ended_at: (batch.expired_at or batch.expires_at)
                    if final == BatchStatus.EXPIRED
                    else stamp
                },
            )
        ).rowcount  # type: ignore[attr-defined]
        if done:
            for file_id, name in ((output_id, "output"), (error_id, "errors")):
                if file_id is not None:
                    files.add_output(session, batch.tenant, file_id, f"{batch.id}_{name}.jsonl")
            events = _record_event(session, batch_id, stamp)
    if not done:  # our lease ran out and another ops worker took over
        for file_id in (output_id, error_id):
            if file_id is not None:
                storage.delete(file_id)
        return False
    outbox.announce(events)
    log.info("batch %s %s: %d completed, %d failed", batch_id, final, completed, failed)
    return True


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
                line = _output_line(job, final)
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


def _output_line(job: Job, final: str) -> bytes:
    """A line of OpenAI's output format: ``{id, custom_id, response, error}``."""
    record: dict[str, Any] = {
        "id": "batch_req_" + job.id.removeprefix("job_"),
        "custom_id": job.custom_id,
        "response": None,
        "error": None,
    }
    stopped = STOPPED_LINES.get(final)
    if job.status == JobStatus.SUCCEEDED:
        record["response"] = {"status_code": 200, "request_id": job.id, "body": response_body(job)}
    elif stopped is not None and job.status in (JobStatus.CANCELLED, JobStatus.EXPIRED):
        # Aborted by the batch's cancel or by its deadline, whichever reached the job first.
        record["error"] = {"code": stopped[0], "message": stopped[1]}
    else:
        error = job_error(job)
        record["response"] = {
            "status_code": error.status,
            "request_id": job.id,
            "body": {"error": {"code": error.code, "message": error.message}},
        }
    return (json.dumps(record, separators=(",", ":")) + "\n").encode()


def _record_event(session: Session, batch_id: str, stamp: float) -> list[str]:
    """The batch's ``batch.<status>`` webhook event, in the caller's transaction."""
    return outbox.record_batch_event(session.connection(), batch_id, stamp)
