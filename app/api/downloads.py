"""A file's bytes as an HTTP answer: streamed from the store, one byte range of RFC 9110 when
the client asks (``Range: bytes=a-b``, ``a-``, ``-n``), 416 when it cannot be served.

A Range of several spans, or one that is not of bytes, is ignored and the whole file is sent,
as RFC 9110 §14.2 allows.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from urllib.parse import quote

from starlette.responses import Response, StreamingResponse

from app.core.errors import DomainError, Kind
from app.core.storage import store


class Unsatisfiable(Exception):
    pass


def span(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single byte range, None for the whole file;
    Unsatisfiable when no byte of it is in the file."""
    if header is None or not header.startswith("bytes=") or "," in header:
        return None
    first, dash, last = header.removeprefix("bytes=").strip().partition("-")
    numbers = all(part.isdigit() for part in (first, last) if part)
    if not dash or not numbers or not (first or last):
        return None  # not a byte range: ignored
    if not first:  # the last n bytes
        if int(last) == 0 or size == 0:
            raise Unsatisfiable
        return max(0, size - int(last)), size
    start = int(first)
    end = int(last) + 1 if last else size
    if start >= size:
        raise Unsatisfiable
    if end <= start:
        return None  # last before first: invalid, ignored
    return start, min(end, size)


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""


async def response(file_id: str, size: int, filename: str, header: str | None) -> Response:
    try:
        taken = span(header, size)
    except Unsatisfiable:
        return Response(status_code=416, headers={"Content-Range": f"bytes */{size}"})
    start, end = taken or (0, size)
    quoted = quote(filename)
    disposition = (
        f"attachment; filename*=utf-8''{quoted}"
        if quoted != filename
        else f'attachment; filename="{filename}"'
    )
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Length": str(end - start),
        "Content-Disposition": disposition,
    }
    if taken is not None:
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
    body: AsyncIterator[bytes] | AsyncIterator[memoryview]
    if end > start:
        try:
            body = await store.open_stream(file_id, start, end)
        except FileNotFoundError:
            raise DomainError(
                Kind.NOT_FOUND,
                "file_not_found",
                f"file {file_id}'s bytes are gone",
                param="file_id",
            ) from None
    else:
        body = _empty()
    return StreamingResponse(
        body,
        status_code=206 if taken is not None else 200,
        media_type="application/octet-stream",
        headers=headers,
    )
