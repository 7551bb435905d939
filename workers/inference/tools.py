"""What a chat job's tools make of its output: the tool calls in each choice's text.

The rules are vLLM's server's (docs/openai.md, "Tools"), by ``tool_choice``:

- ``none``: the text is the answer; nothing is parsed.
- a named function: the text is that function's arguments (structured output held it to the
  function's schema), so the choice is one call of it.
- ``required``: the text is a JSON list of ``{"name", "parameters"}`` (held to the tools'
  schemas); each item is a call, ``finish_reason`` becomes ``tool_calls``.
- ``auto``: the model's own format, read by the engine's tool parser; calls found make
  ``finish_reason`` ``tool_calls`` and the text around them the content. With
  ``parallel_tool_calls: false`` only the first call is kept.

A choice with calls keeps its whole ``text`` and gains ``tool_calls`` and ``content``.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Mapping
from typing import Any

from app.core.transitions import choice
from workers.engines.base import Engine
from workers.inference.runner import GenResult


def call(name: str, arguments: str) -> dict[str, Any]:
    """One call as OpenAI shows it, with a fresh id."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def calls_in(
    text: str, tools: Mapping[str, Any], engine: Engine
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, calls) of one choice's ``text`` under ``tools`` (``jobs.tools``)."""
    chosen = tools["tool_choice"]
    if isinstance(chosen, Mapping):
        return None, [call(chosen["name"], text)]
    if chosen == "required":
        try:
            items = json.loads(text)
            made = [call(item["name"], json.dumps(item["parameters"])) for item in items]
        except (ValueError, TypeError, KeyError):  # cut short by max_tokens: no whole list
            return text, []
        return None, made
    if chosen == "auto":
        content, found = engine.extract_tool_calls(text, tools["tools"])
        made = [call(c["name"], c["arguments"]) for c in found]
        if not tools.get("parallel_tool_calls", True):
            made = made[:1]
        return content, made
    return text, []


def with_calls(result: GenResult, tools: Mapping[str, Any], engine: Engine) -> GenResult:
    """``result`` with every choice's tool calls (choices are kept for a job with tools)."""
    if tools["tool_choice"] == "none" or result.abort_reason is not None:
        return result
    choices = result.choices or [choice(0, result.text, result.finish_reason)]
    found = []
    for one in choices:
        content, made = calls_in(one["text"], tools, engine)
        if made:
            finish = one["finish_reason"]
            if tools["tool_choice"] in ("auto", "required") and finish == "stop":
                finish = "tool_calls"
            one = {**one, "content": content, "tool_calls": made, "finish_reason": finish}
        found.append(one)
    return dataclasses.replace(result, choices=found, finish_reason=found[0]["finish_reason"])
