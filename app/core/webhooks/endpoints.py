"""Webhook endpoints (OpenAI's ``/v1/webhook_endpoints``): a tenant's URLs for OpenAI-format
events, each with the event types it receives and a signing secret of its own.

An event for an endpoint is written in the transaction of the change that causes it, as every
event is (app/core/webhooks/outbox.py): when a batch or a background response ends, one
``batch.<status>`` or ``response.<status>`` event per endpoint of its tenant that lists that
type. Its body is OpenAI's (``rules.render_openai``) and
it is signed with the endpoint's secret, so the official SDK's ``client.webhooks.unwrap``
verifies it; retries, the URL policy and redelivery (app/core/lifecycle/deliveries.py) are the
outbox's, and each endpoint has its delivery log (:func:`events_page`, every attempt recorded)
(docs/webhooks.md, "Webhook endpoints").

Only event types that inferq sends can be listed: a subscription that never fires would look
like a delivery problem.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core import queries
from app.core.errors import DomainError, Kind
from app.core.models import WebhookEndpoint, WebhookEvent, new_id, now
from app.core.webhooks.rules import check_webhook_url, new_secret

# The event types an endpoint can receive: a batch's end and a background response's, by the
# status it ended in (app/core/webhooks/outbox.py).
EVENT_TYPES = (
    "batch.completed",
    "batch.failed",
    "batch.expired",
    "batch.cancelled",
    "response.completed",
    "response.failed",
    "response.cancelled",
    "response.incomplete",
)
# A tenant's endpoints: each one multiplies every event, so there is a ceiling.
MAX_PER_TENANT = 20
# How long the previous secret keeps signing after a rotation that keeps it (OpenAI's figure).
KEEP_OLD_SECRET_S = 24 * 3600
NAME_MAX = 255
LOCK_PREFIX = "inferq:webhook_endpoints:"  # the advisory lock of a tenant's creations


def create(
    session: Session, tenant: str, *, name: str, url: str, event_types: Sequence[str]
) -> WebhookEndpoint:
    """A new endpoint, committed; its ``secret`` is shown to the caller this once."""
    types = _checked_types(event_types)
    _check_name(name)
    check_webhook_url(url, param="url")
    _one_at_a_time(session, tenant)
    count = session.scalar(
        select(func.count()).select_from(WebhookEndpoint).where(WebhookEndpoint.tenant == tenant)
    )
    if (count or 0) >= MAX_PER_TENANT:
        raise DomainError(
            Kind.CONFLICT,
            "too_many_webhook_endpoints",
            f"a tenant has at most {MAX_PER_TENANT} webhook endpoints; delete one first",
        )
    stamp = now()
    row = WebhookEndpoint(
        id=new_id("whep"),
        tenant=tenant,
        name=name,
        url=url,
        event_types=",".join(types),
        secret=new_secret(),
        created_at=stamp,
        updated_at=stamp,
    )
    session.add(row)
    session.commit()
    return row


def _one_at_a_time(session: Session, tenant: str) -> None:
    """A tenant's creations take turns until their transaction ends, so that two at once
    cannot both count 19 and both insert. PostgreSQL: a transaction-scoped advisory lock on the
    tenant. SQLite needs none: its transactions take the write lock as they begin
    (app/core/db.py)."""
    if session.get_bind().dialect.name == "postgresql":
        key = func.hashtext(f"{LOCK_PREFIX}{tenant}")
        session.execute(select(func.pg_advisory_xact_lock(key)))


def get(session: Session, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    return queries.owned(session, WebhookEndpoint, tenant, endpoint_id, "webhook_endpoint")


def list_page(
    session: Session, tenant: str, *, limit: int, after: str | None
) -> tuple[list[WebhookEndpoint], bool]:
    """Newest first; ``after`` is the last id of the previous page."""
    query = select(WebhookEndpoint).where(WebhookEndpoint.tenant == tenant)
    return queries.page(session, query, WebhookEndpoint.id, limit, after)


def update(
    session: Session,
    tenant: str,
    endpoint_id: str,
    *,
    name: str | None = None,
    url: str | None = None,
    event_types: Sequence[str] | None = None,
) -> WebhookEndpoint:
    """Change what is given; ``updated_at`` moves only when something changed (OpenAI's rule).
    Pending events and their retries go to the new URL (workers/ops/delivery.py)."""
    row = get(session, tenant, endpoint_id)
    changes: dict[str, str] = {}
    if name is not None:
        _check_name(name)
        changes["name"] = name
    if url is not None:
        check_webhook_url(url, param="url")
        changes["url"] = url
    if event_types is not None:
        changes["event_types"] = ",".join(_checked_types(event_types))
    changed = {k: v for k, v in changes.items() if getattr(row, k) != v}
    if changed:
        for key, value in changed.items():
            setattr(row, key, value)
        row.updated_at = now()
        session.commit()
    return row


def delete(session: Session, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    """Remove the endpoint and its events (delivered or not): nothing more goes to its URL."""
    row = get(session, tenant, endpoint_id)
    session.delete(row)
    session.commit()
    return row


def rotate_secret(
    session: Session, tenant: str, endpoint_id: str, *, keep_old: bool
) -> WebhookEndpoint:
    """A new secret; with ``keep_old`` the old one also signs every delivery for 24 hours, so a
    receiver can switch while both verify."""
    row = get(session, tenant, endpoint_id)
    stamp = now()
    if keep_old:
        row.previous_secret, row.previous_until = row.secret, stamp + KEEP_OLD_SECRET_S
    else:
        row.previous_secret, row.previous_until = None, None
    row.secret = new_secret()
    row.updated_at = stamp
    session.commit()
    return row


def events_page(
    session: Session, tenant: str, endpoint_id: str, *, limit: int, after: str | None
) -> tuple[list[WebhookEvent], bool]:
    """The endpoint's events, newest first: the delivery log, with ``outbox.attempts``."""
    get(session, tenant, endpoint_id)
    query = select(WebhookEvent).where(WebhookEvent.endpoint_id == endpoint_id)
    return queries.page(session, query, WebhookEvent.id, limit, after)


def event(session: Session, tenant: str, endpoint_id: str, event_id: str) -> WebhookEvent:
    get(session, tenant, endpoint_id)
    row = queries.owned(session, WebhookEvent, tenant, event_id, "webhook_event")
    if row.endpoint_id != endpoint_id:
        raise DomainError(
            Kind.NOT_FOUND,
            "webhook_event_not_found",
            f"no webhook event {event_id!r} for endpoint {endpoint_id!r}",
            param="webhook_event_id",
        )
    return row


def signing_secrets(row: WebhookEndpoint, at: float) -> list[str]:
    """The secrets that sign a delivery at ``at``: the current one, and the previous one while
    it is kept."""
    kept = row.previous_secret is not None and (row.previous_until or 0) > at
    return [row.secret, row.previous_secret] if kept and row.previous_secret else [row.secret]


def secret_hint(secret: str) -> str:
    """Enough of a secret to tell which one a receiver holds, not enough to sign."""
    return f"whsec_...{secret[-4:]}"


def types_of(row: WebhookEndpoint) -> list[str]:
    return row.event_types.split(",")


def _check_name(name: str) -> None:
    if not name.strip() or len(name) > NAME_MAX:
        raise DomainError(
            Kind.INVALID,
            "invalid_name",
            f"name must be 1 to {NAME_MAX} characters, not only spaces",
            param="name",
        )


def _checked_types(event_types: Sequence[str]) -> list[str]:
    """The types in the order given, each once; refused by name if inferq does not send it."""
    if not event_types:
        raise DomainError(
            Kind.INVALID,
            "invalid_event_types",
            f"event_types must list at least one of {', '.join(EVENT_TYPES)}",
            param="event_types",
        )
    for event_type in event_types:
        if event_type not in EVENT_TYPES:
            raise DomainError(
                Kind.INVALID,
                "unsupported_event_type",
                f"{event_type!r} is not an event type inferq sends "
                f"(it sends {', '.join(EVENT_TYPES)})",
                param="event_types",
            )
    return list(dict.fromkeys(event_types))
