"""The one owner of a job's status and of its "sent" sub-state: every write of ``jobs.status``,
``jobs.enqueued_at`` and ``jobs.charged`` is in this module.

A job's life (docs/architecture.md, "Job states")::

    create ──► queued ──claim──► running ──record──► succeeded | failed | cancelled | expired
                 │ ▲                 │
                 │ └── hand_back ────┤ (this worker stops; the job runs again elsewhere)
                 │ └── reclaim ──────┤ (its lease ran out: queued again, or failed/expired)
                 └── cancel, expire_queued, stop_batch ──► cancelled | expired

While queued, a job is *unsent* (``enqueued_at`` empty: the dispatcher's to send) or *sent*
(a message is on its way, its tenant ``charged``)::

    unsent ──mark_sent (the dispatcher), create(direct) (the API)──► sent
    sent ──send_failed, take_back (its message taken back), forget_lost (lost with Redis),
           hand_back, reclaim──► unsent

Each function is a compare-and-set on the status (and, from ``running``, on the lease token)
in the caller's transaction (:class:`~app.core.lifecycle.after.Tx`), with the webhook outbox rows of
the jobs it ends (app/core/webhooks/outbox.py), and adds to the transaction's ``After`` what must
follow its commit (app/core/lifecycle/after.py): the construct that made the transaction runs it
once it has committed (app/core/lifecycle/changes.py), so a change that rolled back is never logged,
counted, announced or sent.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import (
    ColumnElement,
    Row,
    Select,
    Table,
    Update,
    bindparam,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    update,
)

from app.core.db import copy_rows
from app.core.lifecycle.after import Transition, Tx
from app.core.messaging import relay
from app.core.messaging.names import queue_of
from app.core.models import (
    HANGING_ON_A_JOB,
    TERMINAL,
    Job,
    JobStatus,
    NewJob,
    among,
    can_transition,
    live,
    status_is,
)
from app.core.scheduling import fairshare
from app.core.webhooks import outbox

DEADLINE_EXCEEDED = "deadline_exceeded"
WORKER_LOST = "worker_lost"
INSERT_CHUNK = 500  # rows per INSERT of new jobs


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
    statement = update(Job).where(which, status_is(expect))
    if token is not None:
        statement = statement.where(Job.lease_token == token)
    return statement.values(**values)


# --- queued: created, cancelled, expired ------------------------------------------------------


def create(tx: Tx, jobs: Sequence[NewJob], *, direct: bool = False) -> None:
    """Insert new jobs (``app.core.lifecycle.jobs.new_job``), queued. After the commit they are sent
    by the dispatcher, in its order, or with ``direct`` by the caller itself: one job whose queue
    was empty (nobody waits, so no order is at stake); its row says it is sent already, so the
    dispatcher leaves it alone (docs/architecture.md, "Fair share")."""
    for start in range(0, len(jobs), INSERT_CHUNK):
        chunk = [job.row() for job in jobs[start : start + INSERT_CHUNK]]
        if direct:
            for row in chunk:
                row["enqueued_at"] = row["created_at"]
        _insert_rows(tx, chunk)
    queues = [(job.id, queue_of(job.lane, job.model)) for job in jobs]
    after = tx.after
    after.moved += [
        Transition(job.id, job.lane, job.model, job.tenant, JobStatus.QUEUED) for job in jobs
    ]
    if direct:
        after.send += queues
    else:
        after.wake |= {name for _, name in queues}


def create_ended(tx: Tx, rows: Sequence[dict[str, Any]]) -> None:
    """Insert jobs that have already ended, as they ended (a terminal status, their times and
    results; column names as keys): history written in bulk, the ``history`` benchmark's month
    of finished jobs (bench/history.py). Nothing follows the commit: no log line, event or send,
    since none of these jobs changes here."""
    for row in rows:
        if row["status"] not in TERMINAL or row.get("finished_at") is None:
            raise ValueError(f"job {row['id']}: only an ended job is inserted as ended")
    _insert_rows(tx, rows)


def _insert_rows(tx: Tx, rows: Sequence[dict[str, Any]]) -> None:
    """Job rows inserted: on PostgreSQL more than one by COPY (one stream, not a statement a
    row); else Core's executemany, not the ORM unit of work (it was a third of a bulk request's
    cost), and a single row (a realtime call) as a plain execute."""
    if not rows:
        return
    table = cast(Table, Job.__table__)
    if len(rows) > 1 and tx.postgresql:
        copy_rows(tx.connection, table, rows)
    else:
        tx.connection.execute(insert(table), rows[0] if len(rows) == 1 else list(rows))


def cancel(tx: Tx, job_id: str, stamp: float) -> None:
    """Cancel a job: a queued one ends ``cancelled``; a running one is marked for its worker to
    abort (``After.abort``); a finished one is left as it is."""
    _stop(tx, Job.id == job_id, stamp, to=JobStatus.CANCELLED)


@dataclass(frozen=True, slots=True)
class Deleted:
    """The jobs of one tenant that ``delete_finished`` removed: how many, and the newest id."""

    tenant: str
    newest: str
    count: int


def delete_finished(tx: Tx, which: ColumnElement[bool]) -> list[Deleted]:
    """Remove the jobs ``which`` names that have ended, with what hangs on them (an idempotency
    key, a stored response, webhook events and, by their foreign key, their attempts); a job not
    ended is left (a running job is cancelled first). A stored response deleted by its caller,
    and retention's sweep (app/core/lifecycle/retention.py). Returns what was removed, a
    tenant at a time (retention raises each tenant's horizon to its newest).

    What hangs on a job is deleted here by its ``job_id``, a statement a table for all the
    jobs, not by a foreign key's ON DELETE CASCADE, which ran one statement per job and table
    inside the DELETE: 44 of a 72 ms chunk of 2,000 on PostgreSQL (migration 0016;
    docs/benchmarks.md, "Issue 66 ... fifth session"). This is the only place jobs are deleted
    (tests/unit/test_one_status_writer.py)."""
    jobs = delete(Job).where(which, status_is(*TERMINAL)).returning(Job.tenant, Job.id)
    if tx.postgresql:
        # One statement, each table's DELETE reading the jobs' RETURNING, and a row a tenant
        # back: the ids never travel (2,000 a chunk as an array parameter cost psycopg's
        # Python 27 ms, and read back as rows 11 ms).
        gone = jobs.cte("gone")
        hanging = [
            delete(column.class_).where(column.in_(select(gone.c.id))).cte(f"hanging_{n}")
            for n, column in enumerate(HANGING_ON_A_JOB)
        ]
        found = tx.connection.execute(
            select(gone.c.tenant, func.max(gone.c.id), func.count())
            .group_by(gone.c.tenant)
            .add_cte(*hanging)
        )
        return [Deleted(tenant, newest, count) for tenant, newest, count in found]
    ids: dict[str, list[str]] = {}
    for tenant, job_id in tx.connection.execute(jobs):
        ids.setdefault(tenant, []).append(job_id)
    if ids:
        # SQLite: the ids as one JSON text that SQLite itself lists (json_each), not 2,000
        # bound values, which SQLAlchemy expands in Python: a chunk took 10-25 % longer than
        # with the old cascades, and the one writer's lock is held meanwhile.
        listed: Select[tuple[str]] = select(literal_column("value")).select_from(
            func.json_each(json.dumps([job_id for some in ids.values() for job_id in some]))
        )
        for column in HANGING_ON_A_JOB:
            tx.connection.execute(delete(column.class_).where(column.in_(listed)))
    return [Deleted(tenant, max(some), len(some)) for tenant, some in ids.items()]


def expire_queued(tx: Tx, which: Collection[str] | ColumnElement[bool], stamp: float) -> int:
    """The queued jobs among ``which`` (ids, or a condition) whose deadline has passed end
    ``expired`` unstarted; returns how many."""
    if not isinstance(which, ColumnElement):
        if not which:
            return 0
        which = list(which)
    ended = tx.connection.execute(
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
    if ended:
        tx.after.moved += _moved(ended, JobStatus.EXPIRED, JobStatus.QUEUED, DEADLINE_EXCEEDED)
        tx.after.events += outbox.record_job_events(tx.connection, [r.id for r in ended], stamp)
        tx.after.usage += _refunds(ended)
    return len(ended)


# --- queued: sent and unsent ----------------------------------------------------------------


def mark_sent(
    tx: Tx, chosen: Select[tuple[str]], stamp: float, returning: Sequence[Any]
) -> list[Row[Any]]:
    """Stamp the unsent queued jobs among ``chosen`` (a select of ids) sent at ``stamp`` and
    charged their cost: the dispatcher's refill, which sends their messages before it commits
    (app/dispatcher/refill.py). Returns their ``returning`` columns."""
    return list(
        tx.connection.execute(
            update(Job)
            .where(
                Job.id.in_(chosen),
                status_is(JobStatus.QUEUED),
                Job.enqueued_at.is_(None),
            )
            .values(enqueued_at=stamp, charged=Job.cost)
            .returning(*returning)
            .execution_options(synchronize_session=False)
        ).all()
    )


def send_failed(tx: Tx, job_ids: Collection[str]) -> None:
    """Queued jobs marked sent whose message could not go out are unsent again, uncharged
    (nothing was charged in Redis for them yet); the dispatcher is woken for them."""
    if not job_ids:
        return
    rows = tx.connection.execute(
        update(Job)
        .where(Job.id.in_(list(job_ids)), status_is(JobStatus.QUEUED))
        .values(enqueued_at=None, charged=0)
        .returning(Job.lane, Job.model)
        .execution_options(synchronize_session=False)
    ).all()
    tx.after.wake |= {queue_of(row.lane, row.model) for row in rows}


def take_back(tx: Tx, job_ids: Collection[str]) -> None:
    """Queued jobs whose message was taken back out of its list (``broker.take_newest``) have
    none again: the dispatcher sends them later, and the charge of the send that did not
    happen is refunded. A job a worker claimed meanwhile (a second message) keeps its charge
    and runs."""
    if not job_ids:
        return
    which = (
        Job.id.in_(list(job_ids)),
        status_is(JobStatus.QUEUED),
        Job.enqueued_at.is_not(None),
    )
    rows = tx.connection.execute(
        select(Job.id, Job.lane, Job.model, Job.tenant, Job.charged).where(*which).with_for_update()
    ).all()
    if rows:
        tx.connection.execute(
            update(Job)
            .where(Job.id.in_([r.id for r in rows]), *which[1:])
            .values(enqueued_at=None, charged=0)
            .execution_options(synchronize_session=False)
        )
    tx.after.usage += _refunds(rows)


def forget_lost(
    tx: Tx, stamp: float, which: ColumnElement[bool] | None, queues: Iterable[str] = ()
) -> int:
    """The queued jobs (among ``which``, None: all) marked sent before ``stamp`` whose messages
    were lost (Redis restarted empty, a list found empty under them) are unsent again, for the
    dispatcher to send; ``queues`` are woken. Returns how many. A row a claim holds is
    skipped: its message was not lost.

    Their tenants are charged again when they are sent again, and not refunded now: after a
    wipe the counters are gone anyway, and a lost message is rare enough that the share it
    shifts does not matter (app/core/scheduling/fairshare.py)."""
    conditions = [live(JobStatus.QUEUED), Job.enqueued_at < stamp]
    if which is not None:
        conditions.append(which)
    unlocked = select(Job.id).where(*conditions).with_for_update(skip_locked=True)
    result = tx.connection.execute(
        update(Job)
        .where(Job.id.in_(unlocked.scalar_subquery()), status_is(JobStatus.QUEUED))
        .values(enqueued_at=None)
        .execution_options(synchronize_session=False)
    )
    forgotten = int(result.rowcount)  # type: ignore[attr-defined]
    if forgotten:
        tx.after.wake |= set(queues)
    return forgotten


# --- queued or running: stopped --------------------------------------------------------------

STOPPED_BY_BATCH = {
    "batch_cancelled": "the batch was cancelled",
    "batch_failed": "a later line of the batch's input file is invalid: the batch failed",
    "batch_expired": "the batch's completion window ended before this request ran",
}


def stop_batch(tx: Tx, batch_id: str, stamp: float, *, to: str, code: str) -> None:
    """End a batch's queued jobs with ``to`` and mark its running ones for their workers to
    abort. Batch lines have no webhook_url, so no event is looked for (a batch holds up to
    50,000 lines)."""
    _stop(
        tx,
        Job.batch_id == batch_id,
        stamp,
        to=to,
        error_code=code,
        error_message=STOPPED_BY_BATCH[code],
        events=False,
    )


def _stop(
    tx: Tx,
    which: ColumnElement[bool],
    stamp: float,
    *,
    to: str,
    error_code: str | None = None,
    error_message: str | None = None,
    events: bool = True,
) -> None:
    """The queued jobs ``which`` selects end ``to``; the running ones are marked cancelled for
    their workers to abort (the heartbeat reads the mark if the broadcast is missed)."""
    if not can_transition(JobStatus.QUEUED, to):
        raise ValueError(f"a job cannot go from queued to {to}")
    ended = tx.connection.execute(
        update(Job)
        .where(which, status_is(JobStatus.QUEUED))
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
    running = tx.connection.execute(
        update(Job)
        .where(which, status_is(JobStatus.RUNNING))
        .values(cancel_requested_at=stamp, updated_at=stamp)
        .returning(Job.id)
        .execution_options(synchronize_session=False)
    ).scalars()
    after = tx.after
    after.moved += _moved(ended, to, JobStatus.QUEUED, error_code)
    if events:
        after.events += outbox.record_job_events(tx.connection, [r.id for r in ended], stamp)
    after.usage += _refunds(ended)
    after.abort += list(running)


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
    # A caller waits on the line for it (its reply_to names the caller's waiter, not a kept
    # log): a call, never a background response, so its end writes no response.* event.
    on_line: bool = False
    charged: int = 0  # what the dispatcher charged its tenant (app/core/scheduling/fairshare.py)
    batch_id: str | None = None  # the batch whose line(s) the job runs

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
    Job.kind,
    Job.inputs,
    Job.lines,
    Job.batch_id,
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
        on_line=row.reply_to is not None and not relay.is_log(row.reply_to),
        charged=row.charged,
        batch_id=row.batch_id,
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
# By dialect: PostgreSQL's takes the ids as one array (models.among).
_CLAIM_MANY = {pg: _claim_statement(among(Job.id, "b_ids", postgresql=pg)) for pg in (False, True)}


def claim(
    tx: Tx, job_ids: Sequence[str], *, worker: str, lease_s: float, stamp: float
) -> list[Row[Any]]:
    """Claim the queued ones among ``job_ids`` (``queued → running``, a new lease token, one
    more attempt) in input order; the ones past their deadline expire instead. The rows
    have the columns of :data:`CLAIMED`.

    One statement in the usual case (every job queued and in time); the expiry is looked for
    only among the jobs the claim did not take (a realtime message claims its one job).
    """
    statement, which = (
        (_CLAIM_ONE, {"b_id": job_ids[0]})
        if len(job_ids) == 1
        else (_CLAIM_MANY[tx.postgresql], {"b_ids": list(job_ids)})
    )
    params = {"b_worker": worker, "b_lease": stamp + lease_s, "b_stamp": stamp, **which}
    rows = list(tx.connection.execute(statement, params).all())
    taken = {row.id for row in rows}
    expire_queued(tx, [i for i in job_ids if i not in taken], stamp)
    order = {job_id: i for i, job_id in enumerate(job_ids)}
    rows.sort(key=lambda row: order[row.id])
    tx.after.moved += _moved(rows, JobStatus.RUNNING, JobStatus.QUEUED)
    return rows


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
    # A pooled job's vectors or scores, packed (models.POOLED_DTYPE), ``pooled_width`` values
    # a row; a pooled batch job's lines, how each went (see Job.lines).
    pooled: bytes | None = None
    pooled_width: int | None = None
    failed_lines: int = 0
    line_results: dict[str, dict[str, Any]] | None = None

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
            # A NUL a model emits is stored as it is (app/core/models.py, ESCAPE).
            "result_text": self.text,
            "finish_reason": self.finish_reason,
            "choices": self.choices,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "first_token_at": self.first_token_at,
            "pooled": self.pooled,
            "pooled_width": self.pooled_width,
            "failed_lines": self.failed_lines,
            "line_results": self.line_results,
        }


# The fenced outcome write, one row per parameter set (see record).
_RECORD = (
    update(Job)
    .where(
        Job.id == bindparam("b_id"),
        Job.lease_token == bindparam("b_token"),
        status_is(JobStatus.RUNNING),
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
        pooled=bindparam("b_pooled", type_=Job.__table__.c.pooled.type),
        pooled_width=bindparam("b_pooled_width"),
        failed_lines=bindparam("b_failed_lines"),
        line_results=bindparam("b_line_results", type_=Job.__table__.c.line_results.type),
    )
)


_RECORD_ONE = _RECORD.returning(Job.id)


def _record_params(lease: Lease, outcome: Outcome, stamp: float) -> dict[str, Any]:
    params = {f"b_{column}": value for column, value in outcome.row().items()}
    return params | {"b_id": lease.job_id, "b_token": lease.token, "b_stamp": stamp}


def record(tx: Tx, ended: Sequence[tuple[Lease, Outcome]], *, stamp: float) -> list[bool]:
    """Write outcomes, each fenced by its own lease token; returns which were written.

    Every row whose status and token are still ours is written (:func:`_write_outcomes`); a
    worker that lost its lease (paused, cut off, presumed dead) changes nothing. Per-row
    round trips made the recorder the bottleneck of a busy worker (docs/architecture.md,
    "Group commit").
    """
    written = _write_outcomes(tx, ended, stamp)
    recorded = [item for item, ok in zip(ended, written, strict=True) if ok]
    ids = [lease.job_id for lease, _ in recorded]
    hooked = [lease.job_id for lease, _ in recorded if lease.webhook]
    responses = [lease.job_id for lease, _ in recorded if not lease.on_line]
    after = tx.after
    after.moved += [lease.moved(o.status, JobStatus.RUNNING, o.error_code) for lease, o in recorded]
    after.events += outbox.record_job_events(
        tx.connection, ids, stamp, hooked=hooked, responses=responses
    )
    after.usage += [lease.usage(o.used) for lease, o in recorded]
    after.finalize |= batches_done(tx, {lease.batch_id for lease, _ in recorded} - {None})
    return written


def batches_done(tx: Tx, batch_ids: set[str | None]) -> set[str]:
    """Which of ``batch_ids`` have no job left to run once this transaction commits: the ops
    worker finalizes them at once instead of at its next sweep. Two workers that end a
    batch's last two jobs at the same moment may each see the other's running: then the
    sweep finalizes it (INFERQ_BATCH_SWEEP_INTERVAL_S)."""
    if not batch_ids:
        return set()
    left = tx.connection.execute(
        select(Job.batch_id)
        .where(among(Job.batch_id, batch_ids, postgresql=tx.postgresql), status_is(*_LEFT))
        .distinct()
    ).scalars()
    return {b for b in batch_ids if b is not None} - set(left)


# A batch's jobs still to run.
_LEFT = (JobStatus.QUEUED, JobStatus.RUNNING)


def _write_outcomes(tx: Tx, ended: Sequence[tuple[Lease, Outcome]], stamp: float) -> list[bool]:
    """Which of the fenced outcome writes changed their row. One outcome (what a realtime
    job's worker records at a time): its UPDATE returns the row it changed. Several: one
    executemany, then one read by token and this write's stamp (an executemany returns no
    rows)."""
    if len(ended) == 1:
        lease, outcome = ended[0]
        changed = tx.connection.execute(_RECORD_ONE, _record_params(lease, outcome, stamp)).first()
        return [changed is not None]
    tx.connection.execute(_RECORD, [_record_params(lease, o, stamp) for lease, o in ended])
    ids = [lease.job_id for lease, _ in ended]
    rows = tx.connection.execute(
        select(Job.id, Job.lease_token, Job.finished_at).where(
            among(Job.id, ids, postgresql=tx.postgresql)
        )
    ).all()
    mine = {row.id for row in rows if row.finished_at == stamp}
    tokens = {row.id: row.lease_token for row in rows}
    return [lease.job_id in mine and tokens.get(lease.job_id) == lease.token for lease, _ in ended]


def hand_back(tx: Tx, lease: Lease, stamp: float) -> None:
    """Return a job this worker cannot finish to the queue without waiting for its lease to
    run out (shutdown, a dead engine); the dispatcher sends it again (and charges it again:
    this charge is refunded)."""
    back = tx.connection.execute(
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
        return
    after = tx.after
    after.moved.append(lease.moved(JobStatus.QUEUED, JobStatus.RUNNING))
    after.wake.add(queue_of(back.lane, back.model))
    after.usage.append(lease.usage(0))


def reclaim(tx: Tx, rows: Iterable[Any], stamp: float, *, max_attempts: int) -> None:
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
    after = tx.after
    for to, ids in groups.items():
        if not ids:
            continue
        changed = tx.connection.execute(
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
            after.wake |= {queue_of(row.lane, row.model) for row in changed}
        else:
            after.events += outbox.record_job_events(tx.connection, [r.id for r in changed], stamp)
