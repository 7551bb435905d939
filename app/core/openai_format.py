"""The OpenAI wire format: request bodies in, job bodies out, and job rows back to responses.

One translation serves the realtime endpoints (``/v1/chat/completions``, ``/v1/completions``)
and batch lines, so a line is valid in a batch exactly when the same body would be accepted by
the endpoint. Bounds are the jobs API's own (``JobCreate``); an OpenAI parameter inferq does not
implement is refused by name (422), never silently ignored. inferq's additions: ``lane``
(default realtime), ``metadata`` and ``timeout_s``, as on jobs.

A completion's ``id`` is its job's id, so ``GET /v1/jobs/<id>`` finds every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import Field, ValidationError, field_validator

from app.core.errors import DomainError, Kind, param_path
from app.core.models import Job, JobStatus, Lane
from app.core.schemas import ChatMessage, JobCreate, StrictModel

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
# OpenAI's default for the legacy completions endpoint (vLLM's too); chat has none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Errors that are the request's fault: OpenAI answers them as an invalid request (400), on the
# realtime endpoints and in batch output lines alike.
REQUEST_ERRORS = frozenset({"context_length_exceeded", "invalid_request"})


class StreamOptions(StrictModel):
    include_usage: bool = False


class _Request(StrictModel):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)  # accepted for compatibility, not stored
    metadata: dict[str, str] = Field(default_factory=dict)
    lane: Lane = Lane.REALTIME
    timeout_s: float | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    def _params(self, max_tokens: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {"max_tokens": max_tokens, "stop": self.stop, "seed": self.seed}
        if self.temperature is not None:
            params["temperature"] = self.temperature
        if self.top_p is not None:
            params["top_p"] = self.top_p
        return params

    def _job(self, fields: dict[str, Any]) -> JobCreate:
        """The job body, with the jobs API's bounds; errors name the OpenAI parameter."""
        try:
            return JobCreate.model_validate(
                {
                    "lane": self.lane,
                    "model": self.model,
                    "metadata": self.metadata,
                    "timeout_s": self.timeout_s,
                    **fields,
                }
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            param = param_path(("body", *first["loc"]))
            if param is not None:
                param = param.removeprefix("params.")
            message = str(first["msg"]).removeprefix("Value error, ")
            raise DomainError(
                Kind.INVALID,
                str(first["type"]),
                f"{param}: {message}" if param else message,
                param=param,
            ) from None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    def job(self) -> JobCreate:
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._job({"messages": self.messages, "params": self._params(max_tokens)})


class CompletionRequest(_Request):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request (send a batch for many)")
            return value[0]
        return value

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported")
        return value

    def job(self) -> JobCreate:
        max_tokens = self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        return self._job({"prompt": self.prompt, "params": self._params(max_tokens)})


REQUEST_TYPES: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    CHAT: ChatCompletionRequest,
    COMPLETIONS: CompletionRequest,
}


class JobView(Protocol):
    """What a response is made of: a job's row, or a call's committed outcome (``Ended``)."""

    @property
    def id(self) -> str: ...
    @property
    def created_at(self) -> float: ...
    @property
    def model(self) -> str: ...
    @property
    def messages(self) -> list[dict[str, Any]] | None: ...
    @property
    def status(self) -> str: ...
    @property
    def result_text(self) -> str | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int | None: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def error_code(self) -> str | None: ...
    @property
    def error_message(self) -> str | None: ...


@dataclass(frozen=True)
class Ended:
    """A call's job as its worker committed it, from the relay's end message: the columns
    ``transitions.Outcome.row`` wrote, joined to the job as it was submitted."""

    id: str
    created_at: float
    model: str
    messages: list[dict[str, Any]] | None
    status: str
    result_text: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error_code: str | None
    error_message: str | None

    @classmethod
    def of(cls, job: Job, row: dict[str, Any]) -> Ended:
        return cls(
            id=job.id,
            created_at=job.created_at,
            model=job.model,
            messages=job.messages,
            status=row["status"],
            result_text=row.get("result_text"),
            finish_reason=row.get("finish_reason"),
            prompt_tokens=row.get("prompt_tokens"),
            completion_tokens=row.get("completion_tokens"),
            error_code=row.get("error_code"),
            error_message=row.get("error_message"),
        )


def endpoint_of(job: JobView) -> str:
    return CHAT if job.messages is not None else COMPLETIONS


def usage(job: JobView) -> dict[str, int]:
    prompt = job.prompt_tokens or 0
    completion = job.completion_tokens or 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def response_body(job: JobView) -> dict[str, Any]:
    """The OpenAI response of a succeeded job (``chat.completion`` or ``text_completion``)."""
    text = job.result_text or ""
    if endpoint_of(job) == CHAT:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": job.finish_reason,
        }
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason}
        kind = "text_completion"
    return {
        "id": job.id,
        "object": kind,
        "created": int(job.created_at),
        "model": job.model,
        "choices": [choice],
        "usage": usage(job),
    }


def chunk(
    job: JobView,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    with_usage: bool = False,
) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``).

    With ``with_usage`` it is the final usage chunk OpenAI sends for
    ``stream_options.include_usage``: no choices, the job's usage.
    """
    chat = endpoint_of(job) == CHAT
    body: dict[str, Any] = {
        "id": job.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(job.created_at),
        "model": job.model,
    }
    if with_usage:
        body["choices"] = []
        body["usage"] = usage(job)
        return body
    if chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    body["choices"] = [choice]
    return body


def job_error(job: JobView) -> DomainError:
    """The error a call answers for its job that ended without succeeding."""
    code = job.error_code or str(job.status)
    message = job.error_message or f"the job ended {job.status}"
    if job.status == JobStatus.FAILED:
        kind = Kind.MALFORMED if code in REQUEST_ERRORS else Kind.FAILED
    elif job.status == JobStatus.EXPIRED:
        kind = Kind.TIMED_OUT
    else:  # cancelled (POST /v1/jobs/{id}/cancel, or its batch was cancelled)
        kind, code, message = Kind.CONFLICT, "job_cancelled", "the job was cancelled"
    return DomainError(kind, code, f"{message} (job {job.id})")
