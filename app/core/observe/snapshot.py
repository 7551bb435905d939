"""What the system looks like right now, read from Redis and the database; shared by
`inferq status`, `inferq up`, the console (app/api/console) and the API's /metrics and
/metrics: each lane's jobs, each tenant's share of them, the last minutes' throughput and the
backlog's drain estimates. Who is up (the workers' presence records, and their /metrics for
Prometheus's service discovery) is app/core/processes/presence.py's.

Nothing here is kept in memory between calls: every function reads its source afresh, so any
process (the CLI, any API process) gives the same answer at the same moment.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import redis
from sqlalchemy import BigInteger, Connection, case, cast, func, literal_column, select
from sqlalchemy.orm import Session

from app.core.messaging.names import (
    AFFINITY_OVERFLOW_KEY,
    AFFINITY_SENT_KEY,
    DRAIN_METRIC,
    Route,
    own_queues,
    queue_of,
    routes,
    shared_of,
)
from app.core.models import Job, JobStatus, live
from app.core.observe import missing
from app.core.observe.shapes import (
    Affinity,
    LaneJobs,
    Snapshot,
    TenantJobs,
    TenantRoute,
    Throughput,
)
from app.core.processes import presence
from app.core.scheduling import catalog
from app.core.settings import LANES, Settings, hide_password
from app.core.storage import store


def take(client: redis.Redis, db: Session, settings: Settings, window_s: float = 60.0) -> Snapshot:
    """Everything `inferq status` draws and ``GET /v1/admin/status`` sends, read now: Redis's
    presence records and queue lengths first, then the database's counts (a Redis or database
    error is the caller's to report). ``window_s``: the throughput's and the tenants' window."""
    now = time.time()
    workers = presence.workers(client)
    models = catalog.names(catalog.counts(workers))
    return Snapshot(
        taken_at=now,
        messages=queue_messages(client, routes(models)),
        ops=presence.ops_workers(client),
        dispatchers=presence.dispatchers(client),
        affinity=affinity_counts(client),
        workers=workers,
        lanes=lane_jobs(db, now, models),
        throughput=throughput(db, now, window_s),
        tenants=tenant_jobs(db, now, window_s),
        warnings=[m.message() for m in missing.find(db, client, settings)],
        sources=sources(settings),
    )


def sources(settings: Settings) -> str:
    """The Redis, database and file store that ``settings`` read, passwords hidden."""
    return (
        f"Redis {hide_password(settings.redis_url)}, "
        f"database {hide_password(settings.sqlalchemy_url)}, files {store.describe(settings)}"
    )


def affinity_counts(client: redis.Redis) -> dict[str, Affinity]:
    """Each worker's prefix-affinity counts since the dispatchers began counting."""
    with client.pipeline(transaction=False) as pipe:
        pipe.hgetall(AFFINITY_SENT_KEY)
        pipe.hgetall(AFFINITY_OVERFLOW_KEY)
        sent, overflow = pipe.execute()

    def text(raw: Any) -> str:
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    sent = {text(k): int(v) for k, v in sent.items()}
    overflow = {text(k): int(v) for k, v in overflow.items()}
    return {w: Affinity(sent.get(w, 0), overflow.get(w, 0)) for w in sorted({*sent, *overflow})}


def queue_messages(client: redis.Redis, routes: Sequence[Route]) -> dict[Route, int]:
    """Messages waiting in the Redis list of each route's queue.

    With ``priority_steps=[0]`` (app/core/messaging/broker.py) kombu keeps a queue's messages in one
    list named after the queue. Messages a worker has fetched but not acknowledged are not counted.
    A route's messages in the workers' own queues of it (prefix affinity, ``names.own_queue``)
    count with it.
    """
    names: dict[str, list[Route]] = {}
    for lane, model in routes:
        names.setdefault(queue_of(lane, model), []).append((lane, model))
    own = own_queues(client)
    lists = [*names, *(q for q in sorted(own) if shared_of(q) in names)]
    with client.pipeline(transaction=False) as pipe:
        for name in lists:
            pipe.llen(name)
        sizes = pipe.execute()
    found = dict.fromkeys(routes, 0)
    for name, size in zip(lists, sizes, strict=True):
        for route in names[shared_of(name)]:
            found[route] += int(size)
    return found


def lane_jobs(db: Session | Connection, now: float, models: Sequence[str]) -> dict[Route, LaneJobs]:
    """Queued and running jobs per lane of each model and the age of each one's oldest queued
    job: every lane of ``models``, and of any other model that has such jobs."""
    rows = db.execute(
        select(Job.lane, Job.model, Job.status, func.count(), func.min(Job.created_at))
        .where(live(JobStatus.QUEUED, JobStatus.RUNNING))
        .group_by(Job.lane, Job.model, Job.status)
    ).all()
    counts: dict[tuple[str, str, str], int] = {}
    oldest: dict[Route, float] = {}
    for lane, model, status, count, first_created in rows:
        counts[(lane, model, status)] = int(count)
        if status == JobStatus.QUEUED and first_created is not None:
            # Clocks of the API hosts and this one may disagree a little; an age is never < 0.
            oldest[(lane, model)] = max(0.0, now - float(first_created))
    return {
        (lane, model): LaneJobs(
            queued=counts.get((lane, model, JobStatus.QUEUED), 0),
            running=counts.get((lane, model, JobStatus.RUNNING), 0),
            oldest_queued_age_s=oldest.get((lane, model), 0.0),
        )
        for lane, model in routes(models, ((lane, model) for lane, model, *_ in rows))
    }


