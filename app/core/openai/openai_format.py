"""The OpenAI wire format: request bodies in, job bodies out, and job rows back to responses.

One translation serves the realtime endpoints (``/v1/chat/completions``, ``/v1/completions``)
and batch lines, so a line is valid in a batch exactly when the same body would be accepted by
the endpoint. The sampling options are the jobs API's own model (``JobParams``, vLLM's names and
bounds). Every other field of vLLM's two request classes is in ``CHAT_REFUSED`` or
``COMPLETION_REFUSED`` with the reason:
at vLLM's default (or null) it asks for nothing and is accepted, any other value is a 422 that
names it; a field vLLM does not know is a 422 too, never silently ignored (docs/openai.md,
"vLLM's fields"). inferq's additions: ``lane`` (default realtime), ``metadata`` and
``timeout_s``, as on jobs; and OpenAI's ``service_tier``, which picks the lane
(``TIER_LANES``; docs/openai.md, "Service tiers").

A completion's ``id`` is its job's id, so ``GET /v1/jobs/<id>`` finds every call.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app import __version__
from app.core.contract.base import StrictModel
from app.core.contract.chat import ChatMessage, ToolUse
from app.core.contract.jobs import JobCreate, PromptForm, prompt_bounds
from app.core.contract.params import CONSTRAINTS, MAX_LOGPROBS, JobParams, check_json_schema
from app.core.errors import DomainError, Kind, named, pydantic_error
from app.core.models import JobStatus, Lane, choice

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)
# OpenAI's ``system_fingerprint``, "the backend configuration the model runs with": the
# platform's version (vLLM's server says its own, ``vllm-<version>-<hash>``).
SYSTEM_FINGERPRINT = f"inferq-{__version__}"
# OpenAI's default for the legacy completions endpoint (vLLM's too); chat has none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Errors that are the request's fault: OpenAI answers them as an invalid request (400), on the
# realtime endpoints and in batch output lines alike.
REQUEST_ERRORS = frozenset(
    {"context_length_exceeded", "invalid_request", "invalid_token_ids", "too_many_tokens"}
)

# OpenAI's service tiers as lanes. "auto" and "default" keep the lane (realtime unless the body
# says ``lane``); "priority" is realtime; "flex" is standard: cheaper for the GPUs, it waits
# behind realtime as OpenAI's flex may take longer. OpenAI's "scale" is not offered.
ServiceTier = Literal["auto", "default", "flex", "priority"]
TIER_LANES: dict[str, Lane] = {"priority": Lane.REALTIME, "flex": Lane.STANDARD}


class StreamOptions(StrictModel):
    include_usage: bool = False


# Why inferq does not take a field of vLLM's request classes, grouped by reason. Each field is
# listed with vLLM's default for it: that value (or null) asks for nothing and is accepted.
_MULTIMODAL = "inferq serves text: multimodal inputs are not accepted"
_TEMPLATE = "the worker applies the model's own chat template, unchanged"
_TOKENIZING = "the engine tokenizes with the model's defaults"
_TRANSFER = "disaggregated serving (KV or encoder-cache transfer) is not part of inferq"
_BEAM = "beam search is not offered: a job samples its sequences"
_TEXT_RESULT = "a result is text, with its tokens' logprobs on request; token ids are not returned"
_COMMON_REFUSED: dict[str, tuple[Any, str]] = {
    "logprob_token_ids": (
        None,
        "logprobs name the best alternatives (top_logprobs), not chosen ids",
    ),
    "return_tokens_as_token_ids": (None, _TEXT_RESULT),
    "return_token_ids": (None, _TEXT_RESULT),
    "return_token_offsets": (False, _TEXT_RESULT),
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


def refused_fields(data: Any, refused: dict[str, tuple[Any, str]]) -> Any:
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


class Tiered(StrictModel):
    """What every OpenAI endpoint's body says of where its job runs: inferq's ``lane`` and
    OpenAI's ``service_tier`` (docs/openai.md, "Service tiers"), which must agree; and the
    vLLM fields the endpoint refuses (``refused``: vLLM's defaults and the reasons)."""

    refused: ClassVar[dict[str, tuple[Any, str]]] = {}

    lane: Lane = Lane.REALTIME
    service_tier: ServiceTier | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused_fields(cls, data: Any) -> Any:
        return refused_fields(data, cls.refused)

    @model_validator(mode="after")
    def _tier_agrees_with_lane(self) -> Tiered:
        wanted = TIER_LANES.get(self.service_tier or "")
        if wanted is not None and "lane" in self.model_fields_set and self.lane != wanted:
            raise PydanticCustomError(
                "invalid_value",
                "service_tier {tier} runs in the {wanted} lane, and lane says {lane}: give "
                "one of the two",
                {
                    "tier": self.service_tier,
                    "wanted": str(wanted),
                    "lane": str(self.lane),
                    "fields": "service_tier",
                },
            )
        return self

    @property
    def lane_used(self) -> Lane:
        """The lane the job runs in: the tier's, else ``lane``."""
        return TIER_LANES.get(self.service_tier or "", self.lane)

    @property
    def tier_used(self) -> str:
        """The service tier the response echoes: the tier asked for when it has a lane of its
        own, else what the lane is (realtime: ``default``; standard and bulk: ``flex``)."""
        if self.service_tier in TIER_LANES:
            return str(self.service_tier)
        return "default" if self.lane_used == Lane.REALTIME else "flex"


class _Request(JobParams, Tiered):
    """The fields both endpoints share: the sampling options (``JobParams``), the lane and
    tier (``Tiered``) and these."""

    model: str = Field(min_length=1, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)  # recorded in the job (``user``)
    metadata: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _no_streamed_prompt_logprobs(self) -> _Request:
        if self.stream and self.prompt_logprobs is not None:  # vLLM's rule
            raise PydanticCustomError(
                "unsupported_parameter",
                "prompt_logprobs are not available when stream is true",
                {"fields": "prompt_logprobs"},
            )
        return self

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
                    "lane": self.lane_used,
                    "model": self.model,
                    "metadata": self.metadata,
                    "timeout_s": self.timeout_s,
                    "user": self.user,
                    **fields,
                }
            )
        except ValidationError as exc:
            code, param, message = pydantic_error(exc.errors()[0])
            if param is not None:
                param = param.removeprefix("params.")
            raise DomainError(Kind.INVALID, code, named(param, message), param=param) from None


