"""Retention: finished jobs deleted once their tenant's retention has passed (issue 66).

A job that has ended is deleted, with what hangs on it (its idempotency key, a stored response,
its webhook events and their attempts: ``transitions.delete_finished``), once::

    finished_at + retention(tenant) <= now        retention(tenant) > 0

``retention(tenant)``: the tenant's own (``tenants.job_retention_s``, set with ``inferq tenant
retention``) or ``INFERQ_JOB_RETENTION_S`` (30 days, as OpenAI keeps batch files); 0 keeps a
tenant's jobs forever. Not while something promised on the job is still owed:

- a batch line's job stays while its batch has not ended, or while the batch's output or
  error file is kept (the file is the user's copy of the results; it expires on its own,
  ``files.delete_expired``);
- a job with a webhook event still pending stays until the event is delivered or has failed
  its last attempt (its retries keep their schedule).

Each chunk (``chunk()`` jobs) is its own short transaction: the oldest finished jobs first
(``ix_jobs_finished_at``). On PostgreSQL they are taken with ``FOR UPDATE SKIP LOCKED``, so a
row a worker, a reader or another sweep holds is skipped rather than waited for, and the sweep
never holds a lock a submission waits on (new rows are not finished): 2,000 a chunk. On SQLite a
chunk holds the one writer's lock, which every submission waits for: 250 a chunk. In the same
transaction each tenant's horizon is raised: ``tenants.swept_through``, the newest job id
deleted (ids sort by creation time). A job id at or below its tenant's horizon that is no longer
there answers 404 ``job_expired`` (:func:`expired`); lists say where the horizon is
(:func:`horizon`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, exists, func, or_, select
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.exc import InterfaceError, OperationalError
from sqlalchemy.orm import Session

from app.core.db import get_engine
from app.core.errors import DomainError, Kind
from app.core.lifecycle import transitions
from app.core.lifecycle.after import Tx
from app.core.lifecycle.changes import changes
from app.core.models import (
    BATCH_TERMINAL,
    Batch,
    File,
    Job,
    Tenant,
    WebhookEvent,
    WebhookStatus,
    now,
)
from app.core.settings import MAX_RETENTION_S, Settings, get_settings

log = logging.getLogger("inferq.retention")

# Jobs a transaction: short enough that nothing waits long on it. On PostgreSQL a chunk locks
# only its own finished rows, and fewer, larger chunks did better beside a load (at 8,000
# jobs/s its TTFT p99 rose less with 2,000 than with 1,000: docs/benchmarks.md, "Issue 66").
CHUNK = 2000
# On SQLite a chunk holds the one writer's lock, which every submission waits for: at 6,000
# jobs/s, beside 16 clients over a million jobs, their TTFT p99 while it swept was 3.15 times
# that between its windows with chunks of 2,000 and 0.94 with 250 (pooled over the loads: 1.30
# and 1.09; docs/benchmarks.md, "Issue 66 ... ninth session"). Earlier runs that found small
# chunks no better were blurred by a heartbeat that held the lock 250 ms ("... seventh session").
SQLITE_CHUNK = 250


def chunk(postgresql: bool) -> int:
    """Jobs a sweep deletes in one transaction on the database."""
    return CHUNK if postgresql else SQLITE_CHUNK


JOB_ID = re.compile(r"job_[0-9a-z]{26}")


@dataclass(frozen=True, slots=True)
class Horizon:
    """Where a tenant's history ends: its retention (None: kept forever) and the newest job id
    retention has deleted (None: none yet)."""

    retention_s: int | None
    swept_through: str | None


@dataclass(frozen=True, slots=True)
class Kept:
    """What is kept of a tenant's history: its own retention (None: the deployment's), the
    one in force (0: forever), and how far retention has deleted, and when it last did."""

    tenant: str
    own_s: int | None
    retention_s: int
    swept_through: str | None
    swept_at: float | None


def kept(session: Session, tenant: str) -> Kept:
    """``tenant``'s row read once: what the admin API and the CLI show, and its horizon."""
    row = session.get(Tenant, tenant)
    own = None if row is None else row.job_retention_s
    return Kept(
        tenant=tenant,
        own_s=own,
        retention_s=get_settings().job_retention_s if own is None else own,
        swept_through=None if row is None else row.swept_through,
        swept_at=None if row is None else row.swept_at,
    )


