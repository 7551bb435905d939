"""The API's ``/metrics`` exposition: its job counters and the lane gauges.

The job counters every kind of process increases (submitted and finished) are defined with the
transitions that move them (app/core/transitions.py); workers define their own (engine, latency
histograms, webhooks, reaper) in ``workers/metrics.py``. Names and labels are the README's
metrics table.

The API can run as several uvicorn processes (``inferq api --workers N``): ``inferq api`` then
points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory and each scrape merges every process's
files, so a counter is the API's total whichever process answers. The lane gauges are read at
scrape time from Redis and the database (app/core/snapshot.py), never kept in process memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.core import catalog, dispatch, snapshot
from app.core.db import session_scope

log = logging.getLogger("inferq.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class LaneCollector(Collector):
    """Depth and age of every known model's lanes, read from Redis and the database at each
    scrape.

    A dependency that is down leaves its metrics out of that scrape (the API's /readyz says
    which); the rest of the page is still served.
    """

    def collect(self) -> Iterator[GaugeMetricFamily]:
        models = catalog.names()
        try:
            messages = snapshot.queue_messages(dispatch.redis_client(), snapshot.routes(models))
        except Exception as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
        else:
            family = GaugeMetricFamily(
                "inferq_queue_messages",
                "Messages waiting in the Redis queue of a model's lane.",
                labels=["lane", "model"],
            )
            for (lane, model), size in messages.items():
                family.add_metric([lane, model], size)
            yield family
        try:
            with session_scope() as session:
                lanes = snapshot.lane_jobs(session, time.time(), models)
        except Exception as exc:
            log.warning("metrics: database unavailable: %s", exc)
            return
        labels = ["lane", "model"]
        queued = GaugeMetricFamily("inferq_jobs_queued", "Jobs in status queued.", labels=labels)
        running = GaugeMetricFamily("inferq_jobs_running", "Jobs in status running.", labels=labels)
        oldest = GaugeMetricFamily(
            "inferq_queue_oldest_age_seconds",
            "Age of the oldest queued job of a model's lane (0 when none).",
            labels=labels,
        )
        for (lane, model), jobs in lanes.items():
            queued.add_metric([lane, model], jobs.queued)
            running.add_metric([lane, model], jobs.running)
            oldest.add_metric([lane, model], jobs.oldest_queued_age_s)
        yield from (queued, running, oldest)


_lanes = LaneCollector()


def api_exposition() -> tuple[bytes, str]:
    """The API's /metrics page and its content type."""
    registry = CollectorRegistry()
    if os.environ.get(MULTIPROC_ENV):
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry.register(_Default())
    registry.register(_lanes)
    return generate_latest(registry), CONTENT_TYPE_LATEST


class _Default(Collector):
    """This process's own metrics (one uvicorn process): the default registry's."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()
