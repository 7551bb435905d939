"""Pydantic request and response models of the public HTTP contract (docs/api.md, "HTTP API (v1)").

Bounds that operators may tune come from settings and are checked in validators, so an
out-of-bounds value is a 422 that names its field. Unknown fields are refused (a typo such as
``max_token`` must not be silently ignored).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from app.core.models import Batch, Job, JobStatus, Lane, NewJob
from app.core.settings import get_settings


def storable(text: str) -> bool:
    """Text the databases can hold: no NUL (PostgreSQL refuses it), no lone surrogates."""
    if "\x00" in text:
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_storable(value: Any) -> None:
    if isinstance(value, str):
        if not storable(value):
            raise ValueError("text must be valid Unicode without NUL characters")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_storable(key)
            _check_storable(item)
    elif isinstance(value, list | tuple):
        for item in value:
            _check_storable(item)


class StrictModel(BaseModel):
    """Request bodies: unknown fields refused, every string storable as it is, and an explicit
    null read as the field's default (OpenAI's semantics: ``"temperature": null`` asks for
    nothing)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }

    @field_validator("*")
    @classmethod
    def _storable_text(cls, value: Any) -> Any:
        _check_storable(value)
        return value


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


# OpenAI's rule for a function's name.
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"
MAX_TOOLS = 128


class CalledFunction(StrictModel):
    name: str = Field(pattern=TOOL_NAME)
    arguments: str = Field(description="The arguments as a JSON text.")


