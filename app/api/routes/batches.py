"""OpenAI's Files and Batch APIs: /v1/files and /v1/batches."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Form, Query, Request, UploadFile
from fastapi.responses import FileResponse

from app.api.auth import Tenant, caller_limits
from app.api.deps import SessionDep
from app.api.schemas import (
    ErrorBody,
    FileDeleted,
    FileOut,
    Page,
)
from app.batches import service as batches
from app.core import files, limits, storage
from app.core.schemas import BatchCreate, BatchOut

router = APIRouter(prefix="/v1", tags=["batches"], responses={"default": {"model": ErrorBody}})


# --- files -------------------------------------------------------------------------------------


@router.post("/files", response_model=FileOut)
def upload_file(
    tenant: Tenant,
    session: SessionDep,
    file: UploadFile,
    purpose: Annotated[str, Form()],
) -> FileOut:
    """Upload a JSONL batch input (multipart: ``file`` and ``purpose=batch``)."""
    row = files.upload(session, tenant, file.file, file.filename or "upload.jsonl", purpose)
    return FileOut.from_row(row)


@router.get("/files", response_model=Page[FileOut])
def list_files(
    tenant: Tenant,
    session: SessionDep,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1)] = 20,
    after: str | None = None,
) -> Page[FileOut]:
    """Files, newest first; pass the last id as ``after`` for the next page."""
    rows, has_more = files.list_page(session, tenant, purpose=purpose, limit=limit, after=after)
    return Page[FileOut].of([FileOut.from_row(r) for r in rows], has_more)


@router.get("/files/{file_id}", response_model=FileOut)
def get_file(file_id: str, tenant: Tenant, session: SessionDep) -> FileOut:
    return FileOut.from_row(files.get(session, tenant, file_id))


@router.get("/files/{file_id}/content", response_class=FileResponse)
def file_content(file_id: str, tenant: Tenant, session: SessionDep) -> FileResponse:
    """The file's bytes, streamed from storage."""
    row = files.get(session, tenant, file_id)
    return FileResponse(
        storage.path(row.id), media_type="application/octet-stream", filename=row.filename
    )


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, tenant: Tenant, session: SessionDep) -> FileDeleted:
    return FileDeleted(id=files.delete(session, tenant, file_id).id)


# --- batches -----------------------------------------------------------------------------------


@router.post("/batches", response_model=BatchOut)
def create_batch(
    body: BatchCreate, tenant: Tenant, session: SessionDep, request: Request
) -> BatchOut:
    """Start a batch over an uploaded file; it is validated by the ops worker (``validating``)."""
    limits.admit(session, tenant, caller_limits(request))
    batch = batches.create(session, tenant, body)
    return BatchOut.from_row(batch)


@router.get("/batches", response_model=Page[BatchOut])
def list_batches(
    tenant: Tenant,
    session: SessionDep,
    limit: Annotated[int, Query(ge=1)] = 20,
    after: str | None = None,
) -> Page[BatchOut]:
    """Batches, newest first; pass the last id as ``after`` for the next page."""
    rows, has_more = batches.list_page(session, tenant, limit=limit, after=after)
    return Page[BatchOut].of(
        [BatchOut.from_row(b, batches.counts(session, b)) for b in rows], has_more
    )


@router.get("/batches/{batch_id}", response_model=BatchOut)
def get_batch(batch_id: str, tenant: Tenant, session: SessionDep) -> BatchOut:
    """A batch with live ``request_counts``."""
    batch = batches.get(session, tenant, batch_id)
    return BatchOut.from_row(batch, batches.counts(session, batch))


@router.post("/batches/{batch_id}/cancel", response_model=BatchOut)
def cancel_batch(batch_id: str, tenant: Tenant, session: SessionDep) -> BatchOut:
    """Cancel: ``cancelling`` until running lines have stopped, then ``cancelled``."""
    batch = batches.cancel(session, tenant, batch_id)
    return BatchOut.from_row(batch, batches.counts(session, batch))
