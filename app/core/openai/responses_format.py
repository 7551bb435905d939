"""OpenAI's Responses API on the wire: a ``POST /v1/responses`` body in, a chat job out, and a
job (with its response row) back to OpenAI's Response object.

A response is a chat completion with another shape: ``input`` (a string or message items) and
``instructions`` become chat messages, ``max_output_tokens`` is ``max_tokens``, ``text.format``
is ``response_format``, and every sampling option is the chat endpoint's, validated by the same
``ChatCompletionRequest`` (so its bounds and its refusals hold here too). Every other field of
vLLM's ``ResponsesRequest`` is in ``RESPONSES_REFUSED`` with the reason, as for chat: at vLLM's
default (or null) it asks for nothing and is accepted, any other value is a 422 naming it
(docs/openai.md, "Responses").

Function ``tools`` are chat's (``tool_choice`` ``auto``, ``required``, ``none`` or a named
function): the calls come back as ``function_call`` output items (streamed: their arguments
piece by piece), and their outputs go in as ``function_call_output`` input items. Not served
yet, refused by name: other item types and logprobs. Streams are OpenAI's events, numbered
(:class:`EventLog`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from app.core.contract.base import StrictModel
from app.core.contract.chat import MAX_TOOLS, TOOL_NAME
from app.core.contract.params import JobParams
from app.core.errors import DomainError, Kind, named, pydantic_error
from app.core.models import JobStatus
from app.core.openai.openai_format import (
    CHAT_REFUSED,
    ChatCompletionRequest,
    JobView,
    ServiceTier,
    refused_fields,
    unsent,
    usage,
)

_NOT_YET = "not served yet by inferq's Responses API"
# Fields ResponsesRequest shares with vLLM's chat request: refused as on chat, for its reasons.
_AS_ON_CHAT = (
    "include_reasoning",
    "cache_salt",
    "watermarking",
    "session_id",
    "media_io_kwargs",
    "mm_processor_kwargs",
    "mm_payload",
    "return_mm_kwargs",
    "kv_transfer_params",
    "ec_transfer_params",
    "vllm_xargs",
    "chat_template_kwargs",
)
# vLLM's ResponsesRequest fields inferq does not take, with vLLM's default (which asks for
# nothing and is accepted) and why.
RESPONSES_REFUSED: dict[str, tuple[Any, str]] = {
    **{name: CHAT_REFUSED[name] for name in _AS_ON_CHAT},
    "max_tool_calls": (None, "the model's calls are bounded by max_output_tokens"),
    "include": (None, "nothing optional is added to a response's output"),
    "prompt": (None, "stored prompt templates are OpenAI's; send the input itself"),
    "reasoning": (None, "reasoning models' options are not offered"),
    "truncation": ("disabled", "inputs are never cut: one longer than the context fails"),
    "top_logprobs": (0, f"logprobs in a response's output are {_NOT_YET}"),
    "prompt_cache_key": (None, "the prefix cache is shared by every tenant of a deployment"),
    "request_id": (None, "the response's id is its job's (GET /v1/jobs/job_<same suffix>)"),
    "priority": (0, "service_tier picks the lane, and the lane decides the priority"),
    "enable_response_messages": (False, "a response's output is its items, not token messages"),
    "previous_input_messages": (None, "previous_response_id carries a conversation on"),
}
MAX_INPUT_ITEMS = 1000


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # output_text's, sent back by clients; unused


class InputMessage(StrictModel):
    """A message item of ``input``: ``{"role", "content"}``, with ``"type": "message"`` or
    without (OpenAI's easy input message); the content a string or text parts."""

    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made, sent back in ``input`` (with its output after it)."""

    type: Literal["function_call"]
    id: str | None = None
    status: str | None = None
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=TOOL_NAME)
    arguments: str


class FunctionCallOutputItem(StrictModel):
    """What a call returned: the tool's answer, as text."""

    type: Literal["function_call_output"]
    id: str | None = None
    status: str | None = None
    call_id: str = Field(min_length=1, max_length=128)
    output: str


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem


class FunctionTool(StrictModel):
    """A function tool as the Responses API gives it (flat, where chat nests ``function``)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat(self) -> dict[str, Any]:
        spec = self.model_dump(exclude={"type"}, exclude_none=True)
        return {"type": "function", "function": spec}


class NamedFunction(StrictModel):
    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME)


class TextFormat(StrictModel):
    """``text.format``: plain text, a JSON object, or JSON by a schema (``response_format``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        schema = {"name": self.name, "schema": self.schema_, "strict": self.strict}
        if self.description is not None:
            schema["description"] = self.description
        return {"type": "json_schema", "json_schema": schema}


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


# The chat request's names for fields a Responses body names otherwise.
_CHAT_NAMES = {
    "max_tokens": "max_output_tokens",
    "response_format.json_schema.schema": "text.format.schema",
    "response_format.json_schema": "text.format",
    "response_format": "text.format",
    "messages": "input",
}


def _responses_name(param: str | None) -> str | None:
    """A chat request's parameter as the Responses body names it (an error names the field
    the caller sent)."""
    for chat, ours in _CHAT_NAMES.items():
        if param is not None and (param == chat or param.startswith(chat + ".")):
            return ours + param[len(chat) :]
    return param


class ResponseCreate(StrictModel):
    """A ``POST /v1/responses`` body: what inferq takes of vLLM's ``ResponsesRequest``."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = Field(None, max_length=256)
    store: bool = True
    background: bool = False
    stream: bool = False
    service_tier: ServiceTier | None = None
    previous_response_id: str | None = Field(None, max_length=64)
    text: TextConfig | None = None
    tools: list[FunctionTool] = Field(default_factory=list, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    # The sampling options, checked by ChatCompletionRequest (``chat``).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused_fields(cls, data: Any) -> Any:
        return refused_fields(data, RESPONSES_REFUSED)

    @model_validator(mode="after")
    def _background_is_stored(self) -> ResponseCreate:
        if self.background and not self.store:  # OpenAI's rule: nothing to poll otherwise
            raise PydanticCustomError(
                "invalid_value",
                "background responses must be stored: store: false cannot go with background: true",
                {"fields": "store"},
            )
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            raise PydanticCustomError(
                "too_long", "at most {n} input items", {"n": MAX_INPUT_ITEMS, "fields": "input"}
            )
        return self

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as chat messages (a string is one user message): calls sent back are the
        assistant's ``tool_calls`` (consecutive ones in one message), their outputs ``tool``
        messages."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
            else:
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return messages

    def input_items(self) -> list[dict[str, Any]]:
        """``input`` as OpenAI lists it back (``input_items``), without ids."""
        if isinstance(self.input, str):
            return [_message_item("user", self.input)]
        return [
            _message_item(item.role, item.text())
            if isinstance(item, InputMessage)
            else item.model_dump(exclude={"id", "status"})
            for item in self.input
        ]

    def chat(self, context: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this response runs as: the instructions (never carried on to the
        next response), the ``context`` of a previous response, then the input."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + context + self.input_messages(),
            "metadata": self.metadata,
            "user": self.user,
            "service_tier": self.service_tier,
            "max_tokens": self.max_output_tokens,
            **{name: getattr(self, name) for name in SAMPLING if getattr(self, name) is not None},
        }
        text_format = self.text.format if self.text is not None else None
        response_format = text_format.response_format() if text_format is not None else None
        if response_format is not None:
            body["response_format"] = response_format
        if self.tools:
            body["tools"] = [tool.chat() for tool in self.tools]
            body["parallel_tool_calls"] = self.parallel_tool_calls
            choice = self.tool_choice
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}}
                if isinstance(choice, NamedFunction)
                else choice
            )
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            code, param, message = pydantic_error(exc.errors()[0])
            param = _responses_name(param)
            raise DomainError(Kind.INVALID, code, named(param, message), param=param) from None

    def echo(self) -> dict[str, Any]:
        """The request's fields a Response object repeats."""
        text_format = self.text.format if self.text is not None and self.text.format else None
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata,
            "user": self.user,
            "store": self.store,
            "background": self.background,
            "previous_response_id": self.previous_response_id,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            },
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools],
            "tool_choice": self.tool_choice
            if isinstance(self.tool_choice, str)
            else self.tool_choice.model_dump(),
            "parallel_tool_calls": self.parallel_tool_calls,
        }


