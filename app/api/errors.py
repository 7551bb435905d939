"""The API's answer to a failure: status code, error envelope and headers.

Every error leaves the API as ``{"error": {"type", "code", "message", "param"}}``. The core
raises :class:`~app.core.errors.DomainError` of a kind; the status of each kind is
app/core/status_codes.py's (docs/api.md, "HTTP API (v1)", status codes), which batch output lines
use too. The API's exception handlers (``app/api/handlers.py``) answer with this module, which
imports nothing of FastAPI.
"""

from __future__ import annotations

from typing import Any

from app.core.errors import DomainError, Kind
from app.core.status_codes import status_of

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


def headers_of(error: DomainError) -> dict[str, str]:
    headers: dict[str, str] = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(error.retry_after_s)
    if error.limit is not None:
        headers["inferq-limit"] = error.limit
    if error.kind == Kind.UNAUTHENTICATED:
        headers["WWW-Authenticate"] = "Bearer"
    return headers


def error_body(status: int, code: str | None, message: str, param: str | None) -> dict[str, Any]:
    return {
        "error": {
            "type": _TYPES.get(status, "api_error"),
            "code": code,
            "message": message,
            "param": param,
        }
    }


def body_of(error: DomainError) -> dict[str, Any]:
    return error_body(status_of(error), error.code, error.message, error.param)
