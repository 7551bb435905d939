"""Bodies only the API reads or sends: lists, error envelopes, files, webhook deliveries and
webhook endpoints.

The bodies the rest of inferq shares (job and batch requests, the Job and Batch objects that
webhooks carry too) are app/core/contract/.
"""

from __future__ import annotations

from typing import Generic, Literal, Self, TypeVar

from pydantic import BaseModel, Field, field_validator

from app.core.contract.base import StrictModel, secs
from app.core.contract.jobs import JobCreate, JobOut
from app.core.lifecycle.retention import Kept
from app.core.models import File, WebhookAttempt, WebhookEndpoint, WebhookEvent
from app.core.settings import get_settings
from app.core.storage import files
from app.core.webhooks import endpoints


class JobBulkCreate(StrictModel):
    """``POST /v1/jobs/bulk``: many job bodies, accepted or refused together."""

    jobs: list[JobCreate] = Field(min_length=1)

    @field_validator("jobs")
    @classmethod
    def _count(cls, value: list[JobCreate]) -> list[JobCreate]:
        limit = get_settings().bulk_max_jobs
        if len(value) > limit:
            raise ValueError(f"at most {limit} jobs per request (got {len(value)})")
        return value


Item = TypeVar("Item", bound=BaseModel)


class Page(BaseModel, Generic[Item]):
    """A page of a list, newest first, as OpenAI's cursor pages: pass ``last_id`` as ``after``
    for the next one."""

    object: Literal["list"] = "list"
    data: list[Item]
    has_more: bool
    first_id: str | None
    last_id: str | None

    @classmethod
    def of(cls, data: list[Item], has_more: bool) -> Self:
        ids = [str(getattr(item, "id")) for item in data[:1] + data[-1:]]  # noqa: B009
        return cls(
            data=data,
            has_more=has_more,
            first_id=ids[0] if ids else None,
            last_id=ids[-1] if ids else None,
        )


class JobList(BaseModel):
    """A page of jobs, newest first, and where the tenant's history ends: jobs finished longer
    ago than ``retention_s`` (None: kept forever) are deleted, and ``expired_through`` is the
    newest job id deleted so far (None: none), so a page that reaches it may be the last one
    with those jobs in it (docs/api.md, "What is kept")."""

    object: Literal["list"] = "list"
    data: list[JobOut]
    has_more: bool
    retention_s: int | None = None
    expired_through: str | None = None


class JobBulkOut(BaseModel):
    data: list[JobOut]


class ErrorDetail(BaseModel):
    type: str
    code: str | None
    message: str
    param: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class WebhookEventOut(BaseModel):
    id: str  # the webhook-id header of every attempt
    object: Literal["webhook_event"] = "webhook_event"
    type: str
    url: str
    status: str
    attempts: int
    next_attempt_at: int | None
    created_at: int

    @classmethod
    def from_row(cls, event: WebhookEvent) -> WebhookEventOut:
        return cls(
            id=event.id,
            type=event.type,
            url=event.url,
            status=event.status,
            attempts=event.attempts,
            next_attempt_at=secs(event.next_attempt_at),
            created_at=int(event.created_at),
        )


class WebhookDeliveryOut(BaseModel):
    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    webhook_id: str
    attempt: int
    kind: str
    url: str
    address: str | None
    created_at: float
    latency_ms: float | None
    status_code: int | None
    ok: bool
    error: str | None
    response_body: str | None

    @classmethod
    def from_row(cls, attempt: WebhookAttempt) -> WebhookDeliveryOut:
        return cls(
            id=attempt.id,
            webhook_id=attempt.event_id,
            attempt=attempt.number,
            kind=attempt.kind,
            url=attempt.url,
            address=attempt.address,
            created_at=attempt.started_at,
            latency_ms=attempt.latency_ms,
            status_code=attempt.status_code,
            ok=attempt.ok,
            error=attempt.error,
            response_body=attempt.response_body,
        )


class WebhookDeliveryList(BaseModel):
    object: Literal["list"] = "list"
    event: WebhookEventOut | None
    data: list[WebhookDeliveryOut]


class FileOut(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    # inferq's own (docs/files.md, "Switching stores"): the store that holds the bytes (None:
    # stored before it was recorded), and whether that is the current store; a file whose
    # bytes are elsewhere answers 409 file_in_other_store for its content.
    store: str | None = None
    store_current: bool = True

    @classmethod
    def from_row(cls, row: File, current: str | None = None) -> FileOut:
        """``current``: the current store's name (store.describe), when the caller has it."""
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=int(row.created_at),
            filename=row.filename,
            purpose=row.purpose,
            expires_at=None if row.expires_at is None else int(row.expires_at),
            store=row.store,
            store_current=files.elsewhere(row, current) is None,
        )


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# --- webhook endpoints (OpenAI's /v1/webhook_endpoints) ---------------------------------------


class WebhookEndpointCreate(StrictModel):
    event_types: list[str]
    name: str
    url: str


class TenantUpdate(StrictModel):
    """``POST /v1/admin/tenants/{tenant}``: the tenant's own retention of finished jobs in
    seconds (0: forever), or null for the deployment's (``INFERQ_JOB_RETENTION_S``)."""

    job_retention_s: int | None


class TenantOut(BaseModel):
    """What is kept of a tenant's history (docs/api.md, "What is kept")."""

    id: str
    object: Literal["tenant"] = "tenant"
    job_retention_s: int | None  # its own; null: the deployment's
    retention_s: int | None  # in force; null: kept forever
    expired_through: str | None  # the newest job id retention has deleted
    swept_at: int | None

    @classmethod
    def of(cls, found: Kept) -> Self:
        return cls(
            id=found.tenant,
            job_retention_s=found.own_s,
            retention_s=found.retention_s or None,
            expired_through=found.swept_through,
            swept_at=secs(found.swept_at),
        )


class WebhookEndpointUpdate(StrictModel):
    """Only what is given changes; ``event_types`` is the complete new set."""

    event_types: list[str] | None = None
    name: str | None = None
    url: str | None = None


class WebhookSecretRotate(StrictModel):
    keep_old_secret_active_for_24_hours: bool = False


class WebhookEndpointOut(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    created_at: int
    updated_at: int
    event_types: list[str]
    name: str
    url: str
    signing_secret_hint: str

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookEndpointOut:
        return cls(
            id=row.id,
            created_at=int(row.created_at),
            updated_at=int(row.updated_at),
            event_types=endpoints.types_of(row),
            name=row.name,
            url=row.url,
            signing_secret_hint=endpoints.secret_hint(row.secret),
        )


class WebhookEndpointWithSecret(WebhookEndpointOut):
    """Sent when the endpoint is made and when its secret is rotated, never again."""

    signing_secret: str

    @classmethod
    def from_row(cls, row: WebhookEndpoint) -> WebhookEndpointWithSecret:
        shown = WebhookEndpointOut.from_row(row).model_dump()
        return cls(**shown, signing_secret=row.secret)


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class WebhookEventTypeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[str]
