"""The ops worker's tasks: thin, each one hands off to the module that owns the work.

Registered on the ops worker's own Celery app by its composition root (workers/ops/main.py):
webhook deliveries, and the sweeps beat sends (webhooks due, the reaper, batches).
"""

from __future__ import annotations

from celery import Celery

from app.batches import finalize, validation
from app.core.names import (
    DELIVER_WEBHOOK_TASK,
    REAP_TASK,
    START_BATCH_TASK,
    SWEEP_BATCHES_TASK,
    SWEEP_WEBHOOKS_TASK,
)
from app.core.settings import Settings
from workers.ops import delivery, reaper


def register(app: Celery, settings: Settings) -> None:
    """Register the ops worker's tasks on ``app``, with ``settings``."""

    @app.task(name=DELIVER_WEBHOOK_TASK)  # type: ignore[untyped-decorator]
    def deliver_webhook(event_id: str) -> str:
        """One delivery attempt of a webhook event."""
        return delivery.deliver(event_id, settings)

    @app.task(name=SWEEP_WEBHOOKS_TASK)  # type: ignore[untyped-decorator]
    def sweep_webhooks() -> int:
        """Announce webhook events whose next attempt is due (beat)."""
        return delivery.sweep()

    @app.task(name=START_BATCH_TASK)  # type: ignore[untyped-decorator]
    def start_batch(batch_id: str) -> str:
        """Validate a batch's input file and start its jobs, or fail it."""
        return validation.start(batch_id)

    @app.task(name=SWEEP_BATCHES_TASK)  # type: ignore[untyped-decorator]
    def sweep_batches() -> int:
        """Expire overdue batches and finalize finished ones (beat)."""
        return finalize.sweep()

    @app.task(name=REAP_TASK)  # type: ignore[untyped-decorator]
    def reap() -> dict[str, int]:
        """Requeue jobs of lost workers, send lost jobs again, expire overdue ones (beat)."""
        return reaper.sweep(settings)