class ToolCall(StrictModel):
    """A call the assistant made, as a chat's history sends it back."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Null only on an assistant message that made tool calls (OpenAI's rule).
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=128)

    @field_validator("content")
    @classmethod
    def _content_bounds(cls, value: str | list[TextPart] | None) -> str | None:
        if value is None:
            return None
        text = value if isinstance(value, str) else "".join(part.text for part in value)
        limit = get_settings().max_prompt_chars
        if len(text) > limit:
            raise ValueError(f"message content is longer than {limit} characters")
        return text

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError(
                "missing",
                "content is required (null only on an assistant message with tool_calls)",
                {"fields": "content"},
            )
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError(
                "tool_call_id",
                "a tool message answers one call: tool_call_id is required on it, and only on it",
                {"fields": "tool_call_id"},
            )
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError(
                "unexpected_tool_calls",
                "only assistant messages carry tool_calls",
                {"fields": "tool_calls"},
            )
        return self

    def text(self) -> str:
        """What the message says, its tool calls included (for counting and checks)."""
        calls = "".join(c.function.name + c.function.arguments for c in self.tool_calls or ())
        return str(self.content or "") + calls


def check_webhook_scheme(value: str | None) -> str | None:
    if value is not None and not value.lower().startswith(("http://", "https://")):
        raise ValueError("webhook_url must be an http(s) URL")
    return value


def check_metadata(value: dict[str, str]) -> dict[str, str]:
    s = get_settings()
    if len(value) > s.metadata_max_pairs:
        raise ValueError(f"at most {s.metadata_max_pairs} metadata pairs are allowed")
    for key, item in value.items():
        if not key or len(key) > s.metadata_max_key_chars:
            raise ValueError(f"metadata keys must be 1 to {s.metadata_max_key_chars} chars")
        if len(item) > s.metadata_max_value_chars:
            raise ValueError(f"metadata values must be at most {s.metadata_max_value_chars}")
    return value


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: the output held to exactly one constraint (a JSON schema,
    any JSON object, a regex, a choice of strings or a grammar) by vLLM's structured-output
    backend. The OpenAI endpoints' ``response_format`` becomes one of these (as in vLLM)."""

    model_config = ConfigDict(populate_by_name=True)

    json_schema: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = Field(None, min_length=1)

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_from_text(cls, value: Any) -> Any:
        # vLLM takes the schema as an object or as its JSON text.
        if isinstance(value, str):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
        return value

    @field_validator("json_schema")
    @classmethod
    def _schema_compiles(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_schema(value)
        return value

    @field_validator("regex", "whitespace_pattern")
    @classmethod
    def _regex_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as exc:
                raise ValueError(f"the regex does not compile: {exc}") from None
        return value

    @field_validator("json_object")
    @classmethod
    def _false_is_unset(cls, value: bool | None) -> bool | None:
        return True if value else None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = self.model_dump(by_alias=True, include=_CONSTRAINT_FIELDS)
        if sum(value is not None for value in given.values()) != 1:
            raise PydanticCustomError(
                "one_constraint",
                f"exactly one of {', '.join(CONSTRAINTS[:-1])} or {CONSTRAINTS[-1]} is required",
                {"fields": "|".join(CONSTRAINTS)},
            )
        return self


# The constraints of ``structured_outputs`` by their names on the wire (vLLM's), one of which
# a request gives; the model's fields that hold them.
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_CONSTRAINT_FIELDS = {
    name for name, f in StructuredOutputs.model_fields.items() if (f.alias or name) in CONSTRAINTS
}


def check_json_schema(schema: dict[str, Any]) -> None:
    """A JSON schema that compiles (its own metaschema's rules), else a ValueError saying why."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ValueError(f"the JSON schema is invalid: {exc.message}") from None


# OpenAI's bound on a logit bias, which vLLM's server applies too.
LOGIT_BIAS_LIMIT = 100.0
MAX_TOKEN_IDS = 256  # stop_token_ids, allowed_token_ids, logit_bias entries, bad_words per job
MAX_BAD_WORD_CHARS = 64
# vLLM's default max_logprobs: the most alternatives per token it returns.
MAX_LOGPROBS = 20


class JobParams(StrictModel):
    """Sampling: one model for the jobs API's ``params``, the OpenAI bodies and batch lines.

    Names, defaults and bounds are those of vLLM's ``SamplingParams`` (docs/openai.md,
    "vLLM's fields"), so a body ``vllm serve`` takes means the same here; a job's row keeps only the
    options its caller set (``max_tokens`` always). Engines other than vLLM honour what they
    can and fail a job that asks for the rest with ``invalid_request`` naming the option.
    """

    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, description="Choices to sample (at most INFERQ_MAX_N).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="0 or -1: every token.")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    logit_bias: dict[int, float] | None = Field(
        None, description="Token id -> bias added to its logit, -100 to 100."
    )
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = Field(
        None, description="Only these token ids may be sampled (at most 256)."
    )
    bad_words: list[str] | None = Field(
        None, description="Words never generated (at most 256, each 1 to 64 characters)."
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    structured_outputs: StructuredOutputs | None = None
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each output token's log-probability and this many alternatives.",
    )
    echo: bool = Field(False, description="The result starts with the prompt (vLLM's echo).")

    @field_validator("n")
    @classmethod
    def _n_bound(cls, value: int) -> int:
        limit = get_settings().max_n
        if value > limit:
            raise ValueError(f"n must be at most {limit}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_bounds(cls, value: dict[int, float] | None) -> dict[int, float] | None:
        if value is None:
            return None
        if len(value) > MAX_TOKEN_IDS:
            raise ValueError(f"at most {MAX_TOKEN_IDS} tokens may be biased")
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"token ids are not negative (got {token})")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"each bias must be between -100 and 100 (got {bias})")
        return value

    @field_validator("stop_token_ids", "allowed_token_ids")
    @classmethod
    def _token_ids_bounds(cls, value: list[int] | None) -> list[int] | None:
        if value is not None:
            if len(value) > MAX_TOKEN_IDS:
                raise ValueError(f"at most {MAX_TOKEN_IDS} token ids are allowed")
            if any(token < 0 for token in value):
                raise ValueError("token ids are not negative")
        return value

    @field_validator("allowed_token_ids")
    @classmethod
    def _some_allowed(cls, value: list[int] | None) -> list[int] | None:
        if value == []:  # vLLM's rule: nothing could be sampled
            raise ValueError("allowed_token_ids must not be empty")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words_bounds(cls, value: list[str] | None) -> list[str] | None:
        if value is not None:
            if len(value) > MAX_TOKEN_IDS:
                raise ValueError(f"at most {MAX_TOKEN_IDS} bad words are allowed")
            if any(not 1 <= len(word) <= MAX_BAD_WORD_CHARS for word in value):
                raise ValueError(f"each bad word is 1 to {MAX_BAD_WORD_CHARS} characters")
        return value or None

    @model_validator(mode="after")
    def _result_bound(self) -> JobParams:
        # A result is one row and one relay message: logprobs of many long choices would make
        # it hundreds of megabytes.
        if self.logprobs is not None:
            settings = get_settings()
            entries = self.most_output_tokens() * (1 + self.logprobs)
            if entries > settings.max_logprob_entries:
                raise PydanticCustomError(
                    "result_too_large",
                    "n x max_tokens x (1 + logprobs) is {entries}, over the limit of {limit} "
                    "log-probabilities a job may return (INFERQ_MAX_LOGPROB_ENTRIES)",
                    {
                        "entries": entries,
                        "limit": settings.max_logprob_entries,
                        "fields": "logprobs",
                    },
                )
        return self

    @model_validator(mode="after")
    def _greedy_is_one_choice(self) -> JobParams:
        if self.n > 1 and self.temperature == 0:  # vLLM's rule: they would all be the same
            raise PydanticCustomError(
                "greedy_n",
                "n must be 1 when sampling greedily (temperature 0)",
                {"fields": "n"},
            )
        return self

    @model_validator(mode="after")
    def _echo_without_logprobs(self) -> JobParams:
        if self.echo and self.logprobs is not None:
            raise PydanticCustomError(
                "unsupported_parameter",
                "echo with logprobs is not supported: it would return the prompt's logprobs, "
                "which inferq does not",
                {"fields": "echo"},
            )
        return self

    @model_validator(mode="after")
    def _min_below_max(self) -> JobParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise PydanticCustomError(
                "min_tokens_above_max",
                "min_tokens ({min}) must not exceed max_tokens ({max})",
                {"min": self.min_tokens, "max": self.max_tokens, "fields": "min_tokens"},
            )
        return self

    def most_output_tokens(self) -> int:
        """What the job can generate: every choice can run to max_tokens."""
        return self.n * (self.max_tokens or get_settings().default_max_tokens)

    def stored(self) -> dict[str, Any]:
        """What a job's row keeps: the options set to something other than their default."""
        return self.model_dump(exclude_defaults=True, by_alias=True)

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_bound(cls, value: int | None) -> int | None:
        limit = get_settings().max_tokens_limit
        if value is not None and value > limit:
            raise ValueError(f"max_tokens must be at most {limit}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        settings = get_settings()
        if len(stops) > settings.max_stop_sequences:
            raise ValueError(f"at most {settings.max_stop_sequences} stop sequences are allowed")
        if any(not s or len(s) > settings.max_stop_chars for s in stops):
            raise ValueError(
                f"each stop sequence must be 1 to {settings.max_stop_chars} characters"
            )
        return stops


class FunctionDef(StrictModel):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = Field(None, max_length=4096)
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema that compiles.")
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _compiles(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            check_json_schema(value)
        return value


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(StrictModel):
    name: str = Field(pattern=TOOL_NAME)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


class ToolUse(StrictModel):
    """OpenAI's tool fields of a chat (on ``/v1/chat/completions``, its batch lines and chat
    jobs on ``/v1/jobs``), with vLLM's rules: ``tool_choice`` defaults to ``auto`` when there
    are tools; ``required`` and a named function hold the output to the tools' schemas by
    structured output; ``auto`` needs the model's tool parser (docs/openai.md, "Tools")."""

    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _choice_among_tools(self) -> ToolUse:
        choice = self.tool_choice
        if choice is not None and choice != "none" and not self.tools:
            raise PydanticCustomError(
                "missing", "tool_choice needs tools", {"fields": "tool_choice"}
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {
            tool.function.name for tool in self.tools or ()
        }:
            raise PydanticCustomError(
                "unknown_tool",
                "tool_choice names a function that is not in tools",
                {"fields": "tool_choice"},
            )
        return self

    def chosen(self) -> str | dict[str, str]:
        """``none``, ``auto``, ``required``, or ``{"name": ...}`` of the named function."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return {"name": choice.function.name}
        return choice or ("auto" if self.tools else "none")

    def tool_spec(self) -> dict[str, Any] | None:
        """What a job keeps (``jobs.tools``); None without tools."""
        if not self.tools:
            return None
        return {
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools],
            "tool_choice": self.chosen(),
            "parallel_tool_calls": self.parallel_tool_calls,
        }

    def tool_constraint(self) -> dict[str, Any] | None:
        """The JSON schema a ``required`` or named choice holds the output to, as vLLM's
        server builds it: the named function's arguments, or a list of calls of the tools."""
        chosen = self.chosen()
        # A function without parameters takes an empty object (vLLM's rule).
        arguments = {
            tool.function.name: tool.function.parameters or {"type": "object", "properties": {}}
            for tool in self.tools or ()
        }
        if isinstance(chosen, dict):
            return arguments[chosen["name"]]
        if chosen != "required":
            return None
        calls: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "anyOf": [
                    {
                        "properties": {
                            "name": {"type": "string", "enum": [name]},
                            "parameters": schema,
                        },
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                    for name, schema in arguments.items()
                ],
            },
        }
        if not self.parallel_tool_calls:
            calls["maxItems"] = 1
        return calls


class JobCreate(ToolUse):
    lane: Lane = Lane.STANDARD
    model: str | None = Field(None, min_length=1, max_length=256)
    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, validate_default=True)
    params: JobParams = Field(default_factory=lambda: JobParams())
    webhook_url: str | None = Field(None, max_length=2048)
    metadata: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = Field(None, gt=0)
    user: str | None = Field(
        None, max_length=256, description="Your id for your end user (OpenAI's), recorded."
    )

    @field_validator("prompt")
    @classmethod
    def _prompt_bounds(cls, value: str | None) -> str | None:
        limit = get_settings().max_prompt_chars
        if value is not None and len(value) > limit:
            raise ValueError(f"prompt is longer than {limit} characters")
        return value

    @field_validator("messages")
    @classmethod
    def _messages_bounds(cls, value: list[ChatMessage] | None) -> list[ChatMessage] | None:
        if value is not None:
            limit = get_settings().max_messages
            if not value:
                raise ValueError("messages must not be empty")
            if len(value) > limit:
                raise ValueError(f"at most {limit} messages are allowed")
        return value

    @model_validator(mode="after")
    def _exactly_one_input(self) -> JobCreate:
        if (self.messages is None) == (self.prompt is None):
            # Either field may be the one the caller meant: the error names both
            # (``fields`` becomes its ``param``: app/api/handlers.py).
            raise PydanticCustomError(
                "prompt_or_messages",
                "exactly one of `prompt` or `messages` is required",
                {"fields": "prompt|messages"},
            )
        return self

    @model_validator(mode="after")
    def _tools_in_a_chat(self) -> JobCreate:
        if self.tools and self.messages is None:
            raise PydanticCustomError(
                "tools_need_messages", "tools are for chat jobs (messages)", {"fields": "tools"}
            )
        if self.params.structured_outputs is not None and self.tool_constraint() is not None:
            raise PydanticCustomError(
                "unsupported_parameter",
                "tool_choice required or named holds the output to the tools' schemas: it "
                "cannot be combined with structured_outputs or response_format",
                {"fields": "tool_choice"},
            )
        return self

    @field_validator("webhook_url")
    @classmethod
    def _webhook_scheme(cls, value: str | None) -> str | None:
        return check_webhook_scheme(value)

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str]) -> dict[str, str]:
        return check_metadata(value)

    @field_validator("timeout_s")
    @classmethod
    def _timeout_bound(cls, value: float | None) -> float | None:
        limit = get_settings().max_timeout_s
        if value is not None and value > limit:
            raise ValueError(f"timeout_s must be at most {limit}")
        return value


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprob(BaseModel):
    token: str
    logprob: float


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    top_logprobs: list[TopLogprob]


