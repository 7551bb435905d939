"""The Celery app of each kind of worker process, from settings, and the one way to run it.

- Lanes are separate queues polled in strict priority order (realtime, standard, bulk;
  app/core/messaging/broker.py builds every app inferq makes, with the queues and broker options).
- ``acks_late``: a message is acknowledged only after the task returned, i.e. after the job's
  final state was committed; a worker that stops puts the messages it holds back on their
  lanes. One that dies loses them with its memory (Redis keeps no redelivery of its own,
  app/core/messaging/broker.py): the job rows bring those jobs back (docs/reliability.md,
  "Reliability contract").
- Prefetch multiplier 1 with the threads pool: a worker reserves no more messages than it has
  threads, so the backlog stays in Redis where other workers and the API can see it.
- Results live in the database, never in a Celery result backend.
- The ops worker's app carries beat's schedule; its tasks and an inference worker's are
  registered by each one's composition root (workers/ops/main.py, workers/inference/main.py),
  so neither kind imports the other's.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from typing import Any, Literal

from celery import Celery

from app.core.messaging import broker
from app.core.messaging.names import (
    EXPIRE_FILES_TASK,
    MAINTENANCE_QUEUE,
    REAP_TASK,
    SWEEP_BATCHES_TASK,
    SWEEP_HISTORY_TASK,
    SWEEP_WEBHOOKS_TASK,
)
from app.core.settings import Settings

Kind = Literal["worker", "ops", "flower"]


def _beat_schedule(settings: Settings) -> dict[str, Any]:
    """The ops worker's periodic sweeps. A sweep that waited longer than its interval is
    dropped: the next one does the same work."""
    sweeps = {
        "sweep-webhooks": (SWEEP_WEBHOOKS_TASK, settings.webhook_sweep_interval_s),
        "reap": (REAP_TASK, settings.reaper_interval_s),
        "sweep-batches": (SWEEP_BATCHES_TASK, settings.batch_sweep_interval_s),
        "expire-files": (EXPIRE_FILES_TASK, settings.files_sweep_interval_s),
        "sweep-history": (SWEEP_HISTORY_TASK, settings.retention_sweep_interval_s),
    }
    return {
        name: {
            "task": task,
            "schedule": every,
            "options": {"queue": MAINTENANCE_QUEUE, "expires": every},
        }
        for name, (task, every) in sweeps.items()
    }


def create(kind: Kind, settings: Settings) -> Celery:
    """The Celery app of a process of ``kind``, no task registered (Flower's: none at all)."""
    return broker.celery_app(
        f"inferq-{kind}",
        settings,
        # Only an inference worker's intake re-opens lanes (app/core/messaging/broker.py,
        # LANE_POLL_S).
        poll_s=broker.LANE_POLL_S if kind == "worker" else None,
        task_default_queue=MAINTENANCE_QUEUE,
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
        # Beat runs inside the ops worker (`inferq ops`).
        beat_schedule=_beat_schedule(settings) if kind == "ops" else {},
    )


def log_to_stderr(*, task_lines: bool = True) -> None:
    """The log set-up of every worker process, before its parts are built; ``task_lines``:
    Celery's own line for each task received and each task ended."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # An inference worker's intake cancels and re-adds lane consumers all the time
    # (workers/inference/intake.py); Celery logs each at INFO.
    logging.getLogger("celery.worker.consumer.consumer").setLevel(logging.WARNING)
    if not task_lines:
        # An inference worker's: two lines a message, and each job's own lines (job.running,
        # job.succeeded: app/core/lifecycle/after.py) say it with the job's id; formatting them was
        # 4 % of a worker's CPU on the realtime path (docs/benchmarks.md, "CPU per realtime
        # call"). A task that raises is still logged, at ERROR. The ops worker keeps them: its
        # sweeps (the reaper's included) say they ran nowhere else.
        for name in ("celery.worker.strategy", "celery.app.trace"):
            logging.getLogger(name).setLevel(logging.WARNING)


def run_worker(
    app: Celery,
    kind: Kind,
    queues: Sequence[str],
    concurrency: int,
    options: Sequence[str] = (),
) -> None:
    """Run this process as a Celery worker of ``kind`` until it stops.

    The threads pool: prefork children are daemonic and cannot start vLLM's engine process,
    CUDA does not survive fork, and one process keeps one Prometheus registry (workers/metrics.py).
    ``queues`` are consumed in the order given (strict priority, app/core/messaging/broker.py).
    Per-process machinery starts and stops on Celery's signals, connected by each kind's
    composition root (which set up the log first: :func:`log_to_stderr`).
    """
    app.worker_main(
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
