"""A job's sampling parameters (``params``) as vLLM's ``SamplingParams`` names and bounds them,
and its structured outputs (docs/openai.md, "vLLM's fields"): one model for the jobs API, the
OpenAI bodies and batch lines.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from pydantic import ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.core.contract.base import StrictModel
from app.core.settings import get_settings


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
    echo: bool = Field(
        False,
        description="The result starts with the prompt (vLLM's echo); with logprobs, so do the "
        "logprobs, the prompt's first token's null.",
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each prompt token's log-probability and this many alternatives "
        "(vLLM's prompt_logprobs).",
    )

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
    def _min_below_max(self) -> JobParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise PydanticCustomError(
                "min_tokens_above_max",
                "min_tokens ({min}) must not exceed max_tokens ({max})",
                {"min": self.min_tokens, "max": self.max_tokens, "fields": "min_tokens"},
            )
        return self

    def prompt_logprobs_asked(self) -> int | None:
        """How many alternatives each prompt token's logprob comes with (None: the prompt's
        logprobs are not asked for): ``prompt_logprobs``, or with ``echo`` ``logprobs``
        (vLLM's rule: the echoed prompt's tokens carry theirs)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

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