def horizon(session: Session, tenant: str | None) -> Horizon:
    """``tenant``'s horizon (every tenant's, ``None``: the newest id deleted of any, and the
    deployment's default retention)."""
    if tenant is None:
        through = session.scalar(select(func.max(Tenant.swept_through)))
        return Horizon(get_settings().job_retention_s or None, through)
    found = kept(session, tenant)
    return Horizon(found.retention_s or None, found.swept_through)


def expired(session: Session, tenant: str | None, job_id: str) -> Horizon | None:
    """The horizon that ``job_id``, not found, lies behind (it was deleted by retention);
    None for an id that is not a job's or is newer than what retention has deleted."""
    if not JOB_ID.fullmatch(job_id):
        return None
    found = horizon(session, tenant)
    if found.swept_through is None or job_id > found.swept_through:
        return None
    return found


def kept_for(found: Horizon) -> str:
    """What an expired job's 404 says of its tenant's retention."""
    if found.retention_s is None:
        return "it was deleted by retention, which is now off for this tenant"
    days = found.retention_s / 86400
    span = f"{days:g} days" if days >= 1 else f"{found.retention_s} seconds"
    return f"finished jobs are deleted {span} after they end (retention)"


def set_retention(session: Session, tenant: str, retention_s: int | None) -> None:
    """Give ``tenant`` its own retention (``None``: the deployment's again); one over
    ``MAX_RETENTION_S`` is refused (keep such a tenant's jobs forever: 0)."""
    if retention_s is not None and not 0 <= retention_s <= MAX_RETENTION_S:
        raise DomainError(
            Kind.INVALID,
            "retention_out_of_range",
            f"a retention is 0 (forever) to {MAX_RETENTION_S} seconds "
            f"({MAX_RETENTION_S // 86400} days), not {retention_s}",
            param="job_retention_s",
        )
    stamp = now()
    row = session.get(Tenant, tenant)
    if row is None:
        session.add(Tenant(tenant=tenant, job_retention_s=retention_s, updated_at=stamp))
    else:
        row.job_retention_s = retention_s
        row.updated_at = stamp
    session.commit()


def _kept() -> ColumnElement[bool]:
    """What a finished job is still owed: its batch's output, or a webhook delivery."""
    batch_kept = exists().where(
        Batch.id == Job.batch_id,
        or_(
            Batch.status.not_in([str(s) for s in BATCH_TERMINAL]),
            exists().where(or_(File.id == Batch.output_file_id, File.id == Batch.error_file_id)),
        ),
    )
    delivery_owed = exists().where(
        WebhookEvent.job_id == Job.id, WebhookEvent.status == WebhookStatus.PENDING
    )
    return or_(and_(Job.batch_id.is_not(None), batch_kept), delivery_owed)


def _due(default_s: int, own: dict[str, int], stamp: float) -> list[ColumnElement[bool]]:
    """One condition per retention: the deployment's (tenants without their own) and each
    tenant's own; a retention of 0 deletes nothing."""
    due: list[ColumnElement[bool]] = []
    if default_s > 0:
        due.append(
            and_(Job.finished_at <= stamp - default_s, Job.tenant.not_in(list(own)))
            if own
            else Job.finished_at <= stamp - default_s
        )
    for tenant, seconds in own.items():
        if seconds > 0:
            due.append(and_(Job.tenant == tenant, Job.finished_at <= stamp - seconds))
    return due


def _chosen(due: ColumnElement[bool], postgresql: bool) -> Select[Any]:
    chosen = (
        select(Job.id)
        .where(due, Job.finished_at.is_not(None), ~_kept())
        .order_by(Job.finished_at)
        .limit(chunk(postgresql))
    )
    return chosen.with_for_update(skip_locked=True) if postgresql else chosen


