"""Celery tasks. Thin: each one delegates to the module that owns the work."""

from __future__ import annotations

from celery import Task

from app.dispatch import DELIVER_WEBHOOK_TASK, RUN_JOBS_TASK, SWEEP_WEBHOOKS_TASK
from app.settings import get_settings
from workers import delivery, lifecycle
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
