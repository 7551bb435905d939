"""Celery tasks. Thin: each one delegates to the module that owns the work."""

from __future__ import annotations

from app.dispatch import RUN_JOB_TASK
from workers import lifecycle
from workers.celery_app import celery_app


@celery_app.task(name=RUN_JOB_TASK)  # type: ignore[untyped-decorator]
def run_job(job_id: str) -> str:
    """Run one job; returns how it ended (for the Celery event log and Flower)."""
    return lifecycle.current().executor.execute(job_id)