class ChatCompletionRequest(_Request, ToolUse):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, strict=True)

    refused = CHAT_REFUSED

    @model_validator(mode="before")
    @classmethod
    def _chat_logprobs(cls, data: Any) -> Any:
        """Chat says ``logprobs: true`` and ``top_logprobs: k``; a job, vLLM's ``logprobs: k``."""
        if not isinstance(data, dict) or "logprobs" not in data:
            return data
        data = dict(data)
        asked = data.pop("logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise PydanticCustomError(
                "bool_type", "logprobs is true or false on chat", {"fields": "logprobs"}
            )
        if asked:
            top = data.get("top_logprobs")
            # An invalid top_logprobs is its own field's error, not logprobs'.
            valid = isinstance(top, int) and not isinstance(top, bool) and top <= MAX_LOGPROBS
            data["logprobs"] = top if valid and top > 0 else 0
        return data

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and self.logprobs is None:  # vLLM's rule
            raise PydanticCustomError(
                "unsupported_parameter",
                "top_logprobs needs logprobs: true",
                {"fields": "top_logprobs"},
            )
        return self

    def job(self) -> JobCreate:
        max_tokens = self.max_completion_tokens or self.max_tokens
        tools = self.model_dump(include=set(ToolUse.model_fields), exclude_defaults=True)
        return self._job({"messages": self.messages, "params": self._params(max_tokens), **tools})


