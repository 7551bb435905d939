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

from app.core.errors import DomainError, Kind
from app.core.lifecycle.changes import changes
from app.core.models import TERMINAL, Job, WebhookAttempt, WebhookEvent, WebhookStatus, now
from app.core.webhooks import endpoints, outbox


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


def redeliver_job_event(session: Session, job: Job) -> WebhookEvent:
    """Send a finished job's event again, same ``webhook-id``, with a fresh retry schedule."""
    if job.webhook_url is None:
        raise DomainError(Kind.CONFLICT, "no_webhook", "this job has no webhook_url", param="id")
    if job.status not in TERMINAL or job.finished_at is None:
        raise DomainError(
            Kind.CONFLICT, "job_not_finished", "the job has no event until it ends", param="id"
        )
    event = outbox.job_event(session, job)
    if event is None:
        # Finished before it had an event (e.g. before webhooks existed): create it now.
        with changes("api", session=session) as tx:
            outbox.record_job_events(tx.connection, [job.id], job.finished_at)
        event = outbox.job_event(session, job)
        assert event is not None
    return send_again(session, event, param="id")


def redeliver_endpoint_event(
    session: Session, tenant: str, endpoint_id: str, event_id: str
) -> WebhookEvent:
    """Send the event again to the endpoint's URL as it was written, same ``webhook-id``."""
    row = endpoints.event(session, tenant, endpoint_id, event_id)
    return send_again(session, row, param="webhook_event_id")
