"""The one owner of a job's status: every write of ``jobs.status`` is in this module.

A job's life (docs/architecture.md, "Job states")::

    create ──► queued ──claim──► running ──record──► succeeded | failed | cancelled | expired
                 │ ▲                 │
                 │ └── hand_back ────┤ (this worker stops; the job runs again elsewhere)
                 │ └── reclaim ──────┤ (its lease ran out: queued again, or failed/expired)
                 └── cancel, expire_queued, stop_batch ──► cancelled | expired

Each function is a compare-and-set on the status (and, from ``running``, on the lease token)
in the *caller's* transaction, with the webhook outbox rows of the jobs it ends
(app/core/outbox.py), and returns an :class:`After`: what must happen once that transaction
has committed - one JSON log line and the job counters for every change, the webhook events to
announce, the tenants' charges to settle (app/core/fairshare.py), the queues whose dispatcher
must send jobs (or the one job the API sends itself) and the running jobs whose workers must
abort them. The caller
commits and then calls ``after.run()``, so a change that rolled back is never logged, counted,
announced or sent. The log lines go to the ``inferq.jobs`` logger, one JSON object each
whatever the format of the process's other logs::

    {"ts": "2026-11-22T10:00:00.123Z", "event": "job.running", "job_id": "job_...",
     "lane": "standard", "tenant": "default", "from": "queued", "to": "running",
     "by": "worker", "worker": "worker-host-1234-ab12", "attempt": 1}
"""

from __future__ import annotations

import functools
import json
import logging
import sys
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal, cast

import redis
from prometheus_client import Counter
from sqlalchemy import (
    ColumnElement,
    Row,
    Table,
    Update,
    bindparam,
    insert,
    inspect,
    or_,
    select,
    update,
)
from sqlalchemy.engine import Connection

from app.core import dispatch, fairshare, outbox
from app.core.models import TERMINAL, Job, JobStatus, can_transition

log = logging.getLogger("inferq.jobs")

By = Literal["api", "worker", "reaper", "ops", "dispatcher"]

# Every kind of process counts what it changed; names and labels are the README's metrics table.
JOBS_SUBMITTED = Counter(
    "inferq_jobs_submitted", "Jobs accepted (committed), by lane and model.", ["lane", "model"]
)
JOBS_FINISHED = Counter(
    "inferq_jobs_finished",
    "Jobs that reached a terminal status, counted by the process that wrote it.",
    ["lane", "model", "status"],
)

DEADLINE_EXCEEDED = "deadline_exceeded"
WORKER_LOST = "worker_lost"
INSERT_CHUNK = 500  # rows per INSERT of new jobs


def _install_log() -> None:
    """The lines are the message alone: a handler of their own, not the process's format."""
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


_install_log()


@dataclass(frozen=True, slots=True)
class Transition:
    """One committed change of one job's status (``source`` None: a new job)."""

    job_id: str
    lane: str
    model: str
    tenant: str
    to: str
    source: str | None = None
    attempt: int | None = None
    error_code: str | None = None


@dataclass
class After:
    """What follows a committed transaction of transitions, done by :meth:`run`."""

    by: By
    moved: list[Transition] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # webhook events to announce
    # (job id, queue) to enqueue now: a new job the API sends itself (its queue was empty)
    send: list[tuple[str, str]] = field(default_factory=list)
    wake: set[str] = field(default_factory=set)  # queues with jobs for the dispatcher to send
    usage: list[fairshare.Usage] = field(default_factory=list)  # tenant charges to settle
    abort: list[str] = field(default_factory=list)  # running jobs their workers must stop
    worker: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # added to every log line

    def __iadd__(self, other: After) -> After:
        self.moved += other.moved
        self.events += other.events
        self.send += other.send
        self.wake |= other.wake
        self.usage += other.usage
        self.abort += other.abort
        return self

    def count(self, to: str, source: str | None = None) -> int:
        return sum(1 for t in self.moved if t.to == to and (source is None or t.source == source))

    def run(self, announce: Callable[[list[str]], None] | None = None) -> None:
        """Log and count the changes, announce the events (``announce``: the caller's own
        announcer, e.g. a worker's thread), settle tenants' charges, send what the API sends
        itself and wake the dispatcher for the rest, and broadcast aborts."""
        _emit(self.moved, by=self.by, worker=self.worker, **self.fields)
        (announce or outbox.announce)(self.events)
        if self.usage:
            fairshare.settle(self.usage)
        if self.send:
            dispatch.send(self.send)
        if self.wake:
            dispatch.wake(self.wake)
        for job_id in self.abort:
            try:
                dispatch.publish_control("cancel", job_id=job_id)
            except redis.RedisError as exc:
                # The workers' heartbeats read cancel_requested_at: the abort comes later.
                log.warning("could not broadcast the abort of %s: %s", job_id, exc)


