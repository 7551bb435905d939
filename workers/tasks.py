"""Celery tasks. Thin: each one delegates to the module that owns the work."""

from __future__ import annotations

from celery import Task

from app.dispatch import RUN_JOBS_TASK
from workers import lifecycle
from workers.celery_app import celery_app


@celery_app.task(name=RUN_JOBS_TASK, bind=True)  # type: ignore[untyped-decorator]
def run_jobs(self: Task, job_ids: list[str], lane: str) -> dict[str, int]:
    """Run one message's jobs; returns how they ended (for the Celery event log and Flower)."""
    return lifecycle.current().executor.execute(job_ids, lane, message_id=self.request.id)
