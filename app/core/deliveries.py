"""Sending a webhook event again: the one write path of a redelivery, for a job's event
(``POST /v1/jobs/{id}/webhook-deliveries/redeliver``) and for an endpoint's
(``POST /v1/webhook_endpoints/{id}/events/{event_id}/redeliver``).

A redelivery keeps the event's id (the ``webhook-id``) and its body, and starts a new round of
the retry schedule; it is refused while an attempt is under way, so that two attempts of one
event never run at once (docs/webhooks.md).
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.changes import changes
from app.core.errors import DomainError, Kind
from app.core.models import WebhookAttempt, WebhookEvent, WebhookStatus, now


def _delivery_in_flight(session: Session, event: WebhookEvent) -> bool:
    """An attempt was claimed and has not been recorded yet, and its lease still runs."""
    recorded = session.scalar(
        select(func.count()).select_from(WebhookAttempt).where(WebhookAttempt.event_id == event.id)
    )
    lease = event.next_attempt_at
    return (
        event.status == WebhookStatus.PENDING
        and event.attempts > (recorded or 0)
        and lease is not None
        and lease > now()
    )


def send_again(session: Session, event: WebhookEvent, *, param: str) -> WebhookEvent:
    """Pending again from now, with a fresh round of retries; announced after the commit."""
    if _delivery_in_flight(session, event):
        raise DomainError(
            Kind.CONFLICT,
            "delivery_in_progress",
            "an attempt to deliver this event is under way; retry when it has ended",
            param=param,
        )
    with changes("api", session=session) as tx:
        stamp = now()
        event.status = WebhookStatus.PENDING
        event.round_attempts = 0
        event.next_attempt_at = stamp
        event.updated_at = stamp
        tx.after.events.append(event.id)
    session.refresh(event)
    return event
