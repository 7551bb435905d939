"""A chat rendered by the model's chat template as ``vllm serve`` renders it, with no model
and no transformers: the template (and the special tokens it reads) that the model's workers
publish in its card (workers/engines/base.py, ``chat_template_card``), run in jinja2's sandbox
as transformers' ``apply_chat_template`` runs it (its environment, filters and globals, its
``continue_final_message``), on messages parsed as vLLM's server parses them for a template
that reads a message's content as a string (vllm/renderers/chat_utils.py: text parts one
newline apart, the empty ones left out; a call's arguments as an object; the ``developer``
role as ``system`` for a template that does not know it: vllm/renderers/hf.py).

A template that reads content as a list of parts (vLLM's "openai" content format) is not
rendered here (``Unsupported``): its parts would have to be kept as the client sent them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

_BILLING_HEADER = "x-anthropic-billing-header"  # vLLM drops this line of a system message
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker


class TemplateError(ValueError):
    """The template (or transformers' rules around it) refused the chat: vLLM's 400, with
    its message."""


class Unsupported(Exception):
    """This card's template cannot be rendered here exactly (see the module's doc)."""


def supports_developer(template: str) -> bool:
    """Whether a chat template knows the ``developer`` role (vLLM's test: it names it as a
    quoted string)."""
    return '"developer"' in template or "'developer'" in template


def developer_as_system(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's rendering of ``developer`` messages for a template that does not know the role
    (vllm/renderers/hf.py, safe_apply_chat_template): each becomes a ``system`` message (its
    ``tools`` dropped); then, when a system message is not first or follows another with
    content, all of them merge into one first message, their non-empty contents two newlines
    apart."""
    converted: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "developer":
            converted.append({k: v for k, v in m.items() if k != "tools"} | {"role": "system"})
        else:
            converted.append(dict(m))
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for i, m in enumerate(converted):
        if m["role"] != "system":
            others.append(m)
            continue
        if i > 0 or contents:
            merge = True
        content = m.get("content", "")
        if isinstance(content, list):
            texts = []
            for part in content:
                if isinstance(part, dict) and "text" in part:
                    texts.append(part["text"])
                elif isinstance(part, str):
                    texts.append(part)
            content = "\n".join(texts)
        if content:
            contents.append(content)
    if not merge:
        return converted
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def select(card: Mapping[str, Any], tools: object | None) -> str:
    """The template a chat is rendered with (transformers' ``get_chat_template``: of named
    templates, ``tool_use`` when there are tools, else ``default``); Unsupported where vLLM
    would read the content as parts."""
    templates: Mapping[str, str] = card["templates"]
    if set(templates) == {""}:
        name = ""
    elif tools is not None and "tool_use" in templates:
        name = "tool_use"
    elif "default" in templates:
        name = "default"
    else:
        raise TemplateError(
            "This model has multiple chat templates with no default specified! Please either "
            "pass a chat template or the name of the template you wish to use to the "
            f"`chat_template` argument. Available template names are {sorted(templates)}."
        )
    found = card.get("formats", {}).get(name)
    if found != "string":
        raise Unsupported(
            "the model's chat template reads a message's content as a list of parts"
            if found == "openai"
            else "the model's worker could not tell how its chat template reads a message"
        )
    return templates[name]


def _text_of(content: object, role: str) -> str:
    """A message's content as vLLM parses it for a string template."""
    if content is None:
        parts: list[str] = []
    elif isinstance(content, str):
        parts = [content]
    else:
        parts = [p["text"] if isinstance(p, Mapping) else str(p) for p in content]  # type: ignore[attr-defined]
    if role == "system":
        kept = []
        for text in parts:
            if text.startswith(_BILLING_HEADER):
                text = text.partition("\n")[2]
                if not text:
                    continue
            kept.append(text)
        parts = kept
    return "\n".join(p for p in parts if p)


def _arguments(value: object) -> dict[str, Any]:
    """A call's arguments as templates read them (vLLM: an object; anything else ``{}``)."""
    if not value:
        return {}
    parsed: object = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages (as ``app.core.contract.chat.ChatMessage`` validated them: role,
    content, name, tool_calls, tool_call_id) as vLLM hands them to a string template."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        msg: dict[str, Any] = {"role": role, "content": _text_of(message.get("content"), role)}
        if role == "assistant" and message.get("tool_calls") is not None:
            calls = [deepcopy(dict(call)) for call in message["tool_calls"]]
            if calls:
                for call in calls:
                    call["function"]["arguments"] = _arguments(call["function"].get("arguments"))
                msg["tool_calls"] = calls
        elif role == "tool" and "tool_call_id" in message:
            msg["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            msg["name"] = message["name"]
        if role == "developer":
            msg["tools"] = None
        out.append(msg)
    return out


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block: its body, as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        block = jinja2.nodes.CallBlock(self.call_method("_generation"), [], [], body)
        return block.set_lineno(lineno)

    def _generation(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' tojson: no HTML escaping, json.dumps' options.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render(
    card: Mapping[str, Any],
    messages: Sequence[Mapping[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """The prompt ``vllm serve`` renders for ``messages`` (validated OpenAI messages) and
    ``tools`` (vLLM's dump of each: ``description`` and ``parameters`` even when null) with
    the card's template. TemplateError: refused as vLLM refuses it (400); Unsupported: see
    ``select``."""
    template = select(card, tools)
    chat = conversation(messages)
    if any(m["role"] == "developer" for m in chat) and not supports_developer(template):
        chat = developer_as_system(chat)
    if not chat:
        raise TemplateError(
            "Cannot apply chat template to an empty conversation. Provide at least one message."
        )
    if continue_final_message and add_generation_prompt:
        raise TemplateError(
            "continue_final_message and add_generation_prompt are not compatible. Use "
            "continue_final_message when you want the model to continue the final message, and "
            "add_generation_prompt when you want to add a header that will prompt it to start a "
            "new assistant message instead."
        )
    final = ""
    if continue_final_message:
        content = chat[-1].get("content")
        if content is None:
            raise TemplateError(
                'continue_final_message is set but the final message has no "content" to continue!'
            )
        if "content" not in template:
            raise TemplateError(
                'continue_final_message is set to "content" but this is not an accepted field '
                "in the chat_template"
            )
        final = content
        chat[-1] = {**chat[-1], "content": content + _CONTINUE_TAG}
    special = dict(card.get("special_tokens") or {})
    try:
        rendered = _compile(template).render(
            **special,
            messages=chat,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as exc:  # the template's own refusals (raise_exception) and errors
        raise TemplateError(str(exc)) from exc
    if continue_final_message:
        if final.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise TemplateError(
                "continue_final_message is set but the final message does not appear in the "
                "chat after applying the chat template! This can happen if the chat template "
                "deletes portions of the final message. Please verify the chat template and "
                "final message in your chat to ensure they are compatible.Final message to "
                f"continue: {final.strip()}\nRendered chat:\n{rendered}"
            )
        at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:at]
        else:
            rendered = rendered[:at].rstrip()
    return rendered