class MadeFunction(BaseModel):
    # What the model wrote, as it wrote it: a parsed name need not follow the request's rule.
    name: str
    arguments: str


class MadeCall(BaseModel):
    id: str
    type: Literal["function"]
    function: MadeFunction


class JobChoice(BaseModel):
    index: int
    text: str = Field(description="The whole output, tool calls included.")
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    tool_calls: list[MadeCall] | None = Field(
        None, description="The calls found in the text, where the job had tools."
    )
    content: str | None = Field(None, description="With tool_calls: the text around them.")


class JobResult(BaseModel):
    text: str = Field(description="Choice 0's text.")
    finish_reason: str | None
    usage: Usage = Field(description="completion_tokens counts every choice's tokens.")
    choices: list[JobChoice] | None = Field(
        None, description="Every choice, where the job asked for n > 1 or for logprobs."
    )


class JobError(BaseModel):
    code: str
    message: str


def secs(value: float | None) -> int | None:
    return None if value is None else int(value)


def _ms(start: float | None, end: float | None) -> int | None:
    return None if start is None or end is None else max(0, round((end - start) * 1000))


class JobTimings(BaseModel):
    """When the job passed each point, in unix seconds with milliseconds, and the spans between.

    ``started_at`` and ``first_token_at`` belong to the job's last attempt.
    """

    queued_at: float
    started_at: float | None
    first_token_at: float | None
    finished_at: float | None
    queue_ms: int | None = Field(description="queued_at to started_at: time spent waiting.")
    ttft_ms: int | None = Field(description="queued_at to first_token_at: time to first token.")
    duration_ms: int | None = Field(description="started_at to finished_at: time running.")

    @classmethod
    def from_row(cls, job: Job | NewJob) -> JobTimings:
        def ms3(value: float | None) -> float | None:
            return None if value is None else round(value, 3)

        started = job.started_at if job.status != JobStatus.QUEUED else None
        return cls(
            queued_at=round(job.created_at, 3),
            started_at=ms3(started),
            first_token_at=ms3(job.first_token_at),
            finished_at=ms3(job.finished_at),
            queue_ms=_ms(job.created_at, started),
            ttft_ms=_ms(job.created_at, job.first_token_at),
            duration_ms=_ms(started, job.finished_at),
        )


