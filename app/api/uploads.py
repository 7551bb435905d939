"""A multipart upload read as it arrives: the file part's bytes go on as they come, the other
fields are kept (small), and nothing is spooled.

Starlette's ``UploadFile`` reads the whole body before the route runs and spools a part over
1 MiB to a temporary file; ``POST /v1/files`` instead parses ``request.stream()`` with
python-multipart's push parser (the one Starlette uses) and hands the file's bytes to the store
in parts (docs/files.md, "Uploads").
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from app.core.errors import DomainError, Kind

FILE_FIELD = "file"
FIELD_MAX_BYTES = 4096  # a form field other than the file (purpose, expires_after[...])
FLUSH_BYTES = 1 << 20  # file bytes handed on at a time


def _malformed(message: str, param: str | None = None) -> DomainError:
    return DomainError(Kind.MALFORMED, "invalid_multipart", message, param=param)


class Upload:
    """The form of one multipart request: ``fields`` (name -> text) and ``filename``, filled
    in as :meth:`file_bytes` reads the body."""

    def __init__(self, request: Request) -> None:
        kind, params = parse_options_header(request.headers.get("content-type", ""))
        boundary = params.get(b"boundary")
        if kind != b"multipart/form-data" or not boundary:
            raise _malformed("the upload must be multipart/form-data with a boundary")
        self.request = request
        self.fields: dict[str, str] = {}
        self.filename: str | None = None
        self.saw_file = False
        self._name: str | None = None
        self._header = b""
        self._value = b""
        self._headers: dict[bytes, bytes] = {}
        self._field = bytearray()
        self._out = bytearray()
        callbacks: Any = {
            "on_part_begin": self._part_begin,
            "on_header_field": self._header_field,
            "on_header_value": self._header_value,
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._part_data,
            "on_part_end": self._part_end,
        }
        self._parser = MultipartParser(boundary, callbacks)

    async def file_bytes(self) -> AsyncIterator[bytes]:
        """The file part's bytes as the body arrives; the other fields land in ``fields``."""
        try:
            async for chunk in self.request.stream():
                self._parser.write(chunk)
                if len(self._out) >= FLUSH_BYTES:
                    yield bytes(self._out)
                    self._out.clear()
            self._parser.finalize()
        except ClientDisconnect:
            raise _malformed("the client went away before the upload ended") from None
        except DomainError:
            raise
        except Exception as exc:  # python-multipart's errors: a broken body
            raise _malformed(f"the multipart body is malformed: {exc}") from None
        if self._out:
            yield bytes(self._out)
            self._out.clear()

    # --- the parser's callbacks ----------------------------------------------------------------

    def _part_begin(self) -> None:
        self._headers = {}
        self._name = None

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header = self._value = b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = params.get(b"name")
        self._name = name.decode("utf-8", "replace") if name is not None else None
        if self._name == FILE_FIELD:
            if self.saw_file:
                raise _malformed("the upload holds more than one file", FILE_FIELD)
            self.saw_file = True
            filename = params.get(b"filename")
            self.filename = filename.decode("utf-8", "replace") if filename else None
        self._field.clear()

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name == FILE_FIELD:
            self._out += data[start:end]
            return
        self._field += data[start:end]
        if len(self._field) > FIELD_MAX_BYTES:
            raise _malformed(f"the field {self._name!r} is too long", self._name)

    def _part_end(self) -> None:
        if self._name is not None and self._name != FILE_FIELD:
            self.fields[self._name] = self._field.decode("utf-8", "replace")
