"""The ops worker's composition root (`inferq ops` runs `python -m workers.ops`).

It delivers webhooks (queue ``webhooks``), runs the periodic sweeps (queue ``maintenance``)
and embeds Celery beat, which sends those sweeps. It holds no engine and no GPU, and imports
nothing of the inference worker. Several ops workers may run: deliveries and sweeps are claims
in the database, so a duplicate sweep or message does no harm. Beat belongs in one of them only
(``inferq ops --no-beat`` for the others, ``INFERQ_OPS_BEAT``); its schedule file lives in
``data_dir``.

Unless told not to (``inferq ops --no-dispatch``, ``INFERQ_OPS_DISPATCH``) it also runs the
dispatcher's loop on a thread: the safe deployment is the default one, and ``inferq dispatch``
stays for running more dispatchers. The one that runs beat also exports the backlog signal an
autoscaler scales inference workers on (workers/ops/autoscale.py).

Like an inference worker, it serves /metrics and announces itself in Redis
(app/core/processes/presence.py, role ``ops``) with that address, from Celery's ``worker_init``
until ``worker_shutdown``, so ``inferq up`` and the API's Prometheus service discovery find it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import signals
from prometheus_client import REGISTRY

from app.core.messaging import clients
from app.core.messaging.names import MAINTENANCE_QUEUE, WEBHOOK_QUEUE
from app.core.processes.presence import Presence
from app.core.settings import Settings, get_settings
from app.core.webhooks.rules import load_secret
from app.dispatcher.loop import Dispatcher
from workers import celery_app, metrics
from workers.ops import tasks
from workers.ops.autoscale import BacklogSignal
from workers.presence import process_id

log = logging.getLogger("inferq.ops")

# Sweeps first: strict order, and a sweep must not wait behind a delivery backlog.
QUEUES = (MAINTENANCE_QUEUE, WEBHOOK_QUEUE)


class OpsWorker:
    """What an ops worker process owns besides its tasks: /metrics and its presence record."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.presence: Presence | None = None
        self.signal: BacklogSignal | None = None
        self.dispatcher: Dispatcher | None = None
        self._dispatching: threading.Thread | None = None
        self._stop = threading.Event()

    def connect(self) -> None:
        """Start and stop with this process's Celery worker (its signals)."""
        for signal_, handler in (
            (signals.worker_init, self._on_init),
            (signals.worker_shutdown, self._on_shutdown),
        ):
            signal_.connect(handler, weak=False, dispatch_uid=f"inferq.ops.{signal_.name}")

    def start(self) -> None:
        settings = self.settings
        clients.warn_if_not_durable()
        url = metrics.serve(
            settings.metrics_host, settings.ops_metrics_port, settings.metrics_advertise_host
        )
        record = {
            "metrics_url": url,
            "queues": list(QUEUES),
            "beat": settings.ops_beat,
            "concurrency": settings.ops_concurrency,
        }
        self.presence = Presence("ops", process_id(), settings.heartbeat_s, lambda: record)
        self.presence.start()
        if settings.ops_dispatch:
            # The dispatcher's loop on a thread: every deployment runs an ops worker, so none
            # can be left without something that sends its waiting jobs (docs/scheduling.md, "Fair
            # share").
            self.dispatcher = Dispatcher(settings, clients.redis_client())
            self._dispatching = threading.Thread(
                target=self._dispatch, name="dispatcher", daemon=True
            )
            self._dispatching.start()
        if settings.ops_beat:
            # The one ops worker per deployment (beat's) exports the backlog signal.
            self.signal = BacklogSignal(settings)
            REGISTRY.register(self.signal)
            self.signal.start()

    def stop(self) -> None:
        self._stop.set()
        if self._dispatching is not None:
            self._dispatching.join(timeout=10)
            self._dispatching = None
        if self.dispatcher is not None:
            # Its loop withdraws the record as it returns; this withdraws it too where the
            # loop is still waiting (for the database) when the join gives up.
            self.dispatcher.presence.stop()
        if self.signal is not None:
            self.signal.stop()
            REGISTRY.unregister(self.signal)
            self.signal = None
        if self.presence is not None:
            self.presence.stop()
            self.presence = None

    def _dispatch(self) -> None:
        # A loop that died here would leave jobs waiting with nobody told: it starts again
        # (its presence record is withdrawn as it fails and written again as it starts, so the
        # missing-dispatcher signal shows while it is down, docs/architecture.md).
        assert self.dispatcher is not None
        while not self._stop.is_set():
            try:
                self.dispatcher.run(self._stop)
            except Exception:
                log.exception("the dispatcher's loop failed; it starts again in 1 s")
                self._stop.wait(1.0)

    def _on_init(self, **_: Any) -> None:
        try:
            self.start()
        except OSError:
            # Celery would log an exception from a signal handler and start consuming anyway.
            log.critical("the ops worker cannot start; exiting", exc_info=True)
            raise SystemExit(1) from None

    def _on_shutdown(self, **_: Any) -> None:
        self.stop()


def main() -> None:
    celery_app.log_to_stderr()
    settings = get_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    load_secret(settings)  # made now, not at the first delivery, so `inferq up` can show it
    OpsWorker(settings).connect()
    app = celery_app.create("ops", settings)
    tasks.register(app, settings)
    beat = ["--beat", f"--schedule={settings.data_dir / 'celerybeat-schedule'}"]
    celery_app.run_worker(
        app, "ops", QUEUES, settings.ops_concurrency, beat if settings.ops_beat else []
    )
