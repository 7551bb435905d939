"""Each model's backlog and the workers it needs: the signal an autoscaler scales inference
workers on (docs/kubernetes.md, "Autoscaling on the backlog").

The dispatcher keeps Celery's lists only as deep as the live workers need, so a list's length
does not show the backlog: the database does. For a model ``m`` (an adapter's jobs count on its
base's workers) and a lane ``l``, at time ``t``::

    work(m, l)   = sum of cost(j) over m's queued and running jobs j in l
                   (cost: the tokens the dispatcher charges, app/core/scheduling/fairshare.py; a
                   running job counts whole: what it has left is not known)
    rate(m)      = the cost one worker of m ends per second when it is full (measured: below)
    drain(m, l)  = sum of work(m, l') over l and the lanes above it / (workers(m) * rate(m))
                   (the lanes above run first; infinite with no live worker)
    need(m, l)   = the cost per second that keeps l on time:
                   max( work(m, l) / target(l),
                        max over the deadlines d of l's jobs of
                            work(m, l, deadline <= d) / max(d - t - STARTUP_S, FLOOR_S) )
    desired(m)   = 0          nothing queued or running, and nothing ended since the last sample
                 = max(1, ceil(sum over l of need(m, l) / rate(m)))   otherwise

A job that ended since the last sample keeps ``desired`` at 1: a realtime trickle whose jobs
each take less than a sample's interval would otherwise read as idle at most samples, and be
scaled to zero under its own traffic. ``target(l)`` is ``INFERQ_AUTOSCALE_TARGET_S``; a
deadline is a job's ``deadline_at`` (its ``timeout_s``, a lane's default, or its batch's
completion window). ``STARTUP_S`` keeps back the time a new worker needs before it runs
anything. Scaled on ``desired`` with a target of 1 per replica, KEDA's and the
HorizontalPodAutoscaler's rule ``replicas = ceil(metric / target)`` gives exactly ``desired``
workers.

The rate is measured where it can be seen whole, from the jobs that end::

    sample(m)    = cost of m's jobs that ended in the last SAMPLE_S / (SAMPLE_S * workers(m))
                   kept only when m had jobs waiting to be sent at both ends of the sample and
                   the same workers throughout: then every worker of m was full
    rate(m)      = mean of the last RATE_SAMPLES samples kept; before the first one, the
                   last rate kept in Redis, else INFERQ_AUTOSCALE_WORKER_RATE

Everything here is pure or reads its source afresh; the ops worker that runs beat samples it
and exports it (workers/ops/autoscale.py), so it is counted once per deployment.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection, Integer, cast, func, select
from sqlalchemy.orm import Session

from app.core.messaging.names import Route
from app.core.models import UNSENT, Job, JobStatus, live
from app.core.settings import LANES, Settings

SAMPLE_S = 5.0  # how often the ops worker reads the backlog and takes a rate sample
RATE_SAMPLES = 6  # the rate is the mean of this many full samples (30 s)
BUCKET_S = 10.0  # deadlines are grouped in buckets this wide (one row per bucket, not per job)
STARTUP_S = 30.0  # kept back from every deadline: a new worker's start
FLOOR_S = 5.0  # the shortest time a deadline's work is given (one past due needs a lot, not inf)


@dataclass(frozen=True)
class Queued:
    """The queued and running jobs of one lane of one (base) model with deadlines in one
    bucket (``deadline`` None: no deadline)."""

    model: str
    lane: str
    deadline: float | None  # the earliest deadline the bucket may hold
    jobs: int
    cost: int


def read(db: Session | Connection, settings: Settings) -> list[Queued]:
    """The backlog, grouped by base model, lane and deadline bucket."""
    bucket = cast(Job.deadline_at / BUCKET_S, Integer)
    rows = db.execute(
        select(Job.model, Job.lane, bucket, func.count(), func.coalesce(func.sum(Job.cost), 0))
        .where(live(JobStatus.QUEUED, JobStatus.RUNNING))
        .group_by(Job.model, Job.lane, bucket)
    ).all()
    # CAST truncates on SQLite and rounds on PostgreSQL: bucket k holds deadlines from
    # (k - 0.5) * BUCKET_S at the earliest either way.
    return [
        Queued(
            settings.base_of(model),
            lane,
            None if k is None else (int(k) - 0.5) * BUCKET_S,
            int(jobs),
            int(cost),
        )
        for model, lane, k, jobs, cost in rows
    ]


def ended_cost(db: Session | Connection, since: float, settings: Settings) -> dict[str, int]:
    """The cost of each (base) model's jobs that ended after ``since`` having run."""
    rows = db.execute(
        select(Job.model, func.coalesce(func.sum(Job.cost), 0))
        .where(Job.finished_at > since, Job.started_at.is_not(None))
        .group_by(Job.model)
    ).all()
    ended: dict[str, int] = {}
    for model, cost in rows:
        base = settings.base_of(model)
        ended[base] = ended.get(base, 0) + int(cost)
    return ended


