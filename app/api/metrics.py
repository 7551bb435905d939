"""The API's ``/metrics`` exposition: its job counters, the lane gauges and the per-tenant
gauges.

The job counters every kind of process increases (submitted and finished) are defined with the
transitions that move them (app/core/lifecycle/transitions.py); workers define their own (engine,
latency histograms, webhooks, reaper) in ``workers/metrics.py``. Names and labels are those of the
metrics table in docs/observability.md.

The API can run as several uvicorn processes (``inferq api --workers N``): ``inferq api`` then
points ``PROMETHEUS_MULTIPROC_DIR`` at a fresh directory and each scrape merges every process's
files, so a counter is the API's total whichever process answers. The lane and tenant gauges
are read at scrape time from Redis and the database (app/core/observe/snapshot.py), never kept in
process memory.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.core.db import session_scope
from app.core.messaging import clients
from app.core.messaging.names import routes
from app.core.observe import missing, shapes, snapshot
from app.core.scheduling import catalog

log = logging.getLogger("inferq.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The window of inferq_tenant_tokens_served_per_second: the same minute `inferq status` shows.
TENANT_TOKENS_WINDOW_S = 60.0


class LaneCollector(Collector):
    """Depth and age of every known model's lanes, and each tenant's share of them, read from
    Redis and the database at each scrape.

    A dependency that is down leaves its metrics out of that scrape (the API's /readyz says
    which); the rest of the page is still served.
    """

    def collect(self) -> Iterator[Metric]:
        models = catalog.names()
        try:
            messages = snapshot.queue_messages(clients.redis_client(), routes(models))
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
            yield from _affinity_counters()
        now = time.time()
        try:
            with session_scope() as session:
                lanes = snapshot.lane_jobs(session, now, models)
                tenants = snapshot.tenant_jobs(session, now, TENANT_TOKENS_WINDOW_S)
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
        yield from _tenant_gauges(tenants)
        yield from _missing_gauge(models)


def _affinity_counters() -> Iterator[CounterMetricFamily]:
    """Jobs the dispatchers sent to each worker's own queue by prefix affinity, and those of
    its prefixes sent to the shared queue past the load bound (docs/scheduling.md)."""
    try:
        counts = snapshot.affinity_counts(clients.redis_client())
    except Exception as exc:
        log.warning("metrics: Redis unavailable: %s", exc)
        return
    family = CounterMetricFamily(
        "inferq_affinity_jobs",
        "Jobs sent for a worker's prompt prefixes: to its own queue (routed=affinity), or to "
        "the shared queue because it was past the load bound (routed=overflow).",
        labels=["worker", "routed"],
    )
    for worker, found in counts.items():
        family.add_metric([worker, "affinity"], found.sent)
        family.add_metric([worker, "overflow"], found.overflow)
    yield family


def _missing_gauge(models: list[str]) -> Iterator[GaugeMetricFamily]:
    """What waits for a missing part (app/core/observe/missing.py): one series for the dispatcher
    and one for the ops worker, one per known model for its workers; 0 when nothing does."""
    try:
        found = missing.current()
    except Exception as exc:
        log.warning("metrics: could not read the missing parts: %s", exc)
        return
    family = GaugeMetricFamily(
        "inferq_missing_part_waiting",
        "Jobs, webhook events and batches that wait for a part of the deployment with no live "
        "process (dispatcher, ops, a model's worker), and files whose store is unavailable "
        "(files); 0 when nothing does.",
        labels=["part", "model"],
    )
    waiting = Counter({("dispatcher", ""): 0, ("ops", ""): 0, ("files", ""): 0})
    waiting.update({("worker", model): 0 for model in models})
    for m in found:
        waiting[(m.part, m.model or "")] += m.waiting
    for (part, model), count in sorted(waiting.items()):
        family.add_metric([part, model], count)
    yield family


def _tenant_gauges(
    tenants: dict[shapes.TenantRoute, shapes.TenantJobs],
) -> Iterator[GaugeMetricFamily]:
    """Each tenant's queued and running jobs and tokens served per lane of a model; a tenant
    with none of them in the window has no series."""
    labels = ["lane", "model", "tenant"]
    queued = GaugeMetricFamily(
        "inferq_tenant_jobs_queued", "A tenant's jobs in status queued.", labels=labels
    )
    running = GaugeMetricFamily(
        "inferq_tenant_jobs_running", "A tenant's jobs in status running.", labels=labels
    )
    served = GaugeMetricFamily(
        "inferq_tenant_tokens_served_per_second",
        f"Prompt + completion tokens of a tenant's jobs that finished in the last "
        f"{TENANT_TOKENS_WINDOW_S:.0f} s, per second.",
        labels=labels,
    )
    for key, jobs in tenants.items():
        queued.add_metric(list(key), jobs.queued)
        running.add_metric(list(key), jobs.running)
        served.add_metric(list(key), jobs.tokens_per_s)
    yield from (queued, running, served)


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
