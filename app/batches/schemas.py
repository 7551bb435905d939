"""OpenAI's Batch API on the wire: a batch's body (``POST /v1/batches``) and the Batch object
(docs/openai.md, "OpenAI-compatible API", **Batches.**), which a ``batch.*`` webhook event
carries too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from app.core.contract.base import StrictModel, check_metadata, check_webhook_scheme, secs
from app.core.models import Batch


class BatchCreate(StrictModel):
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = Field(
        description='"24h" as with OpenAI, or any duration like "90s", "30m", "2h" up to '
        "INFERQ_BATCH_MAX_WINDOW_S."
    )
    metadata: dict[str, str] | None = None
    # inferq's addition: batch.* events are signed and delivered like job events.
    webhook_url: str | None = Field(None, max_length=2048)

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return None if value is None else check_metadata(value)

    @field_validator("webhook_url")
    @classmethod
    def _webhook_scheme(cls, value: str | None) -> str | None:
        return check_webhook_scheme(value)


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    webhook_url: str | None

    @classmethod
    def from_row(cls, batch: Batch, counts: RequestCounts | None = None) -> BatchOut:
        errors = None
        if batch.errors:
            errors = BatchErrors(data=[BatchError(**e) for e in batch.errors])
        return cls(
            id=batch.id,
            endpoint=batch.endpoint,
            errors=errors,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=batch.status,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            created_at=int(batch.created_at),
            in_progress_at=secs(batch.in_progress_at),
            expires_at=secs(batch.expires_at),
            finalizing_at=secs(batch.finalizing_at),
            completed_at=secs(batch.completed_at),
            failed_at=secs(batch.failed_at),
            expired_at=secs(batch.expired_at),
            cancelling_at=secs(batch.cancelling_at),
            cancelled_at=secs(batch.cancelled_at),
            request_counts=counts
            or RequestCounts(
                total=batch.request_total,
                completed=batch.request_completed,
                failed=batch.request_failed,
            ),
            metadata=batch.meta or None,
            webhook_url=batch.webhook_url,
        )
