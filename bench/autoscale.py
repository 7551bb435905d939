"""The `autoscale` scenario: inference workers started and stopped on this machine by a
controller that applies KEDA's and the HorizontalPodAutoscaler's rules to inferq's own
desired-worker gauge, as the chart's ScaledObject does in a cluster (docs/kubernetes.md,
"Autoscaling on the backlog"; docs/benchmarks.md, "autoscale").

The controller (:class:`Controller`) reads ``inferq_autoscale_desired_workers`` from the ops
worker's /metrics, as KEDA's Prometheus trigger reads it through Prometheus, with the defaults
the chart ships (KEDA's and the HPA's own)::

    KEDA, every POLLING_S (30 s):   0 -> 1 replica when the metric > 0 (activation);
                                    -> 0 when it has been 0 for COOLDOWN_S (300 s)
    HPA, every SYNC_S (15 s):       recommendation = ceil(metric / 1) within [1, max],
                                    none when |metric / replicas - 1| <= TOLERANCE (0.1)
                                    up at once, by at most max(+100 %, +4 pods) per sync;
                                    down to the highest recommendation of the last
                                    STABILIZATION_S (300 s)

A worker is a real ``inferq worker`` process on the simulated engine; scale-in sends it SIGTERM
(it finishes what it holds within INFERQ_SHUTDOWN_GRACE_S, then hands the rest back), and its
worker-seconds run until its process has exited. The load: idle, a realtime trickle, a bulk burst
with a deadline (the trickle goes on), idle until the fleet is back at zero. The same trickle and
burst then run on a fixed fleet of the autoscaled run's peak size, for realtime TTFT under it;
its worker-seconds are that fleet kept for the whole scenario.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis
from sqlalchemy import func, select

from app.cli.stack import Child
from app.core.models import TERMINAL, Job, JobStatus
from app.core.processes import presence
from bench.harness import BenchStack
from bench.metrics import gauge, percentile, read_gauges
from bench.scenarios import Options

POLLING_S = 30.0  # KEDA pollingInterval (default)
COOLDOWN_S = 300.0  # KEDA cooldownPeriod (default)
SYNC_S = 15.0  # the HPA's sync period (kube-controller-manager default)
STABILIZATION_S = 300.0  # the HPA's scale-down stabilization window (default)
TOLERANCE = 0.1  # the HPA's tolerance (default)
MAX_WORKERS = 8

IDLE_S = 300.0  # nothing at all, no worker
TRICKLE_S = 60.0  # the realtime trickle alone, before the burst
TRICKLE_PER_S = 1.0
BURST_JOBS = 20_000
DEADLINE_S = 150.0  # the burst's jobs' timeout_s: each must end within it
TAIL_MAX_S = 480.0  # the last idle phase ends when the fleet is at zero, or after this
SHUTDOWN_GRACE_S = 30.0
TICK_S = 1.0

# A full worker ends about 80 of these jobs a second (64 sequences, 16 tokens each, ~50 ms a
# step): slow enough that the engine, not this machine's two cores, is each worker's limit.
WORKER_ENV = {
    "INFERQ_WORKER_CONCURRENCY": "64",
    "INFERQ_SIM_MAX_NUM_SEQS": "64",
    "INFERQ_SIM_TIME_SCALE": "3",
    "INFERQ_SHUTDOWN_GRACE_S": str(SHUTDOWN_GRACE_S),
}
MAX_TOKENS = 16
MODEL = "inferq-demo"


@dataclass
class Controller:
    """KEDA + the HPA for one Deployment, on the desired-worker gauge (rules in the docstring)."""

    max_replicas: int = MAX_WORKERS
    replicas: int = 0
    last_active: float = -math.inf
    next_poll: float = 0.0
    next_sync: float = 0.0
    recommendations: deque[tuple[float, int]] = field(default_factory=deque)

    def step(self, t: float, metric: float) -> int:
        if t >= self.next_poll:  # KEDA's activation loop
            self.next_poll = t + POLLING_S
            if metric > 0:
                self.last_active = t
                if self.replicas == 0:
                    self.replicas = 1
                    self.next_sync = t + SYNC_S
            elif self.replicas and t - self.last_active >= COOLDOWN_S:
                self.replicas = 0
                self.recommendations.clear()
        if self.replicas and t >= self.next_sync:  # the HPA
            self.next_sync = t + SYNC_S
            current = self.replicas
            if abs(metric / current - 1) <= TOLERANCE:
                wanted = current
            else:
                wanted = min(max(math.ceil(metric), 1), self.max_replicas)
            self.recommendations.append((t, wanted))
            while self.recommendations and self.recommendations[0][0] < t - STABILIZATION_S:
                self.recommendations.popleft()
            if wanted > current:
                self.replicas = min(wanted, current + max(current, 4))
            else:
                self.replicas = min(current, max(r for _, r in self.recommendations))
        return self.replicas


@dataclass
class Fleet:
    """Worker processes: started, stopped (SIGTERM, drain), and their worker-seconds."""

    stack: BenchStack
    started: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    live: list[Child] = field(default_factory=list)
    stopping: list[threading.Thread] = field(default_factory=list)
    count: int = 0

    def scale(self, replicas: int) -> None:
        while len(self.live) < replicas:
            name = f"worker{self.count}"
            self.count += 1
            self.live.append(
                self.stack.spawn(name, [sys.executable, "-m", "app.cli", "worker"], WORKER_ENV)
            )
            self.started[name] = time.time()
        while len(self.live) > replicas:
            child = self.live.pop()  # the newest first, as a ReplicaSet scales in

            def stop(child: Child = child) -> None:
                child.stop(grace_s=SHUTDOWN_GRACE_S + 60)
                self.ended[child.name] = time.time()

            thread = threading.Thread(target=stop, daemon=True)
            thread.start()
            self.stopping.append(thread)

    def worker_seconds(self, until: float) -> float:
        return sum(self.ended.get(name, until) - began for name, began in self.started.items())

    def close(self) -> None:
        self.scale(0)
        for thread in self.stopping:
            thread.join()


class Load:
    """The realtime trickle (a thread) and the burst."""

    def __init__(self, stack: BenchStack) -> None:
        self.stack = stack
        self.realtime: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._trickle, daemon=True)

    def start_trickle(self) -> None:
        self._thread.start()

    def stop_trickle(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _trickle(self) -> None:
        with httpx.Client(base_url=self.stack.url, timeout=30) as client:
            i = 0
            while not self._stop.wait(1 / TRICKLE_PER_S):
                body = {
                    "prompt": f"realtime {i} hello",
                    "lane": "realtime",
                    "params": {"max_tokens": MAX_TOKENS},
                }
                r = client.post("/v1/jobs", json=body)
                if r.status_code == 202:
                    self.realtime.append(r.json()["id"])
                i += 1

    def burst(self, n: int) -> float:
        bodies = [
            {
                "prompt": f"bulk {i} summarize the queue lane worker engine batch",
                "lane": "bulk",
                "timeout_s": DEADLINE_S,
                "params": {"max_tokens": MAX_TOKENS},
            }
            for i in range(n)
        ]
        return self.stack.submit(bodies, clients=2)


def bulk_left(stack: BenchStack) -> int:
    query = (
        select(func.count())
        .select_from(Job)
        .where(Job.lane == "bulk", Job.status.in_([JobStatus.QUEUED, JobStatus.RUNNING]))
    )
    with stack.db().connect() as conn:
        return int(conn.execute(query).scalar_one())


def ops_metrics_url(stack: BenchStack) -> str:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        records = presence.ops_workers(redis.Redis(port=stack.redis_port))
        if records:
            return str(records[0]["metrics_url"])
        time.sleep(0.2)
    raise RuntimeError("the ops worker did not announce itself")


def _ttft_ms(rows: list[dict[str, Any]], since: float, until: float) -> float | None:
    ttfts = [
        (r["first_token_at"] - r["created_at"]) * 1000
        for r in rows
        if r["first_token_at"] and since <= r["created_at"] <= until
    ]
    p99 = percentile(ttfts, 99)
    return None if p99 is None else round(p99, 1)


def _outcome(stack: BenchStack, ids: list[str]) -> dict[str, int]:
    """Missed deadlines, lost and run-twice jobs among ``ids``."""
    with stack.db().connect() as conn:
        rows = conn.execute(
            select(Job.status, Job.finished_at, Job.deadline_at, Job.attempts).where(
                Job.id.in_(ids)
            )
        ).all()
    missed = sum(
        1
        for r in rows
        if r.status == JobStatus.EXPIRED
        or (
            r.deadline_at is not None
            and r.finished_at is not None
            and r.finished_at > r.deadline_at
        )
    )
    lost = len(ids) - sum(1 for r in rows if r.status in TERMINAL and r.status != JobStatus.FAILED)
    return {"missed": missed, "lost": lost, "run_twice": sum(1 for r in rows if r.attempts > 1)}


def _burst_ids(stack: BenchStack) -> list[str]:
    with stack.db().connect() as conn:
        return list(conn.execute(select(Job.id).where(Job.lane == "bulk")).scalars())


def autoscaled(opts: Options, n: int) -> dict[str, Any]:
    with BenchStack(opts.database, opts.stack_env(engine="simulated"), opts.workdir) as stack:
        stack.start(workers=0)
        stack.add_ops()
        url = ops_metrics_url(stack)
        fleet, load, controller = Fleet(stack), Load(stack), Controller()
        began = time.time()
        timeline: list[dict[str, Any]] = []
        phase = "idle"
        burst_at = drained_at = zero_at = None
        try:
            while True:
                t = time.time() - began
                samples = read_gauges(url)
                desired = gauge(samples, "inferq_autoscale_desired_workers", model=MODEL) or 0.0
                replicas = controller.step(t, desired)
                fleet.scale(replicas)
                announced = len(stack.worker_records())
                row = {
                    "t": round(t, 1),
                    "phase": phase,
                    "desired": desired,
                    "replicas": replicas,
                    "announced": announced,
                    "counted": gauge(samples, "inferq_autoscale_live_workers", model=MODEL),
                    "drain_s": gauge(
                        samples, "inferq_backlog_drain_seconds", model=MODEL, lane="bulk"
                    ),
                    "rate_measured": gauge(
                        samples, "inferq_autoscale_worker_rate", model=MODEL, measured="true"
                    ),
                    "bulk_left": bulk_left(stack) if burst_at is not None else 0,
                }
                timeline.append(row)
                opts.progress(
                    "autoscale: scenario seconds",
                    int(t),
                    int(IDLE_S + TRICKLE_S + DEADLINE_S + TAIL_MAX_S),
                )
                if phase == "idle" and t >= IDLE_S:
                    phase = "trickle"
                    load.start_trickle()
                elif phase == "trickle" and t >= IDLE_S + TRICKLE_S:
                    phase = "burst"
                    burst_at = load.burst(n)
                elif phase == "burst" and row["bulk_left"] == 0 and t > IDLE_S + TRICKLE_S + 5:
                    phase = "tail"
                    drained_at = time.time()
                    load.stop_trickle()
                elif phase == "tail" and (
                    (replicas == 0 and not fleet.live)
                    or t > IDLE_S + TRICKLE_S + DEADLINE_S + TAIL_MAX_S
                ):
                    zero_at = time.time()
                    break
                time.sleep(max(0.0, TICK_S - (time.time() - began - t)))
        finally:
            load.stop_trickle()
            fleet.close()
        end = zero_at or time.time()
        rows = stack.rows(ids=load.realtime)
        burst_ids = _burst_ids(stack)
        outcome = _outcome(stack, burst_ids + load.realtime)
    assert burst_at is not None and drained_at is not None
    trickle_rows = sorted(rows, key=lambda r: r["created_at"])
    first = trickle_rows[0] if trickle_rows else None
    cold = (
        round(first["first_token_at"] - first["created_at"], 1)
        if first and first["first_token_at"]
        else None
    )
    peak = max(r["replicas"] for r in timeline)
    return {
        "began": began,
        "end": end,
        "burst_at": burst_at,
        "drained_at": drained_at,
        "duration_s": round(end - began, 1),
        "worker_seconds": round(fleet.worker_seconds(end), 1),
        "workers_started": fleet.count,
        "peak_workers": peak,
        "cold_start_s": cold,
        "realtime_ttft_p99_ms": _ttft_ms(rows, burst_at, drained_at),
        "timeline": timeline,
        **outcome,
    }


def estimate(run: dict[str, Any]) -> dict[str, Any]:
    """The drain estimate at the burst's start vs. the measured drain: the signal's own
    estimate (``inferq_backlog_drain_seconds`` of the bulk lane: all lanes' work over the live
    workers at the measured rate), taken at the first second after the burst arrived at which
    the rate rests on a measurement and the estimate counts the workers that then drain the
    burst (the fleet does not change after that)."""
    rows = [r for r in run["timeline"] if run["burst_at"] - run["began"] <= r["t"]]
    drained = run["drained_at"] - run["began"]
    during = [r for r in rows if r["t"] <= drained]
    final = during[-1]["announced"] if during else 0
    for i, r in enumerate(during):
        steady = r["counted"] == final and all(later["announced"] == final for later in during[i:])
        if r["rate_measured"] is not None and steady and r["drain_s"] not in (None, math.inf):
            measured = drained - r["t"]
            return {
                "estimate_at_s": round(r["t"] - (run["burst_at"] - run["began"]), 1),
                "estimate_s": round(r["drain_s"], 1),
                "measured_s": round(measured, 1),
                "workers": final,
                "estimate_error": round(r["drain_s"] / measured - 1, 3) if measured > 0 else None,
            }
    return {"estimate_error": None}


def fixed(opts: Options, n: int, workers: int) -> dict[str, Any]:
    """The trickle and the burst on ``workers`` workers started beforehand."""
    with BenchStack(opts.database, opts.stack_env(engine="simulated"), opts.workdir) as stack:
        stack.start(workers=0)
        stack.add_ops()
        for i in range(workers):
            stack.add_worker(i, WORKER_ENV)
        load = Load(stack)
        load.start_trickle()
        time.sleep(10)
        burst_at = load.burst(n)
        while bulk_left(stack):
            opts.progress("autoscale: fixed fleet, bulk left", n - bulk_left(stack), n)
            time.sleep(TICK_S)
        drained_at = time.time()
        load.stop_trickle()
        rows = stack.rows(ids=load.realtime)
    return {
        "workers": workers,
        "drain_s": round(drained_at - burst_at, 1),
        "realtime_ttft_p99_ms": _ttft_ms(rows, burst_at, drained_at),
    }


def autoscale(opts: Options) -> dict[str, Any]:
    n = opts.n(BURST_JOBS)
    run = autoscaled(opts, n)
    peak = run["peak_workers"]
    steady = fixed(opts, n, peak)
    fixed_seconds = peak * run["duration_s"]
    drain = estimate(run)
    timeline = run.pop("timeline")
    return {
        "engine": "simulated",
        "jobs": n,
        "deadline_s": DEADLINE_S,
        "phases_s": {"idle": IDLE_S, "trickle": TRICKLE_S, "tail_max": TAIL_MAX_S},
        "controller": {
            "polling_s": POLLING_S,
            "cooldown_s": COOLDOWN_S,
            "sync_s": SYNC_S,
            "stabilization_s": STABILIZATION_S,
            "tolerance": TOLERANCE,
        },
        "missed_deadlines": run["missed"],
        "lost": run["lost"],
        "run_twice": run["run_twice"],
        "cold_start_s": run["cold_start_s"],
        "worker_seconds": run["worker_seconds"],
        "fixed_worker_seconds": round(fixed_seconds, 1),
        "worker_seconds_ratio": round(run["worker_seconds"] / fixed_seconds, 3),
        "realtime_ttft_p99_ms": run["realtime_ttft_p99_ms"],
        "fixed_realtime_ttft_p99_ms": steady["realtime_ttft_p99_ms"],
        "estimate_error": drain["estimate_error"],
        "estimate_error_abs": None
        if drain["estimate_error"] is None
        else abs(drain["estimate_error"]),
        "drain": drain,
        "peak_workers": peak,
        "workers_started": run["workers_started"],
        "duration_s": run["duration_s"],
        "burst_drain_s": round(run["drained_at"] - run["burst_at"], 1),
        "fixed": steady,
        "timeline": timeline[:: max(1, len(timeline) // 200)],
    }
