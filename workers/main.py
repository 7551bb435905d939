"""Entry point of an inference worker process (`inferq worker` runs `python -m workers.main`).

The Celery worker runs with the threads pool: prefork children are daemonic and cannot start
vLLM's engine process, and CUDA does not survive fork. Lanes are consumed in strict priority
order whatever order they were given in.
"""

from __future__ import annotations

import logging
import os
import socket

from app.core.settings import LANES, get_settings

SPARE_THREADS = 8


def main() -> None:
    settings = get_settings()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from workers import lifecycle
    from workers.celery_app import celery_app

    # The intake cancels and re-adds lane consumers all the time; Celery logs each at INFO.
    logging.getLogger("celery.worker.consumer.consumer").setLevel(logging.WARNING)
    lifecycle.enable_inference()
    lanes = [lane for lane in LANES if lane in settings.lanes]
    celery_app.worker_main(
        [
            "worker",
            "--pool=threads",
            # Threads hold messages; the intake keeps jobs within worker_concurrency slots, and
            # the spare threads absorb the message or two fetched while a lane closes.
            f"--concurrency={settings.worker_concurrency + SPARE_THREADS}",
            f"--queues={','.join(lanes)}",
            f"--hostname=inferq-worker-{os.getpid()}@{socket.gethostname()}",
            "--loglevel=INFO",
            "--without-mingle",
            "--without-gossip",
        ]
    )


if __name__ == "__main__":  # vLLM's spawned engine process re-imports this module
    main()
