"""Entry point of the ops worker (`inferq ops` runs `python -m workers.ops`), and its presence.

It delivers webhooks (queue ``webhooks``), runs the periodic sweeps (queue ``maintenance``)
and embeds Celery beat, which sends those sweeps. It holds no engine and no GPU. Several ops
workers may run: deliveries and sweeps are claims in the database, so a duplicate sweep or
message does no harm. Beat belongs in one of them only (``inferq ops --no-beat`` for the
others, ``INFERQ_OPS_BEAT``); its schedule file lives in ``data_dir``.

Like an inference worker, it serves /metrics and announces itself in Redis (workers/presence.py,
role ``ops``) with that address, from Celery's ``worker_init`` until ``worker_shutdown``, so
``inferq up`` and the API's Prometheus service discovery find it.
"""

from __future__ import annotations

import logging
from typing import Any

from celery.signals import worker_init, worker_shutdown

from app.core.dispatch import MAINTENANCE_QUEUE, WEBHOOK_QUEUE
from app.core.settings import get_settings
from app.core.webhooks import load_secret
from workers import metrics
from workers.presence import Presence, process_id

log = logging.getLogger("inferq.ops")

# Sweeps first: strict order, and a sweep must not wait behind a delivery backlog.
QUEUES = (MAINTENANCE_QUEUE, WEBHOOK_QUEUE)

_enabled = False  # set by main(): only the ops process itself serves and announces
_presence: Presence | None = None


def main() -> None:
    global _enabled
    settings = get_settings()
    from workers.celery_app import run_worker

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    load_secret(settings)  # made now, not at the first delivery, so `inferq up` can show it
    _enabled = True
    beat = ["--beat", f"--schedule={settings.data_dir / 'celerybeat-schedule'}"]
    run_worker("ops", QUEUES, settings.ops_concurrency, beat if settings.ops_beat else [])


@worker_init.connect  # type: ignore[untyped-decorator]
def _on_worker_init(**_: Any) -> None:
    global _presence
    if not _enabled or _presence is not None:
        return
    settings = get_settings()
    try:
        url = metrics.serve(
            settings.metrics_host, settings.ops_metrics_port, settings.metrics_advertise_host
        )
    except OSError:
        # Celery would log an exception from a signal handler and start consuming anyway.
        log.critical("the ops worker cannot start; exiting", exc_info=True)
        raise SystemExit(1) from None
    record = {
        "metrics_url": url,
        "queues": list(QUEUES),
        "beat": settings.ops_beat,
        "concurrency": settings.ops_concurrency,
    }
    _presence = Presence("ops", process_id(), settings.heartbeat_s, lambda: record)
    _presence.start()


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _on_worker_shutdown(**_: Any) -> None:
    global _presence
    if _presence is not None:
        _presence.stop()
        _presence = None


if __name__ == "__main__":
    main()
