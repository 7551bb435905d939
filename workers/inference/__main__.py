"""Entry point of an inference worker process (`inferq worker` runs `python -m workers.main`).

The Celery worker runs with the threads pool (workers/celery_app.py: run_worker); the engine,
heartbeat and listener start and stop on Celery's signals (workers/lifecycle.py). The worker
consumes its model's queues only (app/core/dispatch.py, ``queue_of``), its lanes in strict
priority order whatever order they were given in.
"""

from __future__ import annotations

from app.core.dispatch import queue_of
from app.core.settings import LANES, get_settings

SPARE_THREADS = 8


def main() -> None:
    settings = get_settings()
    # Imported here, not at the top: vLLM's spawned engine process re-imports this module and
    # has no use for Celery or the worker's machinery.
    from workers import lifecycle
    from workers.celery_app import run_worker

    lifecycle.enable_inference()
    # Threads hold messages; the intake keeps jobs within worker_concurrency slots, and the
    # spare threads absorb the message or two fetched while a lane closes.
    run_worker(
        "worker",
        [queue_of(lane, settings.model_name) for lane in LANES if lane in settings.lanes],
        settings.worker_concurrency + SPARE_THREADS,
    )


if __name__ == "__main__":  # vLLM's spawned engine process re-imports this module
    main()