def _raise_horizons(tx: Tx, deleted: Iterable[transitions.Deleted], stamp: float) -> None:
    """Each tenant's ``swept_through`` up to the newest id deleted (never down)."""
    newest = {d.tenant: d.newest for d in deleted}
    if not newest:
        return
    dialect = pg_dialect if tx.postgresql else sqlite_dialect
    table = Tenant.__table__
    statement = dialect.insert(table)
    greatest = func.greatest if tx.postgresql else func.max
    upsert = statement.on_conflict_do_update(
        index_elements=[table.c.tenant],
        set_={
            "swept_through": greatest(
                func.coalesce(table.c.swept_through, statement.excluded.swept_through),
                statement.excluded.swept_through,
            ),
            "swept_at": statement.excluded.swept_at,
        },
    )
    tx.connection.execute(
        upsert,
        [
            {"tenant": t, "swept_through": i, "swept_at": stamp, "updated_at": stamp}
            for t, i in sorted(newest.items())
        ],
    )


def sweep_once(settings: Settings, stamp: float) -> int:
    """One chunk: up to ``chunk()`` due jobs deleted in one transaction; returns how many."""
    with changes("ops", reason="retention") as tx:
        if tx.postgresql:
            # On a large history the choice's plan is estimated dear (its LIMIT's share of every
            # due row), above ``jit_above_cost``, so PostgreSQL compiled it with JIT every chunk:
            # 38 ms of a 107 ms chunk of 2,000 (docs/benchmarks.md, "Issue 66 ... fifth session").
            tx.connection.exec_driver_sql("SET LOCAL jit = off")
        own = {
            row.tenant: row.job_retention_s
            for row in tx.connection.execute(
                select(Tenant.tenant, Tenant.job_retention_s).where(
                    Tenant.job_retention_s.is_not(None)
                )
            )
        }
        due = _due(settings.job_retention_s, own, stamp)
        if not due:
            return 0
        deleted = transitions.delete_finished(
            tx, Job.id.in_(_chosen(or_(*due), tx.postgresql).scalar_subquery())
        )
        _raise_horizons(tx, deleted, stamp)
    return sum(d.count for d in deleted)


def sweep(settings: Settings, *, budget_s: float, stamp: float | None = None) -> int:
    """Delete the jobs due at ``stamp`` (now) a chunk at a time until none is left or
    ``budget_s`` has passed (the next sweep goes on); returns how many.

    Paced: after a chunk that put it ahead of ``retention_sweep_jobs_per_s``, it waits until
    the rate is met again. Unpaced, a sweep catching up on a million jobs deleted 30,000-50,000
    a second on two cores and raised the submissions' TTFT p99 1.6-2.2 times on PostgreSQL, up
    to 38 times on SQLite (docs/benchmarks.md, "Issue 66"); paced, it still outruns the 4,000
    jobs/s it must keep up with.
    """
    started = time.monotonic()
    stamp = now() if stamp is None else stamp
    rate = settings.retention_sweep_jobs_per_s
    size = chunk(get_engine().dialect.name == "postgresql")
    total = 0
    while True:
        try:
            deleted = sweep_once(settings, stamp)
        except (OperationalError, InterfaceError) as exc:
            # The database is down: what was deleted is committed; the next sweep goes on.
            log.warning("retention: database unavailable, sweep stopped: %s", exc.orig or exc)
            return total
        total += deleted
        elapsed = time.monotonic() - started
        if rate and deleted == size and total / rate > elapsed:
            time.sleep(max(0.0, min(total / rate, budget_s) - elapsed))
        if deleted < size or time.monotonic() - started >= budget_s:
            if total:
                log.info("retention: %d finished jobs deleted", total)
            return total


# The share of the beat's interval one sweep may take: the next one starts at the interval.
BEAT_BUDGET = 0.8


def sweep_beat(settings: Settings) -> int:
    """One sweep as the ops worker's beat sends it: until nothing is due or ``BEAT_BUDGET`` of
    ``retention_sweep_interval_s`` has passed, at ``retention_sweep_jobs_per_s``."""
    return sweep(settings, budget_s=settings.retention_sweep_interval_s * BEAT_BUDGET)
