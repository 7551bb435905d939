"""OpenAI's Files and Batch APIs: /v1/files and /v1/batches."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.api import downloads, uploads
from app.api.auth import Tenant, caller_limits
from app.api.deps import SessionDep
from app.api.schemas import (
    ErrorBody,
    FileDeleted,
    FileOut,
    Page,
)
from app.batches import service as batches
from app.batches.schemas import BatchCreate, BatchOut
from app.core.errors import DomainError, Kind
from app.core.models import new_id
from app.core.scheduling import limits
from app.core.settings import get_settings
from app.core.storage import files, store

router = APIRouter(prefix="/v1", tags=["batches"], responses={"default": {"model": ErrorBody}})


def _batches_on() -> None:
    """A deployment with no place for files serves no files nor batches (INFERQ_BATCHES_ENABLED,
    docs/files.md)."""
    if not get_settings().batches_enabled:
        raise DomainError(
            Kind.NOT_FOUND,
            "batches_disabled",
            "files and batches are off in this deployment (INFERQ_BATCHES_ENABLED)",
        )


BatchesOn = Depends(_batches_on)


# --- files -------------------------------------------------------------------------------------


@router.post("/files", response_model=FileOut, dependencies=[BatchesOn])
async def upload_file(request: Request, tenant: Tenant) -> FileOut:
    """Upload a JSONL batch input (multipart: ``file``, ``purpose=batch``, optionally
    ``expires_after[anchor]`` and ``expires_after[seconds]``), streamed to the file store as it
    arrives and checked on the way (docs/files.md)."""
    settings = get_settings()
    form = uploads.Upload(request)
    counter = files.Counter(settings)
    file_id = new_id("file")
    checked: dict[str, Any] = {}  # the form's fields, once parts() has checked them

    async def parts() -> AsyncIterator[bytes]:
        early = False
        async for data in form.file_bytes():
            if not early and "purpose" in form.fields:  # sent before the file: check it now
                files.check_purpose(form.fields["purpose"])
                early = True
            counter.feed(data)
            yield data
        if not form.saw_file:
            raise DomainError(Kind.INVALID, "missing_file", "file is required", param="file")
        counter.finish()
        checked["purpose"] = files.check_purpose(form.fields.get("purpose"))
        checked["filename"] = files.check_filename(form.filename)
        checked["expires_s"] = files.expires_in(form.fields, settings)

    # An error in parts() aborts the upload: no object, no parts, no row.
    await store.put(file_id, parts())
    row = await run_in_threadpool(
        files.add_upload,
        tenant,
        file_id,
        checked["filename"],
        checked["purpose"],
        counter.bytes,
        checked["expires_s"],
    )
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
    current = store.describe(get_settings())
    return Page[FileOut].of([FileOut.from_row(r, current) for r in rows], has_more)


@router.get("/files/{file_id}", response_model=FileOut)
def get_file(file_id: str, tenant: Tenant, session: SessionDep) -> FileOut:
    return FileOut.from_row(files.get(session, tenant, file_id))


@router.get("/files/{file_id}/content", response_class=StreamingResponse)
async def file_content(
    file_id: str,
    tenant: Tenant,
    byte_range: Annotated[str | None, Header(alias="range")] = None,
) -> Response:
    """The file's bytes, streamed from the store; one ``Range`` of bytes gives a 206; 409
    ``file_in_other_store`` when they are in a store other than the current one."""
    row = await run_in_threadpool(files.find, tenant, file_id)
    return await downloads.response(row.id, row.bytes, row.filename, byte_range)


@router.delete("/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, tenant: Tenant, session: SessionDep) -> FileDeleted:
    return FileDeleted(id=files.delete(session, tenant, file_id).id)


# --- batches -----------------------------------------------------------------------------------


@router.post("/batches", response_model=BatchOut, dependencies=[BatchesOn])
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
