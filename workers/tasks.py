"""Celery tasks. Thin: each one delegates to the module that owns the work."""

from __future__ import annotations

from celery import Task

from app.batches import finalize, validation
from app.core.dispatch import (
    DELIVER_WEBHOOK_TASK,
    REAP_TASK,
    RUN_JOBS_TASK,
    START_BATCH_TASK,
    SWEEP_BATCHES_TASK,
    SWEEP_WEBHOOKS_TASK,
)
from app.core.settings import get_settings
from workers import delivery, lifecycle, reaper
from workers.celery_app import celery_app


@celery_app.task(name=RUN_JOBS_TASK, bind=True)  # type: ignore[untyped-decorator]
def run_jobs(self: Task, job_ids: list[str], lane: str) -> dict[str, int]:
    """Run one message's jobs; returns how they ended (for the Celery event log and Flower)."""
    return lifecycle.current().executor.execute(job_ids, lane, message_id=self.request.id)


@celery_app.task(name=DELIVER_WEBHOOK_TASK)  # type: ignore[untyped-decorator]
def deliver_webhook(event_id: str) -> str:
    """One delivery attempt of a webhook event (ops worker)."""
    return delivery.deliver(event_id, get_settings())


@celery_app.task(name=SWEEP_WEBHOOKS_TASK)  # type: ignore[untyped-decorator]
def sweep_webhooks() -> int:
    """Announce webhook events whose next attempt is due (beat, ops worker)."""
    return delivery.sweep()


@celery_app.task(name=START_BATCH_TASK)  # type: ignore[untyped-decorator]
def start_batch(batch_id: str) -> str:
    """Validate a batch's input file and start its jobs, or fail it (ops worker)."""
    return validation.start(batch_id)


@celery_app.task(name=SWEEP_BATCHES_TASK)  # type: ignore[untyped-decorator]
def sweep_batches() -> int:
    """Expire overdue batches and finalize finished ones (beat, ops worker)."""
    return finalize.sweep()


@celery_app.task(name=REAP_TASK)  # type: ignore[untyped-decorator]
def reap() -> dict[str, int]:
    """Requeue jobs of lost workers, send unsent jobs, expire overdue ones (beat, ops worker)."""
    return reaper.sweep()