def waiting(db: Session | Connection, settings: Settings) -> set[str]:
    """The (base) models that have jobs waiting to be sent (their workers are full)."""
    rows = db.execute(select(Job.model).where(UNSENT).distinct()).scalars()
    return {settings.base_of(model) for model in rows}


def need(backlog: Iterable[Queued], lane: str, now: float, target_s: float) -> float:
    """need(m, l): the cost per second that drains ``backlog`` (one model's) of ``lane`` within
    ``target_s`` and meets each of its deadlines."""
    mine = sorted(
        (q for q in backlog if q.lane == lane),
        key=lambda q: math.inf if q.deadline is None else q.deadline,
    )
    total = sum(q.cost for q in mine)
    most = total / target_s if target_s > 0 else math.inf
    before = 0
    for q in mine:
        before += q.cost
        if q.deadline is not None:
            most = max(most, before / max(q.deadline - now - STARTUP_S, FLOOR_S))
    return most


def desired(
    backlog: Sequence[Queued],
    now: float,
    rate: float,
    targets: Mapping[str, float],
    ended: bool = False,
) -> int:
    """desired(m) for one model's ``backlog``, its workers' ``rate`` (cost per second each);
    ``ended``: one of its jobs ended since the last sample."""
    if not any(q.jobs for q in backlog):
        return 1 if ended else 0
    needed = sum(need(backlog, lane, now, targets.get(lane, math.inf)) for lane in LANES)
    return max(1, math.ceil(needed / rate))


def drain_s(backlog: Iterable[Queued], lane: str, workers: int, rate: float) -> float:
    """drain(m, l): seconds the live ``workers`` need for ``lane`` and the lanes above it."""
    rank = LANES.index(lane)
    work = sum(q.cost for q in backlog if LANES.index(q.lane) <= rank)
    if not work:
        return 0.0
    return work / (workers * rate) if workers and rate > 0 else math.inf


@dataclass
class RateMeter:
    """rate(m) from the samples taken while m's workers were full."""

    fallback: float
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def add(self, ended: int, seconds: float, workers: int) -> None:
        if workers and seconds > 0:
            self.samples.append(ended / (seconds * workers))

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    @property
    def rate(self) -> float:
        if not self.samples:
            return self.fallback
        return max(sum(self.samples) / len(self.samples), 1e-9)


@dataclass(frozen=True)
class Signal:
    """What is exported for one model."""

    model: str
    workers: int
    rate: float
    measured: bool
    desired: int
    jobs: dict[str, int]  # per lane
    cost: dict[str, int]
    drain_s: dict[str, float]


def signal(
    model: str,
    backlog: Sequence[Queued],
    workers: int,
    meter: RateMeter,
    now: float,
    targets: Mapping[str, float],
    ended: bool = False,
) -> Signal:
    """The exported figures of one model from its ``backlog`` and live ``workers`` (``ended``:
    one of its jobs ended since the last sample)."""
    mine = [q for q in backlog if q.model == model]
    return Signal(
        model=model,
        workers=workers,
        rate=meter.rate,
        measured=meter.measured,
        desired=desired(mine, now, meter.rate, targets, ended),
        jobs={lane: sum(q.jobs for q in mine if q.lane == lane) for lane in LANES},
        cost={lane: sum(q.cost for q in mine if q.lane == lane) for lane in LANES},
        drain_s={lane: drain_s(mine, lane, workers, meter.rate) for lane in LANES},
    )


def queued_jobs(db: Session | Connection) -> dict[Route, int]:
    """Queued jobs per (lane, model), for admission's backpressure.

    Apart from ``snapshot.lane_jobs`` (app/core/observe/snapshot.py) because it runs every
    second while a backlog is deepest: this count is answered from the ``(status, lane)`` index
    and the rows' models, where the oldest job's age reads every queued row's creation time too.
    """
    rows = db.execute(
        select(Job.lane, Job.model, func.count())
        .where(live(JobStatus.QUEUED))
        .group_by(Job.lane, Job.model)
    ).all()
    return {(lane, model): int(count) for lane, model, count in rows}
