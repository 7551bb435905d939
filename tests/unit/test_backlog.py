"""The backlog signal (app/core/scheduling/backlog.py, workers/ops/autoscale.py): the formula on its
own, the backlog read from a real SQLite file, and the gauges the ops worker exports, sampled from
jobs committed and ended through their owners."""

from __future__ import annotations

import json
import math

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import clients
from app.core.messaging.names import AUTOSCALE_RATE_PREFIX, WORKERS_KEY_PREFIX
from app.core.models import JobStatus, now
from app.core.scheduling import backlog
from app.core.settings import Settings
from tests.unit.conftest import environment
from workers.ops.autoscale import BacklogSignal

TARGETS = {"realtime": 10.0, "standard": 300.0, "bulk": 3600.0}


def q(lane: str, cost: int, deadline: float | None = None, jobs: int = 1) -> backlog.Queued:
    return backlog.Queued("m", lane, deadline, jobs, cost)


def test_nothing_queued_or_running_needs_no_worker() -> None:
    assert backlog.desired([], now=0, rate=100, targets=TARGETS) == 0


def test_one_waiting_job_needs_a_worker_however_small() -> None:
    assert backlog.desired([q("bulk", 1)], now=0, rate=1e6, targets=TARGETS) == 1


def test_each_lane_drains_within_its_target() -> None:
    # realtime: 5,000 tokens in 10 s = 500/s; standard: 30,000 in 300 s = 100/s; at 100/s a
    # worker, 6 workers.
    queued = [q("realtime", 5000), q("standard", 30_000)]
    assert backlog.need(queued, "realtime", 0, 10) == 500
    assert backlog.desired(queued, now=0, rate=100, targets=TARGETS) == 6


def test_a_deadline_asks_for_what_its_work_needs_before_it() -> None:
    # 9,000 tokens due at t=120 (30 s kept back for a worker's start: 90 s), then 1,000 more
    # due at t=1,030: the first deadline decides, 100/s; at 25/s a worker, 4 workers.
    queued = [q("bulk", 9000, deadline=120), q("bulk", 1000, deadline=1030)]
    assert backlog.need(queued, "bulk", 0, 3600) == 100
    assert backlog.desired(queued, now=0, rate=25, targets=TARGETS) == 4


def test_a_deadline_already_past_asks_a_lot_not_infinitely_much() -> None:
    need = backlog.need([q("bulk", 500, deadline=10)], "bulk", 100, 3600)
    assert need == 500 / backlog.FLOOR_S


def test_drain_counts_the_lanes_above_and_is_infinite_with_no_worker() -> None:
    queued = [q("realtime", 100), q("bulk", 900)]
    assert backlog.drain_s(queued, "realtime", workers=2, rate=50) == 1.0
    assert backlog.drain_s(queued, "bulk", workers=2, rate=50) == 10.0
    assert backlog.drain_s(queued, "bulk", workers=0, rate=50) == math.inf
    assert backlog.drain_s([], "bulk", workers=0, rate=50) == 0.0


def test_the_rate_is_the_fallback_until_measured_then_the_mean_per_worker() -> None:
    meter = backlog.RateMeter(fallback=2000)
    assert (meter.rate, meter.measured) == (2000, False)
    meter.add(ended=1000, seconds=5, workers=2)  # 100 a worker a second
    meter.add(ended=3000, seconds=5, workers=2)  # 300
    assert (meter.rate, meter.measured) == (200, True)
    for _ in range(backlog.RATE_SAMPLES):
        meter.add(ended=500, seconds=5, workers=1)
    assert meter.rate == 100  # the old samples are gone


def _submit(
    settings: Settings, n: int, *, lane: str, model: str, timeout_s: float | None = None
) -> list[str]:
    made = [
        jobs.new_job(
            "t",
            JobCreate(prompt="x" * 40, lane=lane, params={"max_tokens": 10}, timeout_s=timeout_s),
            model,
        )
        for _ in range(n)
    ]
    with changes("api") as tx:
        transitions.create(tx, made)
    return [job.id for job in made]


