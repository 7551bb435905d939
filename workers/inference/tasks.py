"""The inference worker's one task, ``run_jobs``: thin, it hands the message to the executor.

Registered on the worker's own Celery app by its composition root (workers/inference/main.py),
bound to the executor that root built: the ops worker registers none of it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from app.core.messaging.broker import RunJobs
from app.core.messaging.names import RUN_JOBS_TASK
from workers.inference.executor import Executor


def register(app: Celery, executor: Executor) -> None:
    """Register ``run_jobs`` on ``app``, run by ``executor``."""

    @app.task(name=RUN_JOBS_TASK, bind=True)  # type: ignore[untyped-decorator]
    def run_jobs(self: Task, *args: Any) -> dict[str, int]:
        """Run one message's jobs; returns how they ended (for the Celery event log and
        Flower)."""
        message = RunJobs.of_args(args)
        return executor.execute(message.job_ids, message.lane, message_id=self.request.id)
