"""A chat as a job takes it: OpenAI's messages (with the calls an assistant made) and tools
(functions, ``tool_choice``), with vLLM's rules (docs/openai.md, "vLLM's fields", **Tools**).
The jobs API's ``messages`` and the OpenAI endpoints' bodies share these models.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.core.contract.base import StrictModel
from app.core.contract.params import check_json_schema
from app.core.settings import get_settings


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
        # Text parts join with a newline, empty ones left out (vLLM's parse of a chat
        # template that reads a message's content as a string).
        text = value if isinstance(value, str) else "\n".join(p.text for p in value if p.text)
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
