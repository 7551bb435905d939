"""A worker's liveness (/healthz on its metrics port, a Kubernetes liveness probe): served over
real HTTP on loopback, following a real heartbeat of an in-process worker on the simulated
engine."""

from __future__ import annotations

import httpx

from app.core.settings import Settings
from tests.unit.inprocess import Worker
from workers import metrics
from workers.inference.heartbeat import Heartbeat


def test_healthz_follows_the_heartbeat_and_metrics_stay_served(core: Settings) -> None:
    settings = core.model_copy(update={"heartbeat_s": 0.2})
    with Worker(settings) as worker:
        beat = Heartbeat(worker.executor, settings, {})
        url = metrics.serve("127.0.0.1", 0, health=beat.health)
        healthz = url.removesuffix("/metrics") + "/healthz"
        starting = httpx.get(healthz, timeout=5)
        assert (starting.status_code, starting.text) == (
            503,
            "starting: the engine is not up yet\n",
        )
        beat.start()
        alive = httpx.get(healthz, timeout=5)
        assert alive.status_code == 200 and alive.text.startswith("heartbeat")
        beat.stop()  # the heartbeat thread ends: the worker is no longer alive
        stopped = httpx.get(healthz, timeout=5)
        assert (stopped.status_code, stopped.text) == (503, "the heartbeat thread has stopped\n")
        assert "inferq_engine_generated_tokens_total" in httpx.get(url, timeout=5).text