def _emit(transitions: Iterable[Transition], *, by: By, worker: str | None, **fields: Any) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    enabled = log.isEnabledFor(logging.INFO)
    for t in transitions:
        if t.source is None and t.to == JobStatus.QUEUED:
            JOBS_SUBMITTED.labels(t.lane, t.model).inc()
        elif t.to in TERMINAL:
            JOBS_FINISHED.labels(t.lane, t.model, t.to).inc()
        if not enabled:
            continue
        line: dict[str, Any] = {
            "ts": stamp,
            "event": f"job.{t.to}",
            "job_id": t.job_id,
            "lane": t.lane,
            "model": t.model,
            "tenant": t.tenant,
            "from": t.source,
            "to": t.to,
            "by": by,
            "worker": worker,
        }
        if t.attempt is not None:
            line["attempt"] = t.attempt
        if t.error_code is not None:
            line["error_code"] = t.error_code
        line.update(fields)
        log.info(json.dumps(line, separators=(",", ":")))


def _refunds(rows: Iterable[Any]) -> list[fairshare.Usage]:
    """Give back what the dispatcher charged for jobs that will not run on that charge
    (rows with ``lane``, ``model``, ``tenant`` and ``charged``)."""
    return [fairshare.Usage(r.lane, r.model, r.tenant, r.charged, 0) for r in rows if r.charged]


def _moved(
    rows: Iterable[Any], to: str, source: str, error_code: str | None = None
) -> list[Transition]:
    """The transitions of rows an UPDATE returned: ``id``, ``lane``, ``model``, ``tenant``
    and, where it was returned, ``attempts``."""
    return [
        Transition(
            r.id, r.lane, r.model, r.tenant, to, source, getattr(r, "attempts", None), error_code
        )
        for r in rows
    ]


def compare_and_set(
    job_id: str | Collection[str] | ColumnElement[bool],
    *,
    expect: str,
    to: str | None = None,
    token: int | None = None,
    **values: Any,
) -> Update:
    """An UPDATE that changes a job (or several: ids, or a condition) only while its status
    (and lease token, when given) are still what the caller saw; ``to`` must be an allowed
    transition."""
    if to is not None:
        if not can_transition(expect, to):
            raise ValueError(f"a job cannot go from {expect} to {to}")
        values["status"] = to
    if isinstance(job_id, ColumnElement):
        which = job_id
    else:
        which = Job.id == job_id if isinstance(job_id, str) else Job.id.in_(list(job_id))
    statement = update(Job).where(which, Job.status == expect)
    if token is not None:
        statement = statement.where(Job.lease_token == token)
    return statement.values(**values)


# --- queued: created, cancelled, expired ------------------------------------------------------


def new_row(**values: Any) -> dict[str, Any]:
    """The row of a new job: queued, never claimed. ``values`` are its other columns."""
    return {**values, "status": JobStatus.QUEUED, "attempts": 0, "lease_token": 0}


def as_job(row: dict[str, Any]) -> Job:
    """A new job's row as the (unsaved) ORM object the API answers with."""
    return Job(**row)


@functools.cache
def _column_names() -> dict[str, str]:
    """The ORM attribute -> column name of every job column (``meta`` is "metadata")."""
    return {attr.key: attr.columns[0].name for attr in inspect(Job).column_attrs}