def _announce(model: str, worker: str) -> None:
    record = {"model": model, "role": "inference", "worker_id": worker, "lanes": ["bulk"]}
    clients.redis_client().set(WORKERS_KEY_PREFIX + worker, json.dumps(record), ex=60)


def _gauges(signal: BacklogSignal) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(signal)
    found = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def test_the_backlog_is_read_by_base_model_lane_and_deadline(core: Settings) -> None:
    adapters = json.dumps({"m-lora": {"base": "m", "path": "/nowhere"}})
    with environment(adapters=adapters, model="m") as settings:
        _submit(settings, 3, lane="bulk", model="m", timeout_s=600)
        _submit(settings, 2, lane="bulk", model="m-lora", timeout_s=600)
        _submit(settings, 1, lane="realtime", model="m")
        with db.session_scope() as session:
            queued = backlog.read(session, settings)
            waiting = backlog.waiting(session, settings)
    assert {q.model for q in queued} == {"m"}  # the adapter's jobs count on its base
    bulk = [q for q in queued if q.lane == "bulk"]
    assert sum(q.jobs for q in bulk) == 5
    # Prompts of 40 characters (about 10 tokens) and 10 tokens out: each costs 20.
    assert sum(q.cost for q in bulk) == 5 * 20
    earliest = min(q.deadline for q in bulk if q.deadline is not None)
    # A bucket gives its earliest possible deadline: at most one and a half buckets early.
    assert now() + 600 - 1.5 * backlog.BUCKET_S < earliest <= now() + 600
    assert waiting == {"m"}


def test_the_ops_signal_exports_each_model_and_measures_a_full_workers_rate(core: Settings) -> None:
    ids = _submit(core, 50, lane="bulk", model=core.model_name)
    _announce(core.model_name, "w1")
    signal = BacklogSignal(core)
    signal.sample()
    model = core.model_name
    first = _gauges(signal)
    assert first[("inferq_autoscale_desired_workers", (("model", model),))] == 1
    assert first[("inferq_backlog_jobs", (("lane", "bulk"), ("model", model)))] == 50
    assert first[("inferq_autoscale_live_workers", (("model", model),))] == 1
    fallback = (("measured", "false"), ("model", model))
    assert first[("inferq_autoscale_worker_rate", fallback)] == core.autoscale_worker_rate
    # The worker ran 10 of them while others waited to be sent: a full sample.
    with changes("worker", worker="w1") as tx:
        rows = transitions.claim(tx, ids[:10], worker="w1", lease_s=60, stamp=now())
    leases = [transitions.lease_of(row) for row in rows]
    done = transitions.Outcome(JobStatus.SUCCEEDED, text="ok", prompt_tokens=10)
    with changes("worker", worker="w1") as tx:
        transitions.record(tx, [(lease, done) for lease in leases], stamp=now())
    signal.sample()
    second = _gauges(signal)
    rate = second[("inferq_autoscale_worker_rate", (("measured", "true"), ("model", model)))]
    assert rate > 0
    assert second[("inferq_backlog_jobs", (("lane", "bulk"), ("model", model)))] == 40
    # The rate is kept for the next ops worker.
    assert float(clients.redis_client().get(AUTOSCALE_RATE_PREFIX + model)) == rate
    assert BacklogSignal(core)._meter(model, clients.redis_client()).fallback == rate


def test_nothing_waiting_exports_zero_workers_for_every_known_model(core: Settings) -> None:
    signal = BacklogSignal(core)
    signal.sample()
    gauges = _gauges(signal)
    assert gauges[("inferq_autoscale_desired_workers", (("model", core.model_name),))] == 0
    drain = gauges[("inferq_backlog_drain_seconds", (("lane", "bulk"), ("model", core.model_name)))]
    assert drain == 0


def test_a_job_ended_since_the_last_sample_keeps_one_worker() -> None:
    # A trickle of short jobs: at the sample nothing waits, but one ended since the last one.
    assert backlog.desired([], now=0, rate=100, targets=TARGETS, ended=True) == 1
