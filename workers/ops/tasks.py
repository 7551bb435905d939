"""The ops worker's tasks: thin, each one hands off to the module that owns the work.

Registered on the ops worker's own Celery app by its composition root (workers/ops/main.py):
webhook deliveries, and the sweeps beat sends (webhooks due, the reaper, batches, expired
files, finished jobs past their retention).
"""

from __future__ import annotations

from celery import Celery

from app.batches import finalize, validation
from app.core.lifecycle import retention
from app.core.messaging.names import (
    DELIVER_WEBHOOK_TASK,
    EXPIRE_FILES_TASK,
    FINALIZE_BATCH_TASK,
    REAP_TASK,
    START_BATCH_TASK,
    SWEEP_BATCHES_TASK,
    SWEEP_HISTORY_TASK,
    SWEEP_WEBHOOKS_TASK,
)
from app.core.settings import Settings
from app.core.storage import files, store
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

    @app.task(name=FINALIZE_BATCH_TASK)  # type: ignore[untyped-decorator]
    def finalize_batch(batch_id: str) -> bool:
        """Write a batch's outputs now that its last jobs ended (a worker's nudge)."""
        return finalize.finalize(batch_id)

    @app.task(name=SWEEP_BATCHES_TASK)  # type: ignore[untyped-decorator]
    def sweep_batches() -> int:
        """Expire overdue batches and finalize finished ones (beat)."""
        return finalize.sweep()

    @app.task(name=EXPIRE_FILES_TASK)  # type: ignore[untyped-decorator]
    def expire_files() -> int:
        """Delete files whose expires_at has passed, object and row, and remove uploads
        nobody will finish (beat)."""
        return files.delete_expired() + store.abort_abandoned(settings.files_abandoned_upload_s)

    @app.task(name=REAP_TASK)  # type: ignore[untyped-decorator]
    def reap() -> dict[str, int]:
        """Requeue jobs of lost workers, send lost jobs again, expire overdue ones (beat)."""
        return reaper.sweep(settings)

    @app.task(name=SWEEP_HISTORY_TASK)  # type: ignore[untyped-decorator]
    def sweep_history() -> int:
        """Delete finished jobs past their tenant's retention (beat)."""
        return retention.sweep_beat(settings)
