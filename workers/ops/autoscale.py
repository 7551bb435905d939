"""The backlog signal on the ops worker's /metrics: per model and lane the queued work and how
long the live workers need to drain it, and per model the workers it needs (the formula is
app/core/scheduling/backlog.py's; docs/kubernetes.md, "Autoscaling on the backlog").

Only the ops worker that runs beat samples and exports it: one per deployment, so a
Prometheus query needs no de-duplication across API replicas. A thread takes a sample every
``backlog.SAMPLE_S``; a scrape reads the last one.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import redis
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError

from app.core.db import session_scope
from app.core.messaging import clients
from app.core.messaging.names import AUTOSCALE_RATE_PREFIX, DRAIN_METRIC
from app.core.models import now
from app.core.processes import presence
from app.core.scheduling import backlog, catalog
from app.core.settings import LANES, Settings

log = logging.getLogger("inferq.autoscale")


class BacklogSignal(Collector):
    """Samples the backlog every ``backlog.SAMPLE_S`` on a thread; a scrape reads the last."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.meters: dict[str, backlog.RateMeter] = {}
        self.signals: list[backlog.Signal] = []
        self._last: tuple[float, dict[str, int], set[str]] | None = None  # (at, workers, waiting)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="backlog-signal", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while True:
            try:
                self.sample()
            except (SQLAlchemyError, redis.RedisError) as exc:
                log.warning("could not read the backlog: %s", exc)
            if self._stop.wait(backlog.SAMPLE_S):
                return

    def _meter(self, model: str, client: redis.Redis) -> backlog.RateMeter:
        meter = self.meters.get(model)
        if meter is None:
            kept = client.get(AUTOSCALE_RATE_PREFIX + model)
            fallback = float(kept) if kept else self.settings.autoscale_worker_rate
            meter = self.meters[model] = backlog.RateMeter(fallback)
        return meter

    def sample(self) -> None:
        """Read the backlog and the workers, take a rate sample where it is a full one."""
        client = clients.redis_client()
        stamp = now()
        workers = catalog.counts(presence.workers(client))
        with session_scope() as session:
            queued = backlog.read(session, self.settings)
            waiting = backlog.waiting(session, self.settings)
            ended = backlog.ended_cost(session, self._last[0], self.settings) if self._last else {}
        models = list(dict.fromkeys([*catalog.names(workers), *(q.model for q in queued)]))
        if self._last is not None:
            since, were, waited = self._last
            for model in models:
                full = model in waiting and model in waited
                if full and workers.get(model, 0) == were.get(model, 0):
                    meter = self._meter(model, client)
                    meter.add(ended.get(model, 0), stamp - since, workers.get(model, 0))
                    client.set(AUTOSCALE_RATE_PREFIX + model, json.dumps(meter.rate))
        self._last = (stamp, workers, waiting)
        targets = self.settings.autoscale_target_s
        self.signals = [
            backlog.signal(
                model,
                queued,
                workers.get(model, 0),
                self._meter(model, client),
                stamp,
                targets,
                ended=bool(ended.get(model)),
            )
            for model in models
        ]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        signals = self.signals
        desired = GaugeMetricFamily(
            "inferq_autoscale_desired_workers",
            "Inference workers a model needs for every lane to drain within its target and "
            "every job to meet its deadline; 0 when it has no queued or running job.",
            labels=["model"],
        )
        rate = GaugeMetricFamily(
            "inferq_autoscale_worker_rate",
            "Cost (tokens, as the dispatcher charges them) one full worker of a model ends per "
            "second; measured says whether it was measured or is the configured fallback.",
            labels=["model", "measured"],
        )
        jobs = GaugeMetricFamily(
            "inferq_backlog_jobs", "Queued and running jobs.", labels=["model", "lane"]
        )
        tokens = GaugeMetricFamily(
            "inferq_backlog_tokens",
            "Cost of the queued and running jobs (tokens, as the dispatcher charges them).",
            labels=["model", "lane"],
        )
        drain = GaugeMetricFamily(
            DRAIN_METRIC,
            "Seconds the live workers need for a lane and the lanes above it at their measured "
            "rate (+Inf with no live worker).",
            labels=["model", "lane"],
        )
        live = GaugeMetricFamily(
            "inferq_autoscale_live_workers",
            "Live inference workers of a model (their presence records): what the drain "
            "seconds count on.",
            labels=["model"],
        )
        for s in signals:
            desired.add_metric([s.model], s.desired)
            live.add_metric([s.model], s.workers)
            rate.add_metric([s.model, "true" if s.measured else "false"], s.rate)
            for lane in LANES:
                jobs.add_metric([s.model, lane], s.jobs[lane])
                tokens.add_metric([s.model, lane], s.cost[lane])
                drain.add_metric([s.model, lane], s.drain_s[lane])
        yield from (desired, live, rate, jobs, tokens, drain)