# The sampling options, passed on to the chat request under the same names (JobParams').
SAMPLING = tuple(name for name in ResponseCreate.model_fields if name in JobParams.model_fields)


# A job's status as a response's (a job that stopped at max_output_tokens is "incomplete").
STATUSES = {
    JobStatus.QUEUED: "queued",
    JobStatus.RUNNING: "in_progress",
    JobStatus.SUCCEEDED: "completed",
    JobStatus.FAILED: "failed",
    JobStatus.EXPIRED: "failed",
    JobStatus.CANCELLED: "cancelled",
}


def item_id(response_id: str, kind: str, index: int | None = None) -> str:
    """The id of one of a response's items: ``<kind>_<the response id's own part>``, and
    ``_<index>`` for one of several (its object, its stream's events and its input items)."""
    own = f"{kind}_{response_id.removeprefix('resp_')}"
    return own if index is None else f"{own}_{index}"


def message_id(response_id: str) -> str:
    """The id of a response's output message."""
    return item_id(response_id, "msg")


def function_call_item(
    response_id: str, index: int, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A response's ``index``-th function_call output item."""
    return {
        "type": "function_call",
        "id": item_id(response_id, "fc", index),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _first_choice(job: JobView) -> dict[str, Any]:
    """The job's first stored choice (a response has one); {} when it stored none."""
    return (job.choices or [{}])[0]


def output_calls(job: JobView) -> list[dict[str, Any]]:
    """The calls the job's (first) choice made, as chat holds them (workers/inference/tools.py)."""
    return list(_first_choice(job).get("tool_calls") or [])


def assistant_turn(job: JobView) -> dict[str, Any]:
    """The job's output as the assistant's message of a conversation that goes on."""
    calls = output_calls(job)
    if calls:
        return {
            "role": "assistant",
            "content": _first_choice(job).get("content") or None,
            "tool_calls": calls,
        }
    return {"role": "assistant", "content": job.result_text or ""}


def _message_item(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def response_status(job: JobView) -> str:
    status = STATUSES[JobStatus(job.status)]
    if status == "completed" and job.finish_reason == "length":
        return "incomplete"
    return status


def response_object(
    response_id: str, job: JobView, echo: dict[str, Any], tier: str
) -> dict[str, Any]:
    """OpenAI's Response object for a response whose job is ``job`` (as committed or as now)."""
    status = response_status(job)
    output: list[dict[str, Any]] = []
    calls = output_calls(job) if job.status == JobStatus.SUCCEEDED else []
    if job.status == JobStatus.SUCCEEDED:
        # A choice that made calls keeps the rest of its text as ``content`` (may be empty).
        text = _first_choice(job).get("content") if calls else job.result_text
        if text or not calls:
            output.append(
                {
                    "type": "message",
                    "id": message_id(response_id),
                    "status": "incomplete" if status == "incomplete" else "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text or "", "annotations": []}],
                }
            )
    output += [
        function_call_item(
            response_id,
            i,
            call["id"],
            call["function"]["name"],
            call["function"]["arguments"],
            "completed",
        )
        for i, call in enumerate(calls)
    ]
    error = None
    if job.status in (JobStatus.FAILED, JobStatus.EXPIRED):
        error = {
            "code": job.error_code or str(job.status),
            "message": job.error_message or f"the job ended {job.status}",
        }
    counted = usage(job) if job.status == JobStatus.SUCCEEDED else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(job.created_at),
        "model": job.model,
        "status": status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "service_tier": tier,
        "usage": {
            "input_tokens": counted["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": counted["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counted["total_tokens"],
        }
        if counted
        else None,
        **echo,
    }


class EventLog:
    """OpenAI's stream events of one response, numbered in the order they are made.

    They are made from the job's relay messages alone (its pieces and its end) and from what
    the job was when the stream began, so every API process that reads the same messages makes
    the same events with the same ``sequence_number``s: a client that lost its connection
    resumes with ``starting_after`` anywhere (docs/openai.md, "Responses").

    Output items open as their first piece comes, each at the next ``output_index``: the
    message at its first text, a ``function_call`` at its call's first piece (its name), whose
    arguments then come as ``response.function_call_arguments.delta``. The end closes every item
    from the Response object (the job as committed), sending first what the pieces missed.
    """

    def __init__(self, response_id: str, opening: dict[str, Any]) -> None:
        self.response_id = response_id
        self.item_id = message_id(response_id)
        self.events: list[dict[str, Any]] = []
        self.token: int | None = None
        self.text: list[str] = []
        self.message_at: int | None = None  # the message's output_index, once opened
        # by call index: its output_index, item and the argument pieces sent
        self.calls: dict[int, tuple[int, dict[str, Any], list[str]]] = {}
        self.done = False
        self.restarted = False  # the job started over elsewhere: the stream ended early
        self._add("response.created", response={**opening, "status": "queued"})
        self._add("response.in_progress", response={**opening, "status": "in_progress"})

    def piece(self, token: int, text: str, calls: list[dict[str, Any]] | None = None) -> None:
        """A piece of output of the job's attempt ``token``: text, and pieces of calls (chat's
        ``delta.tool_calls`` entries)."""
        if self.done:
            return
        if self.token is None:
            self.token = token
        elif token != self.token:
            # The job started over on another worker: what was sent cannot be taken back. The
            # response goes on; its end is at GET /v1/responses/{id} and in its webhook.
            self._add(
                "error",
                code="job_restarted",
                message="the response's job restarted on another worker: GET "
                f"/v1/responses/{self.response_id} has its outcome",
                param=None,
            )
            self.done = self.restarted = True
            return
        if text:
            self._text(text)
        for made in calls or []:
            at = int(made["index"])
            arguments = (made.get("function") or {}).get("arguments") or ""
            if at not in self.calls:
                self._open_call(at, made["id"], made["function"]["name"])
            if arguments:
                self._arguments(at, arguments)

    def end(self, final: dict[str, Any]) -> None:
        """The job has ended: ``final`` is the Response object."""
        if self.done:
            return
        called = 0
        for item in final["output"]:
            if item["type"] == "message":
                text = item["content"][0]["text"]
                # Pieces the relay lost (Redis restarted, say), or a stream made from the row:
                # the row has the whole text.
                missed = unsent(text, "".join(self.text))
                if missed:
                    self._text(missed)
                elif self.message_at is None:
                    self._open_message()
                at = {"item_id": self.item_id, "output_index": self.message_at, "content_index": 0}
                self._add("response.output_text.done", **at, text=text, logprobs=[])
                self._add("response.content_part.done", **at, part=item["content"][0])
                self._add("response.output_item.done", output_index=self.message_at, item=item)
            elif item["type"] == "function_call":
                if called not in self.calls:
                    self._open_call(called, item["call_id"], item["name"])
                output_index, opened, pieces = self.calls[called]
                missed = unsent(item["arguments"], "".join(pieces))
                if missed:
                    self._arguments(called, missed)
                self._add(
                    "response.function_call_arguments.done",
                    item_id=opened["id"],
                    output_index=output_index,
                    arguments=item["arguments"],
                )
                self._add("response.output_item.done", output_index=output_index, item=item)
                called += 1
        self._add(f"response.{final['status']}", response=final)
        self.done = True

    def _text(self, text: str) -> None:
        if self.message_at is None:
            self._open_message()
        self.text.append(text)
        at = {"item_id": self.item_id, "output_index": self.message_at, "content_index": 0}
        self._add("response.output_text.delta", **at, delta=text, logprobs=[])

    def _open_message(self) -> None:
        self.message_at = self._next_index()
        item = {
            "id": self.item_id,
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        self._add("response.output_item.added", output_index=self.message_at, item=item)
        part = {"type": "output_text", "text": "", "annotations": []}
        at = {"item_id": self.item_id, "output_index": self.message_at, "content_index": 0}
        self._add("response.content_part.added", **at, part=part)

    def _open_call(self, at: int, call_id: str, name: str) -> None:
        item = function_call_item(self.response_id, at, call_id, name, "", "in_progress")
        output_index = self._next_index()
        self.calls[at] = (output_index, item, [])
        self._add("response.output_item.added", output_index=output_index, item=item)

    def _arguments(self, at: int, arguments: str) -> None:
        output_index, item, pieces = self.calls[at]
        pieces.append(arguments)
        self._add(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=output_index,
            delta=arguments,
        )

    def _next_index(self) -> int:
        return len(self.calls) + (self.message_at is not None)

    def _add(self, event_type: str, **fields: Any) -> None:
        self.events.append({"type": event_type, "sequence_number": len(self.events), **fields})
