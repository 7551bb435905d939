"""OpenAI's webhook endpoints: /v1/webhook_endpoints and /v1/webhook_event_types, for the
caller's tenant (app/core/webhooks/endpoints.py does the work; docs/webhooks.md, "Webhook
endpoints")."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.auth import Tenant
from app.api.deps import SessionDep
from app.api.schemas import (
    ErrorBody,
    Page,
    WebhookDeliveryList,
    WebhookDeliveryOut,
    WebhookEndpointCreate,
    WebhookEndpointDeleted,
    WebhookEndpointOut,
    WebhookEndpointUpdate,
    WebhookEndpointWithSecret,
    WebhookEventOut,
    WebhookEventTypeList,
    WebhookSecretRotate,
)
from app.core.lifecycle import deliveries
from app.core.webhooks import endpoints, outbox

router = APIRouter(prefix="/v1", tags=["webhooks"], responses={"default": {"model": ErrorBody}})


@router.post("/webhook_endpoints", response_model=WebhookEndpointWithSecret)
def create_endpoint(
    body: WebhookEndpointCreate, tenant: Tenant, session: SessionDep
) -> WebhookEndpointWithSecret:
    """A new endpoint; its ``signing_secret`` is in this answer only."""
    row = endpoints.create(
        session, tenant, name=body.name, url=body.url, event_types=body.event_types
    )
    return WebhookEndpointWithSecret.from_row(row)


@router.get("/webhook_endpoints", response_model=Page[WebhookEndpointOut])
def list_endpoints(
    tenant: Tenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1)] = 20,
    after: str | None = None,
) -> Page[WebhookEndpointOut]:
    """Endpoints, newest first; pass the last id as ``after`` for the next page."""
    rows, has_more = endpoints.list_page(session, tenant, limit=limit, after=after)
    return Page[WebhookEndpointOut].of([WebhookEndpointOut.from_row(r) for r in rows], has_more)


@router.get("/webhook_endpoints/{endpoint_id}", response_model=WebhookEndpointOut)
def get_endpoint(endpoint_id: str, tenant: Tenant, session: SessionDep) -> WebhookEndpointOut:
    return WebhookEndpointOut.from_row(endpoints.get(session, tenant, endpoint_id))


@router.post("/webhook_endpoints/{endpoint_id}", response_model=WebhookEndpointOut)
def update_endpoint(
    endpoint_id: str, body: WebhookEndpointUpdate, tenant: Tenant, session: SessionDep
) -> WebhookEndpointOut:
    row = endpoints.update(
        session,
        tenant,
        endpoint_id,
        name=body.name,
        url=body.url,
        event_types=body.event_types,
    )
    return WebhookEndpointOut.from_row(row)


@router.delete("/webhook_endpoints/{endpoint_id}", response_model=WebhookEndpointDeleted)
def delete_endpoint(
    endpoint_id: str, tenant: Tenant, session: SessionDep
) -> WebhookEndpointDeleted:
    return WebhookEndpointDeleted(id=endpoints.delete(session, tenant, endpoint_id).id)


@router.post(
    "/webhook_endpoints/{endpoint_id}/rotate_secret", response_model=WebhookEndpointWithSecret
)
def rotate_secret(
    endpoint_id: str, tenant: Tenant, session: SessionDep, body: WebhookSecretRotate | None = None
) -> WebhookEndpointWithSecret:
    """A new secret; with ``keep_old_secret_active_for_24_hours`` both sign for a day."""
    keep = body.keep_old_secret_active_for_24_hours if body is not None else False
    row = endpoints.rotate_secret(session, tenant, endpoint_id, keep_old=keep)
    return WebhookEndpointWithSecret.from_row(row)


@router.get("/webhook_endpoints/{endpoint_id}/events", response_model=Page[WebhookEventOut])
def list_events(
    endpoint_id: str,
    tenant: Tenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1)] = 20,
    after: str | None = None,
) -> Page[WebhookEventOut]:
    """The endpoint's events, newest first, with their delivery state (inferq's addition)."""
    rows, has_more = endpoints.events_page(session, tenant, endpoint_id, limit=limit, after=after)
    return Page[WebhookEventOut].of([WebhookEventOut.from_row(r) for r in rows], has_more)


@router.get(
    "/webhook_endpoints/{endpoint_id}/events/{event_id}", response_model=WebhookDeliveryList
)
def event_deliveries(
    endpoint_id: str, event_id: str, tenant: Tenant, session: SessionDep
) -> WebhookDeliveryList:
    """One event and every attempt to deliver it, oldest first."""
    row = endpoints.event(session, tenant, endpoint_id, event_id)
    return WebhookDeliveryList(
        event=WebhookEventOut.from_row(row),
        data=[WebhookDeliveryOut.from_row(a) for a in outbox.attempts(session, row)],
    )


@router.post(
    "/webhook_endpoints/{endpoint_id}/events/{event_id}/redeliver",
    status_code=202,
    response_model=WebhookEventOut,
)
def redeliver(
    endpoint_id: str, event_id: str, tenant: Tenant, session: SessionDep
) -> WebhookEventOut:
    """Send the event again (same webhook-id, same body), with a fresh retry schedule."""
    return WebhookEventOut.from_row(
        deliveries.redeliver_endpoint_event(session, tenant, endpoint_id, event_id)
    )


@router.get("/webhook_event_types", response_model=WebhookEventTypeList)
def event_types(_caller: Tenant) -> WebhookEventTypeList:
    """The event types an endpoint can list here (for any caller with a key)."""
    return WebhookEventTypeList(data=list(endpoints.EVENT_TYPES))
