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

from app.core import dispatch, snapshot
from app.core.db import session_scope
from app.core.settings import LANES

log = logging.getLogger("inferq.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class LaneCollector(Collector):
    """Lane depth and age, read from Redis and the database at each scrape.

    A dependency that is down leaves its metrics out of that scrape (the API's /readyz says
    which); the rest of the page is still served.
    """

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            messages = snapshot.lane_messages(dispatch.redis_client())
        except Exception as exc:
            log.warning("metrics: Redis unavailable: %s", exc)
        else:
            family = GaugeMetricFamily(
                "inferq_queue_messages",
                "Messages waiting in the lane's Redis queue.",
                labels=["lane"],
            )
            for lane in LANES:
                family.add_metric([lane], messages.get(lane, 0))
            yield family
        try:
            with session_scope() as session:
                lanes = snapshot.lane_jobs(session, time.time())
        except Exception as exc:
            log.warning("metrics: database unavailable: %s", exc)
            return
        queued = GaugeMetricFamily("inferq_jobs_queued", "Jobs in status queued.", labels=["lane"])
        running = GaugeMetricFamily(
            "inferq_jobs_running", "Jobs in status running.", labels=["lane"]
        )
        oldest = GaugeMetricFamily(
            "inferq_queue_oldest_age_seconds",
            "Age of the lane's oldest queued job (0 when none).",
            labels=["lane"],
        )
        for lane, jobs in lanes.items():
            queued.add_metric([lane], jobs.queued)
            running.add_metric([lane], jobs.running)
            oldest.add_metric([lane], jobs.oldest_queued_age_s)
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