def throughput(db: Session | Connection, now: float, window_s: float = 60.0) -> Throughput:
    """Jobs that finished in the last ``window_s`` seconds, by status, and the completion
    tokens of the succeeded ones."""
    succeeded_tokens = case(
        (Job.status == JobStatus.SUCCEEDED, func.coalesce(Job.completion_tokens, 0)), else_=0
    )
    rows = db.execute(
        select(Job.status, func.count(), func.sum(succeeded_tokens))
        .where(Job.finished_at > now - window_s, Job.finished_at <= now)
        .group_by(Job.status)
    ).all()
    return Throughput(
        window_s=window_s,
        finished={status: int(count) for status, count, _ in rows},
        completion_tokens=sum(int(tokens or 0) for _, _, tokens in rows),
    )


def _lane_order(key: TenantRoute) -> tuple[int, str, str]:
    """Lanes in priority order (a lane no longer configured last), then tenant, then model."""
    lane, model, tenant = key
    return (LANES.index(lane) if lane in LANES else len(LANES), tenant, model)


def tenant_jobs(
    db: Session | Connection, now: float, window_s: float = 60.0
) -> dict[TenantRoute, TenantJobs]:
    """Each tenant's queued and running jobs per (lane, model), and the tokens of its jobs that
    finished there in the last ``window_s`` seconds, in lane priority order, then by tenant.

    Tokens count whatever the job's end: they are what the worker that ran it recorded, so a
    job that never ran counts none.

    A tenant has a row in a lane while it has queued or running jobs there or jobs that
    finished there in the window; otherwise none (and no series on /metrics), rather than a
    row of zeros for every tenant that ever submitted.
    """
    active = db.execute(
        select(Job.lane, Job.model, Job.tenant, Job.status, func.count())
        .where(live(JobStatus.QUEUED, JobStatus.RUNNING))
        .group_by(Job.lane, Job.model, Job.tenant, Job.status)
    ).all()
    completion = func.coalesce(func.sum(Job.completion_tokens), 0)
    served = db.execute(
        select(
            Job.lane,
            Job.model,
            Job.tenant,
            func.coalesce(func.sum(Job.prompt_tokens), 0) + completion,
            completion,
        )
        .where(Job.finished_at > now - window_s, Job.finished_at <= now)
        .group_by(Job.lane, Job.model, Job.tenant)
    ).all()
    counts = {(lane, model, tenant, status): int(n) for lane, model, tenant, status, n in active}
    tokens = {
        (lane, model, tenant): (int(total or 0), int(completion_tokens or 0))
        for lane, model, tenant, total, completion_tokens in served
    }
    keys = {key[:3] for key in counts} | set(tokens)
    return {
        key: TenantJobs(
            window_s=window_s,
            queued=counts.get((*key, JobStatus.QUEUED), 0),
            running=counts.get((*key, JobStatus.RUNNING), 0),
            tokens_served=tokens.get(key, (0, 0))[0],
            completion_tokens=tokens.get(key, (0, 0))[1],
        )
        for key in sorted(keys, key=_lane_order)
    }


def finished_per_minute(
    db: Session | Connection, now: float, minutes: int = 15, tenant: str | None = None
) -> list[tuple[float, dict[str, int]]]:
    """Jobs that finished in each of the last ``minutes`` whole minutes and the one going on,
    by lane, oldest first: (the minute's start, {lane: jobs}); the tenant's (every tenant's:
    ``None``)."""
    start = (int(now) // 60 - minutes) * 60
    # Floor division of a whole-second stamp: a minute on SQLite and PostgreSQL alike (a
    # double's CAST rounds on one and truncates on the other: a second's difference at most).
    # ``//``, not ``/``: SQLAlchemy 2's ``/`` is true division even of integers (it renders
    # ``/ (60 + 0.0)`` on SQLite, a NUMERIC cast on PostgreSQL), which grouped jobs by
    # fractional minutes. The 60 is written into the SQL: as a bound parameter, PostgreSQL
    # would see the SELECT's and the GROUP BY's expressions as two different ones.
    minute = cast(Job.finished_at, BigInteger) // literal_column("60")
    query = (
        select(minute, Job.lane, func.count())
        .where(Job.finished_at >= start)
        .group_by(minute, Job.lane)
    )
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    found: dict[int, dict[str, int]] = {}
    for at, lane, count in db.execute(query).all():
        lanes = found.setdefault(int(at), {})
        lanes[lane] = lanes.get(lane, 0) + int(count)  # rows of one minute add up
    first = start // 60
    return [(float(m * 60), found.get(m, {})) for m in range(first, first + minutes + 1)]


def drain_estimates(client: redis.Redis, timeout_s: float = 1.0) -> dict[Route, float]:
    """The backlog's drain estimate per (lane, model), as the ops worker exports it on its
    /metrics (docs/kubernetes.md, "Autoscaling on the backlog"): {} when no ops worker answers
    in time (the estimate needs the worker rate it measures; nothing else has it)."""
    import httpx  # here: `inferq status` does not scrape, and starts without them
    from prometheus_client.parser import text_string_to_metric_families

    for record in presence.ops_workers(client):
        url = str(record.get("metrics_url") or "")
        if not url:
            continue
        try:
            page = httpx.get(url, timeout=timeout_s)
            page.raise_for_status()
        except httpx.HTTPError:
            continue
        found: dict[Route, float] = {}
        for family in text_string_to_metric_families(page.text):
            for sample in family.samples:
                if sample.name == DRAIN_METRIC:
                    found[(sample.labels["lane"], sample.labels["model"])] = float(sample.value)
        return found
    return {}
