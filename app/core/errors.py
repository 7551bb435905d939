"""Domain errors: what went wrong, said in the core's words, for every process.

The core, the batches and the workers raise a :class:`DomainError` of one :class:`Kind` with a
machine-readable ``code``, a message for a person and the offending ``param``. They never name
an HTTP status: a kind becomes its status code in one place (``app/core/status_codes.py``), for
the API's answers and for batch output lines, which record the answer each request would have
had. The kinds follow the public contract's status codes (docs/api.md, "HTTP API (v1)"; the map:
docs/architecture.md, "Errors").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any


class Kind(StrEnum):
    MALFORMED = "malformed"  # the request cannot be run as sent (OpenAI's invalid request)
    UNAUTHENTICATED = "unauthenticated"  # no key, or a key that is unknown or revoked
    FORBIDDEN = "forbidden"  # a console action without its session's CSRF token
    NOT_FOUND = "not_found"  # no such resource for this tenant
    CONFLICT = "conflict"  # the resource's state does not allow it now
    TOO_LARGE = "too_large"  # a body or file over its size limit
    INVALID = "invalid"  # a field breaks a rule or a bound
    OVER_LIMIT = "over_limit"  # the tenant's limits are used up (retry after)
    UNAVAILABLE = "unavailable"  # a dependency is down or a lane is full (retry after)
    FAILED = "failed"  # the job failed in the engine, not through the request's fault
    TIMED_OUT = "timed_out"  # the job's deadline passed


class DomainError(Exception):
    """A failure the caller is told about: kind, code, message and the parameter at fault.

    ``retry_after_s`` says when trying again may succeed (limits, dependencies down);
    ``limit`` names the tenant limit that refused the call.
    """

    def __init__(
        self,
        kind: Kind,
        code: str,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        limit: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.limit = limit

    def within(self, prefix: str) -> DomainError:
        """The same error about a field inside ``prefix`` (``jobs[3]`` + ``prompt``)."""
        return self.replace(param=f"{prefix}.{self.param}" if self.param else prefix)

    def replace(self, *, kind: Kind | None = None, param: str | None = None) -> DomainError:
        return DomainError(
            kind or self.kind,
            self.code,
            self.message,
            param=param if param is not None else self.param,
            retry_after_s=self.retry_after_s,
            limit=self.limit,
        )


def unavailable(code: str, message: str, param: str | None = None) -> DomainError:
    """A dependency is down: the caller retries in a few seconds."""
    return DomainError(Kind.UNAVAILABLE, code, message, param=param, retry_after_s=5)


BROKER_DOWN = ("broker_unavailable", "the queue (Redis) is unavailable; retry later")


def pydantic_error(error: Mapping[str, Any]) -> tuple[str, str | None, str]:
    """One pydantic error as (code, param, message). The param is its location, and an error
    about a choice between fields (``ctx["fields"]``: "prompt|messages", or the field a model
    rule names) adds them."""
    param = param_path(error.get("loc", ()))
    context = error.get("ctx")
    fields = context.get("fields") if isinstance(context, dict) else None
    if fields:
        param = f"{param}.{fields}" if param else str(fields)
    message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
    return str(error.get("type", "invalid_value")), param, message


def named(param: str | None, message: str) -> str:
    """``message`` about ``param`` as a reply says it: "top_k: must be ..." once, not
    "top_k: top_k must be ...": a message that starts with the field's name gets the full
    path in its place."""
    if not param:
        return message
    last = param.rsplit(".", 1)[-1].split("[", 1)[0]
    if message.startswith(last + " "):
        return param + message[len(last) :]
    return f"{param}: {message}"


def param_path(loc: Sequence[int | str]) -> str | None:
    """A validation error's location as a parameter: ("body", "messages", 0, "content") ->
    "messages[0].content"."""
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
