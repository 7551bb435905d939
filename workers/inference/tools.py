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

**Streamed**, as vLLM's server streams them (:class:`Streamed`): each choice's output goes
through the engine's ``tool_stream`` as it comes, which tells its content apart from pieces of
calls; the calls streamed are the choice's calls (the same ids), as with vLLM's server, whose
streamed calls are its streaming parser's. The rules by ``tool_choice`` are the same; only
``auto``'s parser reads piece by piece (docs/openai.md, "Tools").
"""

from __future__ import annotations

import dataclasses
import json
import secrets
from collections.abc import Mapping
from typing import Any

from app.core.models import choice
from workers.engines.base import Engine, GenChunk, ToolDelta, ToolStream
from workers.inference.runner import GenResult


def call(name: str, arguments: str) -> dict[str, Any]:
    """One call as OpenAI shows it, with a fresh id."""
    return {
        "id": f"call_{secrets.token_hex(12)}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _finish(finish: str | None, tools: Mapping[str, Any]) -> str | None:
    """A choice that made calls ends with ``tool_calls`` where OpenAI says so (not a named
    function's)."""
    if tools["tool_choice"] in ("auto", "required") and finish == "stop":
        return "tool_calls"
    return finish


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
            finish = _finish(one["finish_reason"], tools)
            one = {**one, "content": content, "tool_calls": made, "finish_reason": finish}
        found.append(one)
    return dataclasses.replace(result, choices=found, finish_reason=found[0]["finish_reason"])


class Streamed:
    """A streamed job's calls, found choice by choice as its output comes (on the engine's loop
    thread), and then the job's result with them (instead of :func:`with_calls`)."""

    def __init__(self, tools: Mapping[str, Any], engine: Engine) -> None:
        self._tools = tools
        self._engine = engine
        self._single = not tools.get("parallel_tool_calls", True)
        self._streams: dict[int, ToolStream] = {}  # by choice
        self._content: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, dict[str, Any]]] = {}  # by choice, then by call

    def feed(self, chunk: GenChunk) -> ToolDelta:
        """What ``chunk`` adds to its choice's message; a call's first piece carries its id
        (this job's, as :func:`call` makes them), type and name."""
        stream = self._streams.get(chunk.index)
        if stream is None:
            stream = self._streams[chunk.index] = self._engine.tool_stream(self._tools)
        found = stream.feed(chunk.text, chunk.token_ids, chunk.finish_reason is not None)
        made = self._calls.setdefault(chunk.index, {})
        pieces = []
        for piece in found.calls:
            at = int(piece["index"])
            if self._single and at > 0:  # parallel_tool_calls false: the first call only
                continue
            function = piece.get("function") or {}
            arguments = function.get("arguments") or ""
            if at in made:
                if arguments:
                    made[at]["function"]["arguments"] += arguments
                    pieces.append({"index": at, "function": {"arguments": arguments}})
                continue
            made[at] = call(function.get("name") or "", arguments)
            # A copy: the call grows here while the relay's thread sends this piece.
            pieces.append({"index": at, **made[at], "function": dict(made[at]["function"])})
        if found.content:
            self._content.setdefault(chunk.index, []).append(found.content)
        return ToolDelta(found.content, pieces)

    def apply(self, result: GenResult) -> GenResult:
        """``result`` with each choice's streamed calls and content, as :func:`with_calls`
        gives a choice that made calls; a choice that made none is left as it is."""
        if result.abort_reason is not None:
            return result
        choices = result.choices or [choice(0, result.text, result.finish_reason)]
        found = []
        for one in choices:
            made = self._calls.get(one["index"])
            if made:
                one = {
                    **one,
                    "content": "".join(self._content.get(one["index"], [])) or None,
                    "tool_calls": [made[at] for at in sorted(made)],
                    "finish_reason": _finish(one["finish_reason"], self._tools),
                }
            found.append(one)
        return dataclasses.replace(result, choices=found, finish_reason=found[0]["finish_reason"])
