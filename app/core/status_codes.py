"""The one map from a domain error's kind to the HTTP status of the public contract.

Two places answer in HTTP's terms: the API (app/api/errors.py builds the error envelope and
headers around this status) and batch output lines, which OpenAI's format gives the status
their request would have had (app/batches/finalize.py, written by the ops worker). The map is
here, below both, so the batches never import the API; the rest of the core raises
:class:`~app.core.errors.DomainError` of a kind and never names a status (docs/architecture.md,
"Errors").
"""

from __future__ import annotations

from app.core.errors import DomainError, Kind

STATUS: dict[Kind, int] = {
    Kind.MALFORMED: 400,
    Kind.UNAUTHENTICATED: 401,
    Kind.FORBIDDEN: 403,
    Kind.NOT_FOUND: 404,
    Kind.CONFLICT: 409,
    Kind.TOO_LARGE: 413,
    Kind.INVALID: 422,
    Kind.OVER_LIMIT: 429,
    Kind.UNAVAILABLE: 503,
    Kind.FAILED: 500,
    Kind.TIMED_OUT: 504,
}


def status_of(error: DomainError) -> int:
    return STATUS[error.kind]
