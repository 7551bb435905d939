"""Entry point of an inference worker process (`inferq worker` runs `python -m workers.main`).

The Celery worker runs with the threads pool: prefork children are daemonic and cannot start
vLLM's engine process, and CUDA does not survive fork. Lanes are consumed in strict priority
order whatever order they were given in.
"""

from __future__ import annotations

import logging
import os
import socket

from app.settings import LANES, get_settings


def main() -> None:
    settings = get_settings()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from workers import lifecycle
    from workers.celery_app import celery_app

    lifecycle.enable_inference()
    lanes = [lane for lane in LANES if lane in settings.lanes]
    celery_app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={settings.worker_concurrency}",
            f"--queues={','.join(lanes)}",
            f"--hostname=inferq-worker-{os.getpid()}@{socket.gethostname()}",
            "--loglevel=INFO",
            "--without-mingle",
            "--without-gossip",
        ]
    )


if __name__ == "__main__":  # vLLM's spawned engine process re-imports this module
    main()
