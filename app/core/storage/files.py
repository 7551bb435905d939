"""Files (OpenAI's Files API): uploaded batch inputs and the outputs batches produce.

The row says what a file is; its bytes are an object in the store (app/core/storage/store.py).
An upload is stored first and its row committed after, so a row always has its bytes; a row
that cannot be committed removes the object again. While an upload streams in, ``Counter``
checks it against OpenAI's limits for a batch input (its bytes, its lines, each line's
length), so a file that breaks one is refused before it is stored, not when a batch reads it.
Every file has an ``expires_at`` (OpenAI's ``expires_after``, else
``INFERQ_FILES_EXPIRES_S``); the ops worker deletes expired files, row and object
(:func:`delete_expired`). Users upload ``purpose=batch``; batches write ``batch_output`` files.

Each row records the store that holds its bytes (``store``: :func:`store.describe`). After
``INFERQ_FILES_URL`` is switched, a file stored before is still listed, marked, and its
content, its deletion and its expiry wait for its own store (:func:`elsewhere`, 409
``file_in_other_store``; docs/files.md, "Switching stores"), rather than answering that its
bytes are gone or deleting a row whose object this process cannot reach.
"""

from __future__ import annotations

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from app.core import queries
from app.core.db import session_scope
from app.core.errors import DomainError, Kind
from app.core.models import File, now, valid_text
from app.core.settings import Settings, get_settings
from app.core.storage import store

UPLOAD_PURPOSES = ("batch",)
OUTPUT_PURPOSE = "batch_output"
# OpenAI's bounds of expires_after.seconds (api-reference/files/create).
EXPIRES_MIN_S, EXPIRES_MAX_S = 3600, 30 * 24 * 3600


