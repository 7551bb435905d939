"""What the system looks like right now, read from Redis and the database; shared by
`inferq status`, `inferq up`, the console (app/api/console) and the API's /metrics and
/metrics/targets (Prometheus service discovery of the workers' own /metrics): each lane's jobs,
each tenant's share of them, the workers and the last minutes' throughput.

Nothing here is kept in memory between calls: every function reads its source afresh, so any
process (the CLI, any API process) gives the same answer at the same moment.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import BigInteger, Connection, case, cast, func, literal_column, select
from sqlalchemy.orm import Session

from app.core.models import Job, JobStatus
from app.core.names import DRAIN_METRIC, PRESENCE_KEY_PREFIXES, Role, queue_of
from app.core.settings import LANES

Route = tuple[str, str]  # (lane, model): one Celery queue (app/core/names.py, queue_of)
TenantRoute = tuple[str, str, str]  # (lane, model, tenant): one tenant's jobs in one queue


def routes(models: Iterable[str], found: Iterable[Route] = ()) -> list[Route]:
    """Every lane of ``models``, and the ``found`` routes of other models, in display order:
    model by model (``models`` first), each model's lanes in priority order."""
    order = list(dict.fromkeys([*models, *sorted({model for _, model in found})]))
    return [(lane, model) for model in order for lane in LANES]


@dataclass(frozen=True)
class LaneJobs:
    queued: int = 0
    running: int = 0
    oldest_queued_age_s: float = 0.0


@dataclass(frozen=True)
class Throughput:
    window_s: float
    finished: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    @property
    def jobs_per_s(self) -> float:
        return sum(self.finished.values()) / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.window_s


@dataclass(frozen=True)
class TenantJobs:
    """One tenant's queued and running jobs in one model's lane, and the tokens of its jobs
    there that finished in the last ``window_s`` seconds."""

    window_s: float
    queued: int = 0
    running: int = 0
    # Prompt + completion tokens: what serving the tenant cost, the unit its fair share is
    # settled in (app/core/fairshare.py).
    tokens_served: int = 0
    completion_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_served / self.window_s


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    messages: dict[Route, int]
    lanes: dict[Route, LaneJobs]
    workers: list[dict[str, Any]]
    throughput: Throughput
    ops: list[dict[str, Any]] = field(default_factory=list)
    tenants: dict[TenantRoute, TenantJobs] = field(default_factory=dict)
    dispatchers: list[dict[str, Any]] = field(default_factory=list)
    # Parts of the deployment whose work waits with no live process (app/core/missing.py).
    warnings: list[str] = field(default_factory=list)


def queue_messages(client: redis.Redis, routes: Sequence[Route]) -> dict[Route, int]:
    """Messages waiting in the Redis list of each route's queue.

    With ``priority_steps=[0]`` (app/core/broker.py) kombu keeps a queue's messages in one list
    named after the queue. Messages a worker has fetched but not acknowledged are not counted.
    """
    with client.pipeline(transaction=False) as pipe:
        for lane, model in routes:
            pipe.llen(queue_of(lane, model))
        sizes = pipe.execute()
    return {route: int(size) for route, size in zip(routes, sizes, strict=True)}


def queued_jobs(db: Session | Connection) -> dict[Route, int]:
    """Queued jobs per (lane, model), for admission's backpressure.

    Apart from :func:`lane_jobs` because it runs every second while a backlog is deepest:
    this count is answered from the ``(status, lane)`` index and the rows' models, where the
    oldest job's age reads every queued row's creation time too.
    """
    rows = db.execute(
        select(Job.lane, Job.model, func.count())
        .where(Job.status == JobStatus.QUEUED)
        .group_by(Job.lane, Job.model)
    ).all()
    return {(lane, model): int(count) for lane, model, count in rows}


