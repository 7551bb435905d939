"""The reaper: the sweep that makes every committed job reach a terminal state.

Run by beat on the ops worker every ``INFERQ_REAPER_INTERVAL_S``. The database is the truth and a
Redis message only a hint, so the sweep repairs what a crash or a lost message left behind:

1. **Expired leases**: a ``running`` job whose lease ran out (its worker was killed, paused or cut
   off) goes back to ``queued`` and is re-sent; its ``attempts`` grows with the next claim. After
   ``INFERQ_MAX_ATTEMPTS`` claims it ends ``failed`` (``worker_lost``) instead, and one past its
   deadline ends ``expired``. The old worker's token no longer matches, so its late writes change
   nothing (the fence in workers/executor.py).
2. **Never sent**: a ``queued`` job without ``enqueued_at`` (the API or a worker committed it and
   could not send its message, or crashed in between) is sent once it is ``REAPER_GRACE_S`` old.
3. **Lost with Redis**: Redis restarted empty or was wiped. The reaper keeps a marker key in
   Redis; when it is gone, every queued job is sent again. Messages lost some other way (the
   last second before a crash with ``appendfsync everysec``) are found when a lane's list is
   empty while jobs of that lane have been queued for longer than ``REAPER_GRACE_S``.
4. **Deadlines**: a queued job past its deadline ends ``expired`` without waiting for a worker.

Sending a job twice is harmless: a claim is a compare-and-set, so a second message for the same
job claims nothing. Several ops workers may sweep at once: rows are taken with ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL, and every change is a compare-and-set on the status, so on SQLite (one
writer at a time) a row changes once whoever gets there first.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import or_, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError

from app.core import dispatch, jobs, outbox, snapshot, transitions
from app.core.db import session_scope
from app.core.models import DEADLINE_EXCEEDED, Job, JobStatus, expire_overdue, job_update, now
from app.core.settings import LANES, get_settings
from app.core.transitions import Transition
from workers import metrics

log = logging.getLogger("inferq.reaper")

EPOCH_KEY = "inferq:epoch"
REAPER_GRACE_S = 10.0  # a job this young may still be on its way to Redis
SWEEP_LIMIT = 5000  # rows per step and sweep: a huge backlog is repaired over several sweeps


@dataclass
class Reaped:
    failed: int = 0
    expired: int = 0
    sent: int = 0
    # Queued again by this sweep: sent now, without the grace that protects the API's own sends.
    requeued_ids: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    moved: list[Transition] = field(default_factory=list)

    def summary(self) -> dict[str, int]:
        counts = {
            "requeued": len(self.requeued_ids),
            "failed": self.failed,
            "expired": self.expired,
            "sent": self.sent,
        }
        return {k: v for k, v in counts.items() if v}


def sweep() -> dict[str, int]:
    """One pass of the reaper; returns what it did (for the task log and Flower)."""
    try:
        return _sweep()
    except (OperationalError, InterfaceError) as exc:
        # The database is down: the next sweep does the same work once it is back.
        log.warning("reaper: database unavailable, skipping this sweep: %s", exc.orig or exc)
        return {}


def _sweep() -> dict[str, int]:
    reaped = Reaped()
    stamp = now()
    with session_scope() as session:
        connection = session.connection()
        _expire_queued(connection, stamp, reaped)
        _reclaim_leases(connection, stamp, reaped)
    transitions.emit(reaped.moved, by="reaper")
    if _redis_was_emptied():
        log.warning("Redis lost its data (restart or wipe): sending every queued job again")
        _forget_enqueued(stamp, lanes=LANES)
    else:
        lost = _empty_lanes_with_waiting_jobs(stamp)
        if lost:
            log.warning("lane(s) %s are empty but hold queued jobs: sending them again", lost)
            _forget_enqueued(stamp, lanes=lost)
    reaped.sent = _send_unsent(stamp, reaped.requeued_ids)
    outbox.announce(reaped.events)
    summary = reaped.summary()
    for action, n in summary.items():
        metrics.REAPER_ACTIONS.labels(action).inc(n)
    if summary:
        log.info("reaper: %s", summary)
    return summary


def _take(connection: Connection, *conditions: Any) -> list[Any]:
    """Rows to repair, locked against other sweepers (PostgreSQL) and bounded per sweep."""
    query = (
        select(Job.id, Job.lane, Job.attempts, Job.deadline_at)
        .where(*conditions)
        .limit(SWEEP_LIMIT)
        .with_for_update(skip_locked=True)
    )
    return list(connection.execute(query).all())


def _expire_queued(connection: Connection, stamp: float, reaped: Reaped) -> None:
    rows = _take(connection, Job.status == JobStatus.QUEUED, Job.deadline_at <= stamp)
    ids = [row.id for row in rows]
    if not ids:
        return
    ended = transitions.of_rows(
        connection.execute(expire_overdue(ids, stamp)),
        JobStatus.EXPIRED,
        JobStatus.QUEUED,
        DEADLINE_EXCEEDED,
    )
    reaped.expired += len(ended)
    reaped.moved += ended
    reaped.events += outbox.record_job_events(connection, [t.job_id for t in ended], stamp)


def _reclaim_leases(connection: Connection, stamp: float, reaped: Reaped) -> None:
    settings = get_settings()
    rows = _take(connection, Job.status == JobStatus.RUNNING, Job.lease_expires_at < stamp)
    if not rows:
        return
    ends: dict[str, dict[str, Any]] = {
        JobStatus.EXPIRED: {
            "error_code": DEADLINE_EXCEEDED,
            "error_message": "the job's timeout_s passed while its worker was lost",
            "finished_at": stamp,
        },
        JobStatus.FAILED: {
            "error_code": "worker_lost",
            "error_message": f"its worker was lost {settings.max_attempts} times",
            "finished_at": stamp,
        },
        JobStatus.QUEUED: {"enqueued_at": None},
    }
    groups: dict[str, list[str]] = {to: [] for to in ends}
    for row in rows:
        if row.deadline_at is not None and row.deadline_at <= stamp:
            groups[JobStatus.EXPIRED].append(row.id)
        elif row.attempts >= settings.max_attempts:
            groups[JobStatus.FAILED].append(row.id)
        else:
            groups[JobStatus.QUEUED].append(row.id)
    ended: list[str] = []
    for to, ids in groups.items():
        if not ids:
            continue
        changed_rows = connection.execute(
            job_update(
                ids,
                expect=JobStatus.RUNNING,
                to=to,
                lease_owner=None,
                lease_expires_at=None,
                updated_at=stamp,
                **ends[to],
            )
            .where(Job.lease_expires_at < stamp)
            .returning(Job.id, Job.lane, Job.tenant, Job.attempts)
        ).all()
        changed = [row.id for row in changed_rows]
        code = ends[to].get("error_code", "lease_expired")
        reaped.moved += transitions.of_rows(changed_rows, to, JobStatus.RUNNING, code)
        if to == JobStatus.QUEUED:
            reaped.requeued_ids += changed
        else:
            ended += changed
            if to == JobStatus.EXPIRED:
                reaped.expired += len(changed)
            else:
                reaped.failed += len(changed)
    if reaped.requeued_ids:
        log.warning("reaper: %d job(s) lost their worker; queued again", len(reaped.requeued_ids))
    reaped.events += outbox.record_job_events(connection, ended, stamp)


def _redis_was_emptied() -> bool:
    """True once after Redis lost its data: the marker this sets is gone (or never was)."""
    try:
        return bool(dispatch.redis_client().set(EPOCH_KEY, secrets.token_hex(8), nx=True))
    except redis.RedisError:
        return False


def _empty_lanes_with_waiting_jobs(stamp: float) -> list[str]:
    try:
        sizes = snapshot.lane_messages(dispatch.redis_client())
        empty = [lane for lane, size in sizes.items() if not size]
    except redis.RedisError:
        return []
    if not empty:
        return []
    with session_scope() as session:
        rows = session.execute(
            select(Job.lane)
            .where(
                Job.status == JobStatus.QUEUED,
                Job.lane.in_(empty),
                Job.enqueued_at < stamp - REAPER_GRACE_S,
            )
            .group_by(Job.lane)
        ).scalars()
        return sorted(rows, key=LANES.index)


def _forget_enqueued(stamp: float, lanes: list[str] | tuple[str, ...]) -> None:
    """Mark the lanes' queued jobs as not sent, so that the next step sends them."""
    with session_scope() as session:
        unlocked = (
            select(Job.id)
            .where(
                Job.status == JobStatus.QUEUED,
                Job.lane.in_(list(lanes)),
                Job.enqueued_at < stamp,
            )
            .with_for_update(skip_locked=True)  # rows a claim holds are not lost
            .scalar_subquery()
        )
        session.execute(
            update(Job)
            .where(Job.id.in_(unlocked), Job.status == JobStatus.QUEUED)
            .values(enqueued_at=None)
            .execution_options(synchronize_session=False)
        )


def _send_unsent(stamp: float, requeued: list[str]) -> int:
    """Send queued jobs that have no message, oldest first (lane order within a message)."""
    with session_scope() as session:
        rows = session.execute(
            select(Job.id, Job.lane)
            .where(
                Job.status == JobStatus.QUEUED,
                Job.enqueued_at.is_(None),
                or_(Job.updated_at <= stamp - REAPER_GRACE_S, Job.id.in_(requeued)),
            )
            .order_by(Job.id)
            .limit(SWEEP_LIMIT)
            .with_for_update(skip_locked=True)
        ).all()
        if not rows:
            return 0
        jobs.send(session, [(row.id, row.lane) for row in rows])
        return len(rows)