def create(
    connection: Connection,
    rows: Sequence[dict[str, Any]],
    *,
    by: By,
    direct: bool = False,
    **fields: Any,
) -> After:
    """Insert new jobs (rows from :func:`new_row`). After the commit they are sent by the
    dispatcher, in its order, or with ``direct`` by the caller itself: one job whose queue was
    empty (nobody waits, so no order is at stake); its row says it is sent already, so the
    dispatcher leaves it alone (docs/architecture.md, "Fair share"). ``fields`` go into their
    log lines (a batch's id)."""
    if any(row["status"] != JobStatus.QUEUED for row in rows):
        raise ValueError("a new job starts queued (transitions.new_row)")
    if direct:
        for row in rows:
            row["enqueued_at"] = row["created_at"]
    names = _column_names()
    table = cast(Table, Job.__table__)
    # Core executemany, not the ORM unit of work: it was a third of a bulk request's cost. A
    # single row (a realtime call) is a plain execute: no executemany machinery for one.
    for start in range(0, len(rows), INSERT_CHUNK):
        chunk = [
            {names[k]: v for k, v in row.items()} for row in rows[start : start + INSERT_CHUNK]
        ]
        connection.execute(insert(table), chunk[0] if len(chunk) == 1 else chunk)
    queues = [(r["id"], dispatch.queue_of(r["lane"], r["model"])) for r in rows]
    return After(
        by,
        moved=[
            Transition(r["id"], r["lane"], r["model"], r["tenant"], JobStatus.QUEUED) for r in rows
        ],
        send=queues if direct else [],
        wake=set() if direct else {name for _, name in queues},
        fields=fields,
    )


def cancel(connection: Connection, job_id: str, stamp: float) -> After:
    """Cancel a job: a queued one ends ``cancelled``; a running one is marked for its worker to
    abort (``After.abort``); a finished one is left as it is."""
    return _stop(connection, Job.id == job_id, stamp, to=JobStatus.CANCELLED, by="api")


def expire_queued(
    connection: Connection,
    which: Collection[str] | ColumnElement[bool],
    stamp: float,
    by: By,
) -> After:
    """The queued jobs among ``which`` (ids, or a condition) whose deadline has passed end
    ``expired`` unstarted."""
    if not isinstance(which, ColumnElement):
        if not which:
            return After(by)
        which = list(which)
    ended = connection.execute(
        compare_and_set(
            which,
            expect=JobStatus.QUEUED,
            to=JobStatus.EXPIRED,
            finished_at=stamp,
            updated_at=stamp,
            error_code=DEADLINE_EXCEEDED,
            error_message="the job's timeout_s passed before it started",
        )
        .where(Job.deadline_at <= stamp)
        .returning(Job.id, Job.lane, Job.model, Job.tenant, Job.charged)
        .execution_options(synchronize_session=False)
    ).all()
    if not ended:
        return After(by)
    return After(
        by,
        moved=_moved(ended, JobStatus.EXPIRED, JobStatus.QUEUED, DEADLINE_EXCEEDED),
        events=outbox.record_job_events(connection, [r.id for r in ended], stamp),
        usage=_refunds(ended),
    )


def unsend(connection: Connection, job_ids: Collection[str], *, by: By) -> After:
    """Queued jobs whose message was taken back (``dispatch.take_back``) have none again: the
    dispatcher sends them later, and the charge of the send that did not happen is refunded.
    A job a worker claimed meanwhile (a second message) keeps its charge and runs."""
    if not job_ids:
        return After(by)
    which = (
        Job.id.in_(list(job_ids)),
        Job.status == JobStatus.QUEUED,
        Job.enqueued_at.is_not(None),
    )
    rows = connection.execute(
        select(Job.id, Job.lane, Job.model, Job.tenant, Job.charged).where(*which).with_for_update()
    ).all()
    if rows:
        connection.execute(
            update(Job)
            .where(Job.id.in_([r.id for r in rows]), *which[1:])
            .values(enqueued_at=None, charged=0)
            .execution_options(synchronize_session=False)
        )
    return After(by, usage=_refunds(rows))


STOPPED_BY_BATCH = {
    "batch_cancelled": "the batch was cancelled",
    "batch_expired": "the batch's completion window ended before this request ran",
}


def stop_batch(
    connection: Connection, batch_id: str, stamp: float, *, to: str, code: str, by: By
) -> After:
    """End a batch's queued jobs with ``to`` and mark its running ones for their workers to
    abort. Batch lines have no webhook_url, so no event is looked for (a batch holds up to
    50,000 lines)."""
    return _stop(
        connection,
        Job.batch_id == batch_id,
        stamp,
        to=to,
        by=by,
        error_code=code,
        error_message=STOPPED_BY_BATCH[code],
        events=False,
    )


