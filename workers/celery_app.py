"""The Celery application: queues, routing, acknowledgement and prefetch, all from settings.

- Lanes are separate queues polled in strict priority order (realtime, standard, bulk).
- ``acks_late``: a message is acknowledged only after the task returned, i.e. after the job's
  final state was committed; a worker that stops puts the messages it holds back on their
  lanes. One that dies loses them with its memory (Redis keeps no redelivery of its own,
  app/core/dispatch.py): the job rows bring those jobs back (README, "Reliability").
- Prefetch multiplier 1 with the threads pool: a worker reserves no more messages than it has
  threads, so the backlog stays in Redis where other workers and the API can see it.
- Results live in the database, never in a Celery result backend.
- The ops worker consumes ``webhooks`` and ``maintenance`` and runs beat; inference workers
  consume only lanes. Both start through :func:`run_worker`: one logging set-up, one argv.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import Literal

from celery import Celery

from app.core.dispatch import (
    MAINTENANCE_QUEUE,
    REAP_TASK,
    SWEEP_BATCHES_TASK,
    SWEEP_WEBHOOKS_TASK,
    broker_transport_options,
    task_queues,
)
from app.core.settings import get_settings


def _create() -> Celery:
    """The app, configured from settings once, when a worker process imports this module."""
    settings = get_settings()
    app = Celery("inferq", broker=settings.redis_url, include=["workers.tasks"])
    app.conf.update(
        task_queues=task_queues(),
        task_default_queue=MAINTENANCE_QUEUE,
        broker_transport_options=broker_transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_ignore_result=True,
        task_store_errors_even_if_ignored=False,
        worker_prefetch_multiplier=1,
        # Task events (received, started, succeeded: three Redis publishes a task) are off
        # until someone watches: Flower turns them on when it starts (its enable_events), as
        # does `celery control enable_events`. They were a tenth of a worker's CPU on the
        # realtime path (docs/benchmarks.md, "overhead"). Worker heartbeats flow regardless.
        worker_send_task_events=False,
        task_send_sent_event=True,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        task_serializer="json",
        accept_content=["json"],
        # Beat runs inside the ops worker (`inferq ops`). A sweep that waited longer than its
        # interval is dropped: the next one does the same work.
        beat_schedule={
            "sweep-webhooks": {
                "task": SWEEP_WEBHOOKS_TASK,
                "schedule": settings.webhook_sweep_interval_s,
                "options": {
                    "queue": MAINTENANCE_QUEUE,
                    "expires": settings.webhook_sweep_interval_s,
                },
            },
            "reap": {
                "task": REAP_TASK,
                "schedule": settings.reaper_interval_s,
                "options": {"queue": MAINTENANCE_QUEUE, "expires": settings.reaper_interval_s},
            },
            "sweep-batches": {
                "task": SWEEP_BATCHES_TASK,
                "schedule": settings.batch_sweep_interval_s,
                "options": {"queue": MAINTENANCE_QUEUE, "expires": settings.batch_sweep_interval_s},
            },
        },
    )
    return app


celery_app = _create()


def run_worker(
    kind: Literal["worker", "ops"],
    queues: Sequence[str],
    concurrency: int,
    options: Sequence[str] = (),
) -> None:
    """Run this process as a Celery worker of ``kind`` until it stops.

    The threads pool: prefork children are daemonic and cannot start vLLM's engine process,
    CUDA does not survive fork, and one process keeps one Prometheus registry (workers/metrics.py).
    ``queues`` are consumed in the order given (strict priority, app/core/dispatch.py).
    Per-process machinery starts and stops on Celery's signals (workers/lifecycle.py,
    workers/ops.py), after the logging set-up here.
    """
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # An inference worker's intake cancels and re-adds lane consumers all the time
    # (workers/intake.py); Celery logs each at INFO.
    logging.getLogger("celery.worker.consumer.consumer").setLevel(logging.WARNING)
    celery_app.worker_main(
        [
            "worker",
            "--pool=threads",
            f"--concurrency={concurrency}",
            f"--queues={','.join(queues)}",
            f"--hostname=inferq-{kind}-{os.getpid()}@{socket.gethostname()}",
            *options,
            "--loglevel=INFO",
            "--without-mingle",
            "--without-gossip",
        ]
    )