def lane_jobs(db: Session | Connection, now: float, models: Sequence[str]) -> dict[Route, LaneJobs]:
    """Queued and running jobs per lane of each model and the age of each one's oldest queued
    job: every lane of ``models``, and of any other model that has such jobs."""
    rows = db.execute(
        select(Job.lane, Job.model, Job.status, func.count(), func.min(Job.created_at))
        .where(Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
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


def presence(client: redis.Redis, role: Role) -> list[dict[str, Any]]:
    """The presence records of live processes of ``role`` (``inference`` or ``ops``;
    ``workers/presence.py``), sorted by worker id.

    A record expires a few heartbeats after its process stops announcing, so a dead worker
    drops out of this list by itself.
    """
    prefix = PRESENCE_KEY_PREFIXES[role]
    found: list[dict[str, Any]] = []
    for key in client.scan_iter(match=prefix + "*", count=100):
        raw = client.get(key)
        if raw is None:  # expired between SCAN and GET
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        name = key.decode() if isinstance(key, bytes) else str(key)
        record.setdefault("worker_id", name.removeprefix(prefix))
        found.append(record)
    return sorted(found, key=lambda record: str(record["worker_id"]))


def workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live inference workers (``workers/inference/heartbeat.py``), sorted by worker id."""
    return presence(client, "inference")


def ops_workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live ops workers (``workers/ops.py``), sorted by worker id."""
    return presence(client, "ops")


def dispatchers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live dispatchers (``app/dispatcher/loop.py``), sorted by id."""
    return presence(client, "dispatcher")


# Target labels taken from a presence record; `worker`, `engine` and `model` are also the labels
# of inferq_worker_info, so a query can join a target's series on them.
TARGET_LABELS = {"worker": "worker_id", "engine": "engine", "model": "model"}


def metrics_targets(client: redis.Redis) -> list[dict[str, Any]]:
    """Every live worker's and ops worker's /metrics, in Prometheus's HTTP service discovery
    format: ``[{"targets": ["host:port"], "labels": {...}}]``, one group per process.

    Labels: ``role`` (``inference`` or ``ops``), ``worker`` (the worker id), ``engine`` and
    ``model`` (inference workers), and ``__scheme__`` and ``__metrics_path__`` from the URL the
    process announced. A record without a metrics URL (a worker still starting) is left out.
    """
    groups: list[dict[str, Any]] = []
    for role in PRESENCE_KEY_PREFIXES:
        for record in presence(client, role):
            url = urlsplit(str(record.get("metrics_url") or ""))
            if not url.netloc:
                continue
            labels = {
                "role": role,
                "__scheme__": url.scheme or "http",
                "__metrics_path__": url.path or "/metrics",
            }
            for label, field_name in TARGET_LABELS.items():
                if record.get(field_name):
                    labels[label] = str(record[field_name])
            groups.append({"targets": [url.netloc], "labels": labels})
    return groups


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
        .where(Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
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
    # Integer division of a whole-second stamp: a minute on SQLite and PostgreSQL alike (a
    # double's CAST rounds on one and truncates on the other: a second's difference at most).
    # The 60 is written into the SQL: as a bound parameter, PostgreSQL would see the SELECT's
    # and the GROUP BY's expressions as two different ones.
    minute = cast(Job.finished_at, BigInteger) / literal_column("60")
    query = (
        select(minute, Job.lane, func.count())
        .where(Job.finished_at >= start)
        .group_by(minute, Job.lane)
    )
    if tenant is not None:
        query = query.where(Job.tenant == tenant)
    found: dict[int, dict[str, int]] = {}
    for at, lane, count in db.execute(query).all():
        found.setdefault(int(at), {})[lane] = int(count)
    first = start // 60
    return [(float(m * 60), found.get(m, {})) for m in range(first, first + minutes + 1)]


def drain_estimates(client: redis.Redis, timeout_s: float = 1.0) -> dict[Route, float]:
    """The backlog's drain estimate per (lane, model), as the ops worker exports it on its
    /metrics (docs/kubernetes.md, "Autoscaling on the backlog"): {} when no ops worker answers
    in time (the estimate needs the worker rate it measures; nothing else has it)."""
    for record in ops_workers(client):
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