def _stop(
    connection: Connection,
    which: ColumnElement[bool],
    stamp: float,
    *,
    to: str,
    by: By,
    error_code: str | None = None,
    error_message: str | None = None,
    events: bool = True,
) -> After:
    """The queued jobs ``which`` selects end ``to``; the running ones are marked cancelled for
    their workers to abort (the heartbeat reads the mark if the broadcast is missed)."""
    if not can_transition(JobStatus.QUEUED, to):
        raise ValueError(f"a job cannot go from queued to {to}")
    ended = connection.execute(
        update(Job)
        .where(which, Job.status == JobStatus.QUEUED)
        .values(
            status=to,
            finished_at=stamp,
            updated_at=stamp,
            cancel_requested_at=stamp,
            error_code=error_code,
            error_message=error_message,
        )
        .returning(Job.id, Job.lane, Job.model, Job.tenant, Job.charged)
        .execution_options(synchronize_session=False)
    ).all()
    running = connection.execute(
        update(Job)
        .where(which, Job.status == JobStatus.RUNNING)
        .values(cancel_requested_at=stamp, updated_at=stamp)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    ).scalars()
    return After(
        by,
        moved=_moved(ended, to, JobStatus.QUEUED, error_code),
        events=outbox.record_job_events(connection, [r.id for r in ended], stamp) if events else [],
        usage=_refunds(ended),
        abort=list(running),
    )


# --- running: claimed, recorded, handed back, reclaimed ---------------------------------------


@dataclass(frozen=True)
class Lease:
    """A claimed job as the worker that holds it knows it: the fencing token and what a log
    line and an outcome write need."""

    job_id: str
    token: int
    lane: str
    model: str
    tenant: str
    attempt: int
    webhook: bool  # the job has a webhook_url: its end writes an event
    charged: int = 0  # what the dispatcher charged its tenant (app/core/fairshare.py)

    def usage(self, used: int) -> fairshare.Usage:
        """The settlement of this claim's charge with ``used`` tokens."""
        return fairshare.Usage(self.lane, self.model, self.tenant, self.charged, used)

    def moved(self, to: str, source: str, error_code: str | None = None) -> Transition:
        return Transition(
            self.job_id, self.lane, self.model, self.tenant, to, source, self.attempt, error_code
        )


# What a claim returns of each job: its lease and what its engine request is made of.
CLAIMED = (
    Job.id,
    Job.lease_token,
    Job.lane,
    Job.model,
    Job.tenant,
    Job.attempts,
    Job.webhook_url,
    Job.relay,
    Job.reply_to,
    Job.prompt,
    Job.messages,
    Job.params,
    Job.tools,
    Job.created_at,
    Job.deadline_at,
    Job.charged,
)


def lease_of(row: Any) -> Lease:
    """The lease of a row :func:`claim` returned."""
    return Lease(
        job_id=row.id,
        token=row.lease_token,
        lane=row.lane,
        model=row.model,
        tenant=row.tenant,
        attempt=row.attempts,
        webhook=row.webhook_url is not None,
        charged=row.charged,
    )


def _claim_statement(which: ColumnElement[bool]) -> Any:
    """The claim of the jobs ``which`` selects: built once, its parameters bound per call (it
    runs for every message a worker takes)."""
    return (
        compare_and_set(
            which,
            expect=JobStatus.QUEUED,
            to=JobStatus.RUNNING,
            lease_token=Job.lease_token + 1,
            lease_owner=bindparam("b_worker"),
            lease_expires_at=bindparam("b_lease"),
            attempts=Job.attempts + 1,
            started_at=bindparam("b_stamp"),
            updated_at=bindparam("b_stamp"),
        )
        .where(or_(Job.deadline_at.is_(None), Job.deadline_at > bindparam("b_stamp")))
        .returning(*CLAIMED)
    )


_CLAIM_ONE = _claim_statement(Job.id == bindparam("b_id"))
_CLAIM_MANY = _claim_statement(Job.id.in_(bindparam("b_ids", expanding=True)))


def claim(
    connection: Connection, job_ids: Sequence[str], *, worker: str, lease_s: float, stamp: float
) -> tuple[list[Row[Any]], After]:
    """Claim the queued ones among ``job_ids`` (``queued → running``, a new lease token, one
    more attempt) in input order; the ones past their deadline expire instead. The rows
    have the columns of :data:`CLAIMED`.

    One statement in the usual case (every job queued and in time); the expiry is looked for
    only among the jobs the claim did not take (a realtime message claims its one job).
    """
    statement, which = (
        (_CLAIM_ONE, {"b_id": job_ids[0]})
        if len(job_ids) == 1
        else (_CLAIM_MANY, {"b_ids": list(job_ids)})
    )
    params = {"b_worker": worker, "b_lease": stamp + lease_s, "b_stamp": stamp, **which}
    rows = list(connection.execute(statement, params).all())
    taken = {row.id for row in rows}
    after = expire_queued(connection, [i for i in job_ids if i not in taken], stamp, "worker")
    order = {job_id: i for i, job_id in enumerate(job_ids)}
    rows.sort(key=lambda row: order[row.id])
    after.worker = worker
    after.moved += _moved(rows, JobStatus.RUNNING, JobStatus.QUEUED)
    return rows, after