class JobOut(BaseModel):
    id: str
    object: Literal["job"] = "job"
    status: str
    lane: str
    model: str
    created_at: int
    started_at: int | None
    finished_at: int | None
    result: JobResult | None
    error: JobError | None
    attempts: int
    metadata: dict[str, str]
    user: str | None
    webhook_url: str | None
    batch_id: str | None
    timings: JobTimings

    @classmethod
    def from_row(cls, job: Job | NewJob) -> JobOut:
        result = None
        if job.result_text is not None:
            prompt_tokens = job.prompt_tokens or 0
            completion_tokens = job.completion_tokens or 0
            result = JobResult(
                text=job.result_text,
                finish_reason=job.finish_reason,
                usage=Usage(
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion_tokens,
                    total_tokens=prompt_tokens + completion_tokens,
                ),
                choices=None
                if job.choices is None
                else [JobChoice.model_validate(c) for c in job.choices],
            )
        error = None
        if job.error_code is not None:
            error = JobError(code=job.error_code, message=job.error_message or "")
        return cls(
            id=job.id,
            status=job.status,
            lane=job.lane,
            model=job.model,
            created_at=int(job.created_at),
            started_at=secs(job.started_at),
            finished_at=secs(job.finished_at),
            result=result,
            error=error,
            attempts=job.attempts,
            metadata=dict(job.meta or {}),
            user=job.end_user,
            webhook_url=job.webhook_url,
            batch_id=job.batch_id,
            timings=JobTimings.from_row(job),
        )