def check_purpose(purpose: str | None) -> str:
    if purpose is None:
        raise DomainError(Kind.INVALID, "missing_purpose", "purpose is required", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise DomainError(
            Kind.INVALID,
            "invalid_purpose",
            f"purpose must be one of {', '.join(UPLOAD_PURPOSES)} (got {purpose!r})",
            param="purpose",
        )
    return purpose


def check_filename(filename: str | None) -> str:
    if filename is not None and not valid_text(filename):
        raise DomainError(
            Kind.INVALID, "invalid_filename", "the file name is not valid text", param="file"
        )
    return filename or "upload.jsonl"


def expires_in(fields: dict[str, str], settings: Settings) -> int:
    """Seconds from creation to expiry: OpenAI's ``expires_after[anchor]`` (``created_at``)
    and ``expires_after[seconds]`` (3,600 to 2,592,000), else the default."""
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return settings.files_expires_s
    if anchor != "created_at":
        raise DomainError(
            Kind.INVALID,
            "invalid_expires_after",
            "expires_after.anchor must be 'created_at'",
            param="expires_after.anchor",
        )
    if (
        seconds is None
        or not seconds.isdigit()
        or not (EXPIRES_MIN_S <= int(seconds) <= EXPIRES_MAX_S)
    ):
        raise DomainError(
            Kind.INVALID,
            "invalid_expires_after",
            f"expires_after.seconds must be an integer from {EXPIRES_MIN_S} to {EXPIRES_MAX_S}",
            param="expires_after.seconds",
        )
    return int(seconds)


class Counter:
    """A batch input's bytes and lines, counted as they stream past, against OpenAI's limits:
    ``files_max_bytes`` in all, ``batch_max_lines`` non-blank lines, each at most
    ``max_body_bytes`` (what one request may be). Its JSON is checked by the batch, which
    reports every bad line at once (docs/openai.md)."""

    def __init__(self, settings: Settings) -> None:
        self.bytes = 0
        self.lines = 0
        self._max_bytes = settings.files_max_bytes
        self._max_lines = settings.batch_max_lines
        self._max_line = settings.max_body_bytes
        self._line = 0  # bytes of the line not ended yet
        self._filled = False  # whether it holds more than whitespace

    def feed(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.bytes > self._max_bytes:
            raise DomainError(
                Kind.TOO_LARGE,
                "file_too_large",
                f"the file is larger than {self._max_bytes} bytes",
                param="file",
            )
        pieces = data.split(b"\n")
        for i, piece in enumerate(pieces):
            self._line += len(piece)
            if not self._filled and piece.strip():
                self._filled = True
            if self._line > self._max_line:
                raise DomainError(
                    Kind.INVALID,
                    "line_too_long",
                    f"line {self.lines + 1} is longer than {self._max_line} bytes",
                    param="file",
                )
            if i < len(pieces) - 1:
                self._end_line()

    def finish(self) -> None:
        self._end_line()
        if self.lines == 0:
            raise DomainError(Kind.INVALID, "empty_file", "the file has no lines", param="file")

    def _end_line(self) -> None:
        if self._filled:
            self.lines += 1
            if self.lines > self._max_lines:
                raise DomainError(
                    Kind.INVALID,
                    "too_many_lines",
                    f"a batch input holds at most {self._max_lines} lines",
                    param="file",
                )
        self._line = 0
        self._filled = False


def add_upload(
    tenant: str, file_id: str, filename: str, purpose: str, size: int, expires_s: int
) -> File:
    """The row of an upload whose object is stored, committed; if it cannot be, the object
    is deleted again."""
    with session_scope() as session:
        try:
            row = _row(session, tenant, file_id, filename, purpose, size, expires_s)
            session.commit()
        except BaseException:
            session.rollback()
            store.delete(file_id)
            raise
        session.expunge(row)
    return row


def add_output(session: Session, tenant: str, file_id: str, filename: str, size: int) -> File:
    """The row of a file a batch has written (``store.writer``: ``size`` is what it wrote), in
    the caller's transaction. (Asking the store for the size here sent a HEAD request, on S3
    with its retries, while the batch's row was locked.)"""
    expires_s = get_settings().files_expires_s
    return _row(session, tenant, file_id, filename, OUTPUT_PURPOSE, size, expires_s)


def _row(
    session: Session,
    tenant: str,
    file_id: str,
    filename: str,
    purpose: str,
    size: int,
    expires_s: int,
) -> File:
    created = now()
    row = File(
        id=file_id,
        tenant=tenant,
        purpose=purpose,
        filename=filename[:255] or file_id,
        bytes=size,
        created_at=created,
        expires_at=created + expires_s,
        store=store.describe(get_settings()),
    )
    session.add(row)
    return row


def get(session: Session, tenant: str | None, file_id: str) -> File:
    return queries.owned(session, File, tenant, file_id, "file")


def elsewhere(row: File, current: str | None = None) -> str | None:
    """The store that holds the file's bytes when it is not this process's (``current``,
    else the settings'): INFERQ_FILES_URL was switched since the file was stored. None when
    its bytes are here, or when the row predates the record (migration 0012)."""
    if row.store is None:
        return None
    here = current if current is not None else store.describe(get_settings())
    return None if row.store == here else row.store


def here(row: File, doing: str, param: str = "file_id") -> None:
    """Refuse ``doing`` to a file whose bytes are in another store: its object cannot be
    reached from here, and the row must not claim otherwise (404 "bytes are gone") nor go
    while its object stays behind."""
    other = elsewhere(row)
    if other is not None:
        raise DomainError(
            Kind.CONFLICT,
            "file_in_other_store",
            f"cannot {doing} file {row.id}: its bytes are in the file store {other}, not in "
            f"the current one ({store.describe(get_settings())}); INFERQ_FILES_URL was changed "
            'since it was stored (docs/files.md, "Switching stores")',
            param=param,
        )


def find(tenant: str | None, file_id: str) -> File:
    """The row of a file whose content is asked for, in a session of its own (for an async
    caller's thread); 409 ``file_in_other_store`` when its bytes are in another store."""
    with session_scope() as session:
        row = get(session, tenant, file_id)
        session.expunge(row)
    here(row, "read")
    return row


def list_page(
    session: Session, tenant: str, *, purpose: str | None, limit: int, after: str | None
) -> tuple[list[File], bool]:
    """Newest first; ``after`` is the last id of the previous page."""
    query = queries.scoped(session, select(File), File.tenant, tenant)
    if purpose is not None:
        query = query.where(File.purpose == purpose)
    return queries.page(session, query, File.id, limit, after)


def delete(session: Session, tenant: str, file_id: str) -> File:
    """Remove the row, then the object (a batch that already read its input is unaffected).
    A store that is down leaves the row, and says so (503); so does a file whose bytes are in
    another store (409)."""
    row = get(session, tenant, file_id)
    here(row, "delete")
    store.delete(file_id)
    session.delete(row)
    session.commit()
    return row


def delete_expired(limit: int = 500) -> int:
    """Delete up to ``limit`` files whose ``expires_at`` has passed, object first, then row
    (a crash between leaves a row whose object is gone, deleted again next time). Files whose
    bytes are in another store wait for a process of that store: deleting their rows here
    would leave their objects there with nothing to find them by."""
    stamp = now()
    here = store.describe(get_settings())
    with session_scope() as session:
        ids = list(
            session.scalars(
                select(File.id)
                .where(File.expires_at.is_not(None), File.expires_at <= stamp)
                .where(or_(File.store.is_(None), File.store == here))
                .order_by(File.expires_at)
                .limit(limit)
            )
        )
    for file_id in ids:
        store.delete(file_id)
        with session_scope() as session:
            row = session.get(File, file_id)
            if row is not None:
                session.delete(row)
                session.commit()
    return len(ids)