def choice(
    index: int, text: str, finish_reason: str | None, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One choice as ``Job.choices`` holds it (a worker may add ``tool_calls`` and
    ``content``: workers/tools.py)."""
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


@dataclass(frozen=True)
class Outcome:
    """How a running job ended, and what it produced."""

    status: JobStatus
    error_code: str | None = None
    error_message: str | None = None
    text: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token_at: float | None = None
    choices: list[dict[str, Any]] | None = None  # see Job.choices

    def __post_init__(self) -> None:
        if not can_transition(JobStatus.RUNNING, self.status) or self.status == JobStatus.QUEUED:
            raise ValueError(f"a running job cannot end {self.status}")

    @property
    def used(self) -> int:
        """The tokens this job cost the engine: its tenant's share is settled with them."""
        return (self.prompt_tokens or 0) + (self.completion_tokens or 0)

    def row(self) -> dict[str, Any]:
        """The columns this outcome writes, exactly as they are stored."""
        return {
            "status": str(self.status),
            "error_code": self.error_code,
            "error_message": self.error_message,
            # PostgreSQL text cannot hold NUL, which a model can emit: U+FFFD is stored.
            "result_text": _nul_free(self.text),
            "finish_reason": self.finish_reason,
            "choices": _nul_free(self.choices),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "first_token_at": self.first_token_at,
        }


def _nul_free(value: Any) -> Any:
    """``value`` with NUL, which a model can emit and PostgreSQL cannot store (text or JSONB),
    as U+FFFD in every string."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_nul_free(v) for v in value]
    if isinstance(value, dict):
        return {k: _nul_free(v) for k, v in value.items()}
    return value


# The fenced outcome write, one row per parameter set (see record).
_RECORD = (
    update(Job)
    .where(
        Job.id == bindparam("b_id"),
        Job.lease_token == bindparam("b_token"),
        Job.status == JobStatus.RUNNING,
    )
    .values(
        status=bindparam("b_status"),
        finished_at=bindparam("b_stamp"),
        updated_at=bindparam("b_stamp"),
        lease_expires_at=None,
        error_code=bindparam("b_error_code"),
        error_message=bindparam("b_error_message"),
        result_text=bindparam("b_result_text"),
        finish_reason=bindparam("b_finish_reason"),
        choices=bindparam("b_choices", type_=Job.__table__.c.choices.type),
        prompt_tokens=bindparam("b_prompt_tokens"),
        completion_tokens=bindparam("b_completion_tokens"),
        first_token_at=bindparam("b_first_token_at"),
    )
)


_RECORD_ONE = _RECORD.returning(Job.id)


def _record_params(lease: Lease, outcome: Outcome, stamp: float) -> dict[str, Any]:
    params = {f"b_{column}": value for column, value in outcome.row().items()}
    return params | {"b_id": lease.job_id, "b_token": lease.token, "b_stamp": stamp}


def record(
    connection: Connection,
    ended: Sequence[tuple[Lease, Outcome]],
    *,
    worker: str,
    stamp: float,
) -> tuple[list[bool], After]:
    """Write outcomes, each fenced by its own lease token; returns which were written.

    Every row whose status and token are still ours is written (:func:`_write_outcomes`); a
    worker that lost its lease (paused, cut off, presumed dead) changes nothing. Per-row
    round trips made the recorder the bottleneck of a busy worker (docs/architecture.md,
    "Group commit").
    """
    written = _write_outcomes(connection, ended, stamp)
    recorded = [item for item, ok in zip(ended, written, strict=True) if ok]
    hooked = [lease.job_id for lease, _ in recorded if lease.webhook]
    after = After(
        "worker",
        moved=[lease.moved(o.status, JobStatus.RUNNING, o.error_code) for lease, o in recorded],
        events=outbox.record_job_events(connection, hooked, stamp),
        usage=[lease.usage(o.used) for lease, o in recorded],
        worker=worker,
    )
    return written, after


def _write_outcomes(
    connection: Connection, ended: Sequence[tuple[Lease, Outcome]], stamp: float
) -> list[bool]:
    """Which of the fenced outcome writes changed their row. One outcome (what a realtime
    job's worker records at a time): its UPDATE returns the row it changed. Several: one
    executemany, then one read by token and this write's stamp (an executemany returns no
    rows)."""
    if len(ended) == 1:
        lease, outcome = ended[0]
        changed = connection.execute(_RECORD_ONE, _record_params(lease, outcome, stamp)).first()
        return [changed is not None]
    connection.execute(_RECORD, [_record_params(lease, o, stamp) for lease, o in ended])
    rows = connection.execute(
        select(Job.id, Job.lease_token, Job.finished_at).where(
            Job.id.in_([lease.job_id for lease, _ in ended])
        )
    ).all()
    mine = {row.id for row in rows if row.finished_at == stamp}
    tokens = {row.id: row.lease_token for row in rows}
    return [lease.job_id in mine and tokens.get(lease.job_id) == lease.token for lease, _ in ended]


def hand_back(connection: Connection, lease: Lease, stamp: float, *, worker: str) -> After:
    """Return a job this worker cannot finish to the queue without waiting for its lease to
    run out (shutdown, a dead engine); the dispatcher sends it again (and charges it again:
    this charge is refunded)."""
    back = connection.execute(
        compare_and_set(
            lease.job_id,
            expect=JobStatus.RUNNING,
            to=JobStatus.QUEUED,
            token=lease.token,
            lease_owner=None,
            lease_expires_at=None,
            enqueued_at=None,
            updated_at=stamp,
        ).returning(Job.lane, Job.model)
    ).first()
    if back is None:
        return After("worker", worker=worker)
    return After(
        "worker",
        moved=[lease.moved(JobStatus.QUEUED, JobStatus.RUNNING)],
        wake={dispatch.queue_of(back.lane, back.model)},
        usage=[lease.usage(0)],
        worker=worker,
        fields={"reason": "handed_back"},
    )


def reclaim(
    connection: Connection, rows: Iterable[Any], stamp: float, *, max_attempts: int
) -> After:
    """Jobs whose lease ran out (their worker was killed, paused or cut off): past their
    deadline they end ``expired``; after ``max_attempts`` claims ``failed`` (worker_lost);
    otherwise they are queued again for the dispatcher to send. Either way their tenants'
    charges are refunded. ``rows``: ``id``, ``attempts``, ``deadline_at``.

    The old worker's token no longer matches once the job is claimed again, so its late
    writes change nothing (:func:`record`).
    """
    ends: dict[str, dict[str, Any]] = {
        JobStatus.EXPIRED: {
            "error_code": DEADLINE_EXCEEDED,
            "error_message": "the job's timeout_s passed while its worker was lost",
            "finished_at": stamp,
        },
        JobStatus.FAILED: {
            "error_code": WORKER_LOST,
            "error_message": f"its worker was lost {max_attempts} times",
            "finished_at": stamp,
        },
        JobStatus.QUEUED: {"enqueued_at": None},
    }
    groups: dict[str, list[str]] = {to: [] for to in ends}
    for row in rows:
        if row.deadline_at is not None and row.deadline_at <= stamp:
            groups[JobStatus.EXPIRED].append(row.id)
        elif row.attempts >= max_attempts:
            groups[JobStatus.FAILED].append(row.id)
        else:
            groups[JobStatus.QUEUED].append(row.id)
    after = After("reaper")
    for to, ids in groups.items():
        if not ids:
            continue
        changed = connection.execute(
            compare_and_set(
                ids,
                expect=JobStatus.RUNNING,
                to=to,
                lease_owner=None,
                lease_expires_at=None,
                updated_at=stamp,
                **ends[to],
            )
            .where(Job.lease_expires_at < stamp)
            .returning(Job.id, Job.lane, Job.model, Job.tenant, Job.attempts, Job.charged)
        ).all()
        code = ends[to].get("error_code", "lease_expired")
        after.moved += _moved(changed, to, JobStatus.RUNNING, code)
        after.usage += _refunds(changed)
        if to == JobStatus.QUEUED:
            after.wake |= {dispatch.queue_of(row.lane, row.model) for row in changed}
        else:
            after.events += outbox.record_job_events(connection, [r.id for r in changed], stamp)
    return after
