"""The reaper: the sweep that makes every committed job reach a terminal state.

Run by beat on the ops worker every ``INFERQ_REAPER_INTERVAL_S``. The database is the truth and a
Redis message only a hint, so the sweep repairs what a crash or a lost message left behind:

1. **Expired leases**: a ``running`` job whose lease ran out (its worker was killed, paused or cut
   off) goes back to ``queued`` for the dispatcher to send again (app/dispatcher); its
   ``attempts`` grows with the next claim. After
   ``INFERQ_MAX_ATTEMPTS`` claims it ends ``failed`` (``worker_lost``) instead, and one past its
   deadline ends ``expired``. The old worker's token no longer matches, so its late writes change
   nothing (the fence in app/core/lifecycle/transitions.py, which makes every change here).
2. **Lost with Redis**: Redis restarted empty or was wiped. The reaper keeps a marker key in
   Redis; when it is gone, every queued job marked sent is marked unsent (``enqueued_at``
   empty), and the dispatcher sends it again. That is logged as a loss only when there was such
   a job: with none, it is a first meeting with this Redis (or an empty Redis that held nothing
   of ours), and nothing was lost. Messages lost some other way (the last second before a crash with
   ``appendfsync everysec``, a process that stamped a job sent and died before sending it) are
   found when a queue's list (a lane of one model) is empty while jobs of it have been queued
   for longer than ``REAPER_GRACE_S`` since they were sent.
3. **Deadlines**: a queued job past its deadline ends ``expired`` without waiting for a worker.

Jobs that were never sent are not the reaper's: the dispatcher sends every queued job without
``enqueued_at``, in its fair order (docs/architecture.md, "Fair share").

Sending a job twice is harmless: a claim is a compare-and-set, so a second message for the same
job claims nothing. Several ops workers may sweep at once: rows are taken with ``FOR UPDATE SKIP
LOCKED`` on PostgreSQL, and every change is a compare-and-set on the status, so on SQLite (one
writer at a time) a row changes once whoever gets there first.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import redis
from sqlalchemy import and_, or_, select
from sqlalchemy.engine import Connection
from sqlalchemy.exc import InterfaceError, OperationalError

from app.core.db import session_scope
from app.core.lifecycle import transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import clients
from app.core.messaging.names import EPOCH_KEY, queue_of, routes
from app.core.models import Job, JobStatus, live, now
from app.core.observe import snapshot
from app.core.scheduling import catalog
from app.core.settings import Settings
from workers import metrics

log = logging.getLogger("inferq.reaper")

REAPER_GRACE_S = 10.0  # a job this young may still be on its way to Redis
SWEEP_LIMIT = 5000  # rows per step and sweep: a huge backlog is repaired over several sweeps


def sweep(settings: Settings) -> dict[str, int]:
    """One pass of the reaper; returns what it did (for the task log and Flower)."""
    try:
        return _sweep(settings)
    except (OperationalError, InterfaceError) as exc:
        # The database is down: the next sweep does the same work once it is back.
        log.warning("reaper: database unavailable, skipping this sweep: %s", exc.orig or exc)
        return {}


def _sweep(settings: Settings) -> dict[str, int]:
    stamp = now()
    with changes("reaper") as tx:
        overdue = _take(tx.connection, live(JobStatus.QUEUED), Job.deadline_at <= stamp)
        transitions.expire_queued(tx, [r.id for r in overdue], stamp)
        transitions.reclaim(
            tx,
            _take(tx.connection, live(JobStatus.RUNNING), Job.lease_expires_at < stamp),
            stamp,
            max_attempts=settings.max_attempts,
        )
    after = tx.after  # the dispatcher was woken for the jobs queued again
    requeued = after.count(JobStatus.QUEUED, source=JobStatus.RUNNING)
    if requeued:
        log.warning("reaper: %d job(s) lost their worker; queued again", requeued)
    forgotten = 0
    if _redis_was_emptied():
        with changes("reaper") as tx:
            forgotten = transitions.forget_lost(tx, stamp, None)
        # No marker and no job marked sent: a first meeting with this Redis (or an empty one
        # that held no message of ours), nothing lost. A warning only for messages really lost.
        if forgotten:
            log.warning(
                "Redis lost its data (restart or wipe): %d queued job(s) whose messages it held "
                "are sent again",
                forgotten,
            )
        else:
            log.info("reaper: marker set in Redis (no message of a queued job was lost)")
    else:
        lost = _empty_queues_with_waiting_jobs(stamp, settings)
        if lost:
            names = [queue_of(lane, model) for lane, model in lost]
            log.warning("queue(s) %s are empty but hold queued jobs: sending them again", names)
            with changes("reaper") as tx:
                forgotten = transitions.forget_lost(tx, stamp, _routes(lost), names)
    counts = {
        "requeued": requeued,
        "failed": after.count(JobStatus.FAILED),
        "expired": after.count(JobStatus.EXPIRED),
        "resent": forgotten,
    }
    summary = {action: n for action, n in counts.items() if n}
    for action, n in summary.items():
        metrics.REAPER_ACTIONS.labels(action).inc(n)
    if summary:
        log.info("reaper: %s", summary)
    return summary


def _take(connection: Connection, *conditions: Any) -> list[Any]:
    """Rows to repair, locked against other sweepers (PostgreSQL) and bounded per sweep."""
    query = (
        select(Job.id, Job.lane, Job.model, Job.attempts, Job.deadline_at)
        .where(*conditions)
        .limit(SWEEP_LIMIT)
        .with_for_update(skip_locked=True)
    )
    return list(connection.execute(query).all())


def _redis_was_emptied() -> bool:
    """True once after Redis lost its data: the marker this sets is gone (or never was)."""
    try:
        return bool(clients.redis_client().set(EPOCH_KEY, secrets.token_hex(8), nx=True))
    except redis.RedisError:
        return False


def _empty_queues_with_waiting_jobs(stamp: float, settings: Settings) -> list[tuple[str, str]]:
    """(lane, model) of the known models' queues whose list is empty while jobs of theirs,
    sent more than ``REAPER_GRACE_S`` ago, are still queued. (A model nobody serves or
    accepts has no worker to lose messages to; its jobs are sent when one announces it.)"""
    known = routes(catalog.names())
    try:
        sizes = snapshot.queue_messages(clients.redis_client(), known)
    except redis.RedisError:
        return []
    empty = [route for route in known if not sizes[route]]
    if not empty:
        return []
    with session_scope() as session:
        waiting = session.execute(
            select(Job.lane, Job.model)
            .where(
                live(JobStatus.QUEUED),
                _routes(empty),
                Job.enqueued_at < stamp - REAPER_GRACE_S,
            )
            .group_by(Job.lane, Job.model)
        ).all()
    found = {(row.lane, settings.base_of(row.model)) for row in waiting}
    return [route for route in empty if route in found]


def _routes(routes: list[tuple[str, str]]) -> Any:
    """Rows of the queues ``routes`` ((lane, base model) pairs): a base model's queue also
    carries its LoRA adapters' jobs."""
    return or_(
        *(
            and_(Job.lane == lane, Job.model.in_(catalog.served_names(base)))
            for lane, base in routes
        )
    )
