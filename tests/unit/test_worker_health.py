"""A worker's liveness (/healthz on its metrics port, a Kubernetes liveness probe): served over
real HTTP on loopback, following a real heartbeat of an in-process worker on the simulated
engine; and its presence record, withdrawn while it is not alive (real Redis)."""

from __future__ import annotations

import threading

import httpx

from app.core.messaging import clients
from app.core.processes.presence import Presence
from app.core.settings import Settings
from tests.support import wait_until
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


def test_a_process_that_is_not_alive_is_withdrawn_until_it_is_again(core: Settings) -> None:
    """A worker whose heartbeat stopped (``alive`` says so: the heartbeat's health) is seen as
    gone within a refresh, not after its record expires; announced again once it is back."""
    alive = threading.Event()
    alive.set()
    presence = Presence("inference", "gated", 0.2, lambda: {"model": "m"}, alive=alive.is_set)
    redis = clients.redis_client()
    presence.start()
    try:
        assert redis.get(presence.key) is not None
        alive.clear()
        wait_until(lambda: redis.get(presence.key) is None, 2, "the record to be withdrawn")
        alive.set()
        wait_until(lambda: redis.get(presence.key) is not None, 2, "the record to be back")
    finally:
        presence.stop()
    assert redis.get(presence.key) is None
