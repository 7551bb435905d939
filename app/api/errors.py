"""The one map from failures to HTTP answers: status code, error envelope and headers.

Every error leaves the API as ``{"error": {"type", "code", "message", "param"}}``. The core
raises :class:`~app.core.errors.DomainError` of a kind; this module says which status each kind
is (README, "HTTP API (v1)", status codes). The API's exception handlers
(``app/api/handlers.py``) answer with it, and batch output lines record it too (OpenAI's format
gives each line the HTTP answer its request would have had), so this module imports nothing of
FastAPI.
"""

from __future__ import annotations

from typing import Any

from app.core.errors import DomainError, Kind

STATUS: dict[Kind, int] = {
    Kind.MALFORMED: 400,
    Kind.UNAUTHENTICATED: 401,
    Kind.NOT_FOUND: 404,
    Kind.CONFLICT: 409,
    Kind.TOO_LARGE: 413,
    Kind.INVALID: 422,
    Kind.OVER_LIMIT: 429,
    Kind.UNAVAILABLE: 503,
    Kind.FAILED: 500,
    Kind.TIMED_OUT: 504,
}

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


def status_of(error: DomainError) -> int:
    return STATUS[error.kind]


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