# --- batches (OpenAI's Batch API) --------------------------------------------------------------


class BatchCreate(StrictModel):
    input_file_id: str = Field(min_length=1, max_length=64)
    endpoint: str
    completion_window: str = Field(
        description='"24h" as with OpenAI, or any duration like "90s", "30m", "2h" up to '
        "INFERQ_BATCH_MAX_WINDOW_S."
    )
    metadata: dict[str, str] | None = None
    # inferq's addition: batch.* events are signed and delivered like job events.
    webhook_url: str | None = Field(None, max_length=2048)

    @field_validator("metadata")
    @classmethod
    def _metadata_bounds(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return None if value is None else check_metadata(value)

    @field_validator("webhook_url")
    @classmethod
    def _webhook_scheme(cls, value: str | None) -> str | None:
        return check_webhook_scheme(value)


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class BatchOut(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    webhook_url: str | None

    @classmethod
    def from_row(cls, batch: Batch, counts: RequestCounts | None = None) -> BatchOut:
        errors = None
        if batch.errors:
            errors = BatchErrors(data=[BatchError(**e) for e in batch.errors])
        return cls(
            id=batch.id,
            endpoint=batch.endpoint,
            errors=errors,
            input_file_id=batch.input_file_id,
            completion_window=batch.completion_window,
            status=batch.status,
            output_file_id=batch.output_file_id,
            error_file_id=batch.error_file_id,
            created_at=int(batch.created_at),
            in_progress_at=secs(batch.in_progress_at),
            expires_at=secs(batch.expires_at),
            finalizing_at=secs(batch.finalizing_at),
            completed_at=secs(batch.completed_at),
            failed_at=secs(batch.failed_at),
            expired_at=secs(batch.expired_at),
            cancelling_at=secs(batch.cancelling_at),
            cancelled_at=secs(batch.cancelled_at),
            request_counts=counts
            or RequestCounts(
                total=batch.request_total,
                completed=batch.request_completed,
                failed=batch.request_failed,
            ),
            metadata=batch.meta or None,
            webhook_url=batch.webhook_url,
        )
