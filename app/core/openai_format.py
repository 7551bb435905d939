"""The OpenAI wire format: request bodies in, job bodies out, and job rows back to responses.

One translation serves the realtime endpoints (``/v1/chat/completions``, ``/v1/completions``)
and batch lines, so a line is valid in a batch exactly when the same body would be accepted by
the endpoint. The sampling options are the jobs API's own model (``JobParams``, vLLM's names and
bounds). Every other field of vLLM's two request classes is in ``CHAT_REFUSED`` or
``COMPLETION_REFUSED`` with the reason:
at vLLM's default (or null) it asks for nothing and is accepted, any other value is a 422 that
names it; a field vLLM does not know is a 422 too, never silently ignored (README, "vLLM's
fields"). inferq's additions: ``lane`` (default realtime), ``metadata`` and ``timeout_s``, as on
jobs.

A completion's ``id`` is its job's id, so ``GET /v1/jobs/<id>`` finds every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.core.errors import DomainError, Kind, pydantic_error
from app.core.models import Job, JobStatus, Lane
from app.core.schemas import (
    CONSTRAINTS,
    ChatMessage,
    JobCreate,
    JobParams,
    StrictModel,
    check_json_schema,
)

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


# Why inferq does not take a field of vLLM's request classes, grouped by reason. Each field is
# listed with vLLM's default for it: that value (or null) asks for nothing and is accepted.
_NOT_YET = "not supported yet"
_MULTIMODAL = "inferq serves text: multimodal inputs are not accepted"
_TEMPLATE = "the worker applies the model's own chat template, unchanged"
_TOKENIZING = "the engine tokenizes with the model's defaults"
_TRANSFER = "disaggregated serving (KV or encoder-cache transfer) is not part of inferq"
_BEAM = "beam search is not offered: a job samples its sequences"
_COMMON_REFUSED: dict[str, tuple[Any, str]] = {
    "logprobs": (None, _NOT_YET),
    "prompt_logprobs": (None, _NOT_YET),
    "logprob_token_ids": (None, _NOT_YET),
    "return_tokens_as_token_ids": (None, _NOT_YET),
    "return_token_ids": (None, _NOT_YET),
    "return_token_offsets": (False, _NOT_YET),
    "echo": (False, _NOT_YET),
    "allowed_token_ids": (None, _NOT_YET),
    "bad_words": ([], _NOT_YET),
    "use_beam_search": (False, _BEAM),
    "length_penalty": (1.0, _BEAM),
    "watermarking": (None, "output watermarking is not offered"),
    "repetition_detection": (None, "not offered: min_tokens, max_tokens and stop bound output"),
    "thinking_token_budget": (None, "reasoning models' options are not offered"),
    "truncate_prompt_tokens": (
        None,
        "prompts are never cut: one longer than the context fails as context_length_exceeded",
    ),
    "truncation_side": (None, "prompts are never cut"),
    "priority": (0, "the lane decides the priority (`lane`: realtime, standard or bulk)"),
    "request_id": (None, "the job's id is the request's id (the `inferq-job-id` header)"),
    "session_id": (None, "not offered"),
    "routed_experts_prompt_start": (0, "a debugging option of mixture-of-experts models"),
    "mm_payload": ("tensors", _MULTIMODAL),
    "return_mm_kwargs": (None, _MULTIMODAL),
    "cache_salt": (None, "the prefix cache is shared by every tenant of a deployment"),
    "kv_transfer_params": (None, _TRANSFER),
    "ec_transfer_params": (None, _TRANSFER),
    "vllm_xargs": (None, "free-form engine arguments would bypass the request's validation"),
    "stream_interval": (None, "the relay decides how streamed pieces are merged"),
}
COMPLETION_REFUSED: dict[str, tuple[Any, str]] = {
    **_COMMON_REFUSED,
    "suffix": (None, "vLLM's server does not support it either"),
    "prompt_embeds": (None, "a job's input is text, stored in its row and re-run from it"),
    "add_special_tokens": (True, _TOKENIZING),
}
CHAT_REFUSED: dict[str, tuple[Any, str]] = {
    **_COMMON_REFUSED,
    "logprobs": (False, _NOT_YET),
    "top_logprobs": (0, _NOT_YET),
    "tools": (None, _NOT_YET),
    "tool_choice": ("none", _NOT_YET),
    "parallel_tool_calls": (True, _NOT_YET),
    "reasoning_effort": (None, "reasoning models' options are not offered"),
    "include_reasoning": (True, "reasoning models' options are not offered"),
    "add_generation_prompt": (True, _TEMPLATE),
    "continue_final_message": (False, _TEMPLATE),
    "documents": (None, _TEMPLATE),
    "chat_template": (None, _TEMPLATE),
    "chat_template_kwargs": (None, _TEMPLATE),
    "media_io_kwargs": (None, _MULTIMODAL),
    "mm_processor_kwargs": (None, _MULTIMODAL),
    "return_prompt_text": (None, "not offered: a job's prompt is in its row"),
    "add_special_tokens": (False, _TOKENIZING),
}


class JsonSchemaFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _compiles(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_json_schema(value)
        return value


class ResponseFormat(StrictModel):
    """OpenAI's ``response_format``: held as vLLM holds it, by ``structured_outputs``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_when_asked(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError(
                "missing", "type json_schema needs json_schema", {"fields": "json_schema"}
            )
        return self

    def constraint(self) -> dict[str, Any]:
        """What it sets in ``structured_outputs`` (vLLM's rule: it overrides the constraint)."""
        if self.type == "json_object":
            return {"json_object": True}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return {"json": self.json_schema.schema_}
        return {}


