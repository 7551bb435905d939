"""The error envelope and the one map from failures to HTTP status codes.

Every error leaves the API as ``{"error": {"type", "code", "message", "param"}}``. Routes and
services raise :class:`ApiError`; request validation, unknown routes and dependency failures are
translated here, so no route builds an error response by hand.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("inferq.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class ApiError(Exception):
    """An error with its HTTP status, machine-readable code and the offending parameter."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.headers = headers or {}


def error_body(status: int, code: str | None, message: str, param: str | None) -> dict[str, Any]:
    return {
        "error": {
            "type": _TYPES.get(status, "api_error"),
            "code": code,
            "message": message,
            "param": param,
        }
    }


def _respond(
    status: int,
    code: str | None,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, code, message, param), status, headers=headers)


def param_path(loc: Sequence[int | str]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    parts = list(loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc)
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or "(" in part or part in ("str", "int", "float"):
            # pydantic names union branches ("str", "list[TextPart]") in locations.
            continue
        else:
            out += f".{part}" if out else str(part)
    return out or None


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    if first.get("type") in ("json_invalid", "json_type"):
        return _respond(400, "invalid_json", f"request body is not valid JSON: {first['msg']}")
    param = param_path(first.get("loc", ()))
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if param:
        message = f"{param}: {message}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return _respond(422, str(first.get("type", "invalid_value")), message, param)


async def _api_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return _respond(exc.status, exc.code, exc.message, exc.param, exc.headers)


async def _http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
    return _respond(
        exc.status_code,
        codes.get(exc.status_code, "http_error"),
        str(exc.detail),
        headers=dict(exc.headers or {}),
    )


async def _database_down(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", exc)
    return _respond(
        503,
        "database_unavailable",
        "the database is unavailable; retry later",
        None,
        {"Retry-After": "5"},
    )


async def _internal(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return _respond(500, "internal_error", "internal server error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(InterfaceError, _database_down)
    app.add_exception_handler(Exception, _internal)