class CompletionRequest(_Request):
    # Every form vLLM's server takes; several prompts are one job (docs/architecture.md,
    # "Several prompts, one job").
    prompt: PromptForm

    refused = COMPLETION_REFUSED

    @field_validator("prompt")
    @classmethod
    def _prompt_bounds(cls, value: PromptForm) -> PromptForm:
        # Checked as the body is read, as every other field's form: nothing is set up for a
        # request that cannot be a job.
        return prompt_bounds(value)

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
    def choices(self) -> list[dict[str, Any]] | None: ...
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
    choices: list[dict[str, Any]] | None
    prompt_tokens: int | None
    completion_tokens: int | None
    error_code: str | None
    error_message: str | None
    # A pooled job's rows (relay.end: base64 in the message, or left in the row when large).
    pooled: bytes | None = None
    pooled_width: int | None = None

    @classmethod
    def of(cls, job: JobView, row: dict[str, Any]) -> Ended:
        pooled = row.get("pooled")
        return cls(
            id=job.id,
            created_at=job.created_at,
            model=job.model,
            messages=job.messages,
            status=row["status"],
            result_text=row.get("result_text"),
            finish_reason=row.get("finish_reason"),
            choices=row.get("choices"),
            prompt_tokens=row.get("prompt_tokens"),
            completion_tokens=row.get("completion_tokens"),
            error_code=row.get("error_code"),
            error_message=row.get("error_message"),
            pooled=base64.b64decode(pooled) if isinstance(pooled, str) else None,
            pooled_width=row.get("pooled_width"),
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


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """A choice's stored logprobs (``token_logprob`` items) as chat's ``logprobs``."""
    return {
        "content": [
            {
                "token": t["token"],
                "logprob": t["logprob"],
                "bytes": _bytes(t["token"]),
                "top_logprobs": [
                    {**top, "bytes": _bytes(top["token"])} for top in t["top_logprobs"]
                ],
            }
            for t in tokens
        ]
    }


def completion_logprobs(tokens: list[dict[str, Any]], at: int = 0) -> dict[str, Any]:
    """A choice's stored logprobs as the legacy completions ``logprobs``: per token its text,
    logprob, offset in the choice's text (``at``: where a streamed chunk's first token is) and
    a map of the alternatives with the token itself (OpenAI's "up to logprobs + 1"). An
    ``echo``'s prompt tokens come first, the very first with null logprobs (nothing precedes
    it), as OpenAI and vLLM answer."""
    offsets = []
    for t in tokens:
        offsets.append(at)
        at += len(t["token"])
    return {
        "tokens": [t["token"] for t in tokens],
        "token_logprobs": [t["logprob"] for t in tokens],
        "top_logprobs": [
            None
            if t["logprob"] is None
            else {
                **{top["token"]: top["logprob"] for top in t["top_logprobs"]},
                t["token"]: t["logprob"],
            }
            for t in tokens
        ],
        "text_offset": offsets,
    }


def prompt_logprobs(tokens: list[dict[str, Any]]) -> list[dict[str, dict[str, Any]] | None]:
    """A choice's stored prompt logprobs (``prompt_token_logprob`` items) as vLLM's
    ``prompt_logprobs``: per prompt token, null for the first, else a map from token id to its
    logprob, rank and text, the token itself and its alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for t in tokens:
        if t["logprob"] is None:
            out.append(None)
            continue
        entry = {str(t["token_id"]): _vllm_logprob(t)}
        for top in t["top_logprobs"]:
            entry.setdefault(str(top["token_id"]), _vllm_logprob(top))
        out.append(entry)
    return out


def _vllm_logprob(t: dict[str, Any]) -> dict[str, Any]:
    return {"logprob": t["logprob"], "rank": t["rank"], "decoded_token": t["token"]}


def choices_of(job: JobView) -> list[dict[str, Any]]:
    """Every choice of a succeeded job, stored (n > 1, logprobs) or its one result."""
    if job.choices is not None:
        return job.choices
    return [choice(0, job.result_text or "", job.finish_reason)]


def response_body(job: JobView, tier: str | None = None) -> dict[str, Any]:
    """The OpenAI response of a succeeded job (``chat.completion`` or ``text_completion``);
    ``tier``: the ``service_tier`` it echoes (a call's, ``_Request.tier_used``)."""
    chat = endpoint_of(job) == CHAT
    choices = []
    for c in choices_of(job):
        tokens = c["logprobs"]
        if chat:
            message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
            # The text was calls (workers/inference/tools.py): content is the rest.
            if c.get("tool_calls"):
                message = {**message, "content": c["content"], "tool_calls": c["tool_calls"]}
            choices.append(
                {
                    "index": c["index"],
                    "message": message,
                    "logprobs": None if tokens is None else chat_logprobs(tokens),
                    "finish_reason": c["finish_reason"],
                    "stop_reason": c.get("stop_reason"),
                }
            )
        else:
            prompt = c.get("prompt_logprobs")
            choices.append(
                {
                    "index": c["index"],
                    "text": c["text"],
                    "logprobs": None if tokens is None else completion_logprobs(tokens),
                    "finish_reason": c["finish_reason"],
                    "stop_reason": c.get("stop_reason"),
                    "prompt_logprobs": None if prompt is None else prompt_logprobs(prompt),
                }
            )
    body: dict[str, Any] = {
        "id": job.id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(job.created_at),
        "model": job.model,
        "choices": choices,
        "usage": usage(job),
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if chat:
        # vLLM's chat answer has the prompt's logprobs once, beside the choices.
        prompt = choices_of(job)[0].get("prompt_logprobs")
        body["prompt_logprobs"] = None if prompt is None else prompt_logprobs(prompt)
    return body if tier is None else {**body, "service_tier": tier}


def unsent(whole: str, sent: str) -> str:
    """What of a streamed ``whole`` (a text, a call's arguments, as committed) the pieces
    ``sent`` did not carry: the rest after them when they are its start, else "" (pieces the
    relay lost are sent from the row at the end; app/core/messaging/relay.py)."""
    return whole[len(sent) :] if whole.startswith(sent) else ""


def chunk(
    job: JobView,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
    with_usage: bool = False,
    tier: str | None = None,
    index: int = 0,
    calls: list[dict[str, Any]] | None = None,
    logprobs: dict[str, Any] | None = None,
    stop_reason: str | int | None = None,
) -> dict[str, Any]:
    """One streamed chunk (``chat.completion.chunk`` or ``text_completion``) of choice
    ``index``; ``calls``: pieces of its tool calls (``delta.tool_calls``); ``logprobs``: its
    tokens' (``chat_logprobs`` or ``completion_logprobs`` of them).

    With ``with_usage`` it is the final usage chunk OpenAI sends for
    ``stream_options.include_usage``: no choices, the job's usage.
    """
    chat = endpoint_of(job) == CHAT
    body: dict[str, Any] = {
        "id": job.id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(job.created_at),
        "model": job.model,
        "system_fingerprint": SYSTEM_FINGERPRINT,
    }
    if tier is not None:
        body["service_tier"] = tier
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
        if calls:
            delta["tool_calls"] = calls
        choice: dict[str, Any] = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    choice["stop_reason"] = stop_reason
    body["choices"] = [choice]
    return body


def failure(code: str, message: str) -> DomainError:
    """A failed request's error: the request's fault (400) or the engine's."""
    return DomainError(Kind.MALFORMED if code in REQUEST_ERRORS else Kind.FAILED, code, message)


def job_error(job: JobView) -> DomainError:
    """The error a call answers for its job that ended without succeeding."""
    code = job.error_code or str(job.status)
    message = job.error_message or f"the job ended {job.status}"
    if job.status == JobStatus.FAILED:
        return failure(code, f"{message} (job {job.id})")
    if job.status == JobStatus.EXPIRED:
        kind = Kind.TIMED_OUT
    else:  # cancelled (POST /v1/jobs/{id}/cancel, or its batch was cancelled)
        kind, code, message = Kind.CONFLICT, "job_cancelled", "the job was cancelled"
    return DomainError(kind, code, f"{message} (job {job.id})")
