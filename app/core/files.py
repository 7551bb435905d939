"""Files (OpenAI's Files API): uploaded batch inputs and the outputs batches produce.

The row says what a file is; its bytes are in app/core/storage.py. An upload is stored first and its
row committed after, so a row always has its bytes; a row that cannot be committed removes the
bytes again. Users upload ``purpose=batch``; batches write ``batch_output`` files.
"""

from __future__ import annotations

from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core import queries, storage
from app.core.errors import DomainError, Kind
from app.core.models import File, new_id, now
from app.core.schemas import storable
from app.core.settings import get_settings

UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"


def upload(session: Session, tenant: str, source: BinaryIO, filename: str, purpose: str) -> File:
    if purpose not in UPLOAD_PURPOSES:
        raise DomainError(
            Kind.INVALID,
            "invalid_purpose",
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} (got {purpose!r})",
            param="purpose",
        )
    if not storable(filename):
        raise DomainError(
            Kind.INVALID, "invalid_filename", "the file name is not valid text", param="file"
        )
    file_id = new_id("file")
    limit = get_settings().files_max_bytes
    try:
        size = storage.save(file_id, source, limit)
    except storage.TooLarge:
        raise DomainError(
            Kind.TOO_LARGE, "file_too_large", f"the file is larger than {limit} bytes", param="file"
        ) from None
    return _commit(session, tenant, file_id, filename, purpose, size)


def add_output(session: Session, tenant: str, file_id: str, filename: str) -> File:
    """The row of a file a batch has written (``storage.writer``), in the caller's transaction."""
    return _row(session, tenant, file_id, filename, OUTPUT_PURPOSE, storage.size(file_id))


def _row(
    session: Session, tenant: str, file_id: str, filename: str, purpose: str, size: int
) -> File:
    row = File(
        id=file_id,
        tenant=tenant,
        purpose=purpose,
        filename=filename[:255] or file_id,
        bytes=size,
        created_at=now(),
    )
    session.add(row)
    return row


def _commit(
    session: Session, tenant: str, file_id: str, filename: str, purpose: str, size: int
) -> File:
    try:
        row = _row(session, tenant, file_id, filename, purpose, size)
        session.commit()
    except BaseException:
        session.rollback()
        storage.delete(file_id)
        raise
    return row


def get(session: Session, tenant: str | None, file_id: str) -> File:
    return queries.owned(session, File, tenant, file_id, "file")


def list_page(
    session: Session, tenant: str, *, purpose: str | None, limit: int, after: str | None
) -> tuple[list[File], bool]:
    """Newest first; ``after`` is the last id of the previous page."""
    query = select(File).where(File.tenant == tenant)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return queries.page(session, query, File.id, limit, after)


def delete(session: Session, tenant: str, file_id: str) -> File:
    """Remove the row, then the bytes (a batch that already read its input is unaffected)."""
    row = get(session, tenant, file_id)
    session.delete(row)
    session.commit()
    storage.delete(file_id)
    return row
