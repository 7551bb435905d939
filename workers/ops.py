"""Entry point of the ops worker (`inferq ops` runs `python -m workers.ops`).

It delivers webhooks (queue ``webhooks``), runs the periodic sweeps (queue ``maintenance``)
and embeds Celery beat, which sends those sweeps. It holds no engine and no GPU. Several ops
workers may run: deliveries and sweeps are claims in the database, so a duplicate sweep or
message does no harm. Beat belongs in one of them only (``inferq ops --no-beat`` for the
others, ``INFERQ_OPS_BEAT``); its schedule file lives in ``data_dir``.
"""

from __future__ import annotations

import logging
import os
import socket

from app.core.dispatch import MAINTENANCE_QUEUE, WEBHOOK_QUEUE
from app.core.settings import get_settings
from app.core.webhooks import load_secret
from workers import metrics


def main() -> None:
    settings = get_settings()
    beat = settings.ops_beat
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from workers.celery_app import celery_app

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    load_secret(settings)  # made now, not at the first delivery, so `inferq up` can show it
    metrics.serve(settings.metrics_host, settings.ops_metrics_port, settings.metrics_advertise_host)
    celery_app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={settings.ops_concurrency}",
            # Sweeps first: strict order, and a sweep must not wait behind a delivery backlog.
            f"--queues={MAINTENANCE_QUEUE},{WEBHOOK_QUEUE}",
            f"--hostname=inferq-ops-{os.getpid()}@{socket.gethostname()}",
            *(
                ["--beat", f"--schedule={settings.data_dir / 'celerybeat-schedule'}"]
                if beat
                else []
            ),
            "--loglevel=INFO",
            "--without-mingle",
            "--without-gossip",
        ]
    )


if __name__ == "__main__":
    main()