def _refused(data: Any, refused: dict[str, tuple[Any, str]]) -> Any:
    """Drop the refused fields that ask for nothing; a 422 naming the first that asks."""
    if not isinstance(data, dict):
        return data
    kept = {}
    for key, value in data.items():
        if key not in refused:
            kept[key] = value
            continue
        default, reason = refused[key]
        if value is not None and value != default:
            raise PydanticCustomError(
                "unsupported_parameter",
                "{field} is not supported: {reason}",
                {"field": key, "reason": reason, "fields": key},
            )
    return kept


_SAMPLING = set(JobParams.model_fields)


class _Request(JobParams):
    """The fields both endpoints share: the sampling options (``JobParams``) and these."""

    # The endpoint's vLLM fields inferq refuses (above), with vLLM's defaults and the reasons.
    refused: ClassVar[dict[str, tuple[Any, str]]] = {}

    model: str = Field(min_length=1, max_length=256)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)  # accepted for compatibility, not stored
    metadata: dict[str, str] = Field(default_factory=dict)
    lane: Lane = Lane.REALTIME
    timeout_s: float | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused_fields(cls, data: Any) -> Any:
        return _refused(data, cls.refused)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported")
        return value

    def _params(self, max_tokens: int | None) -> dict[str, Any]:
        params = self.model_dump(include=_SAMPLING, exclude_defaults=True, by_alias=True)
        constraint = self.response_format.constraint() if self.response_format else {}
        if constraint:
            # As in vLLM: response_format replaces the constraint, keeps the other options.
            kept = params.get("structured_outputs", {})
            params["structured_outputs"] = {
                **{k: v for k, v in kept.items() if k not in CONSTRAINTS},
                **constraint,
            }
        return {**params, "max_tokens": max_tokens}

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
            code, param, message = pydantic_error(exc.errors()[0])
            if param is not None:
                param = param.removeprefix("params.")
            raise DomainError(
                Kind.INVALID, code, f"{param}: {message}" if param else message, param=param
            ) from None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None

    refused = CHAT_REFUSED

    def job(self) -> JobCreate:
        max_tokens = self.max_completion_tokens or self.max_tokens
        return self._job({"messages": self.messages, "params": self._params(max_tokens)})


class CompletionRequest(_Request):
    prompt: str | list[str]

    refused = COMPLETION_REFUSED

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str:
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("exactly one prompt per request (send a batch for many)")
            return value[0]
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
