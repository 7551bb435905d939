"""The conformance request set (issue 64): the same requests sent to `vllm serve` and to inferq,
and how their answers are compared (tests/integration/test_conformance.py).

Each ``Case`` is one HTTP request. ``greedy`` cases are temperature 0 with a seed: their text
must be the same on both servers (the same demo model, the same engine arguments); the others
are compared by shape only (status, keys, choices, usage).

What is compared, response by response (``differences``):

- the HTTP status, where vLLM answers 2xx;
- a form vLLM refuses (4xx): inferq refuses it too, with a 4xx (422 where inferq refuses a field
  by name: vLLM answers every refusal 400) and OpenAI's envelope ``{"error": {"message",
  "type", "param", "code"}}`` (vLLM's envelope is not compared: its ``code`` is the status);
- keys, at every level of the JSON (top level, each choice, ``message``/``delta``, ``logprobs``
  and its items, ``usage``): inferq has every key to which vLLM gives a non-null value, and no
  key vLLM does not have, except those in ``EXTRA_KEYS`` and ``EXTRA_PATHS`` (inferq's
  additions). A key vLLM
  sends as null, inferq may leave out or send as null or as a value. Lists are compared item by
  item where both have the item (a list of choices, of logprobs entries);
- choices: the same number, the same ``index`` sequence in the same order;
- ``usage``: the same prompt, completion and total token counts (``prompt_tokens_details`` and
  other nested details are compared as keys only);
- greedy cases: the same text per choice (``text``, ``message.content``), the same
  ``finish_reason`` and ``stop_reason``, the same tool call names and arguments, and the same
  logprob shapes (``logprob_shape``, ``prompt_logprob_shape``: tokens, text offsets, how many
  alternatives, which token ids; never the float values);
- a case marked ``differs`` (a deliberate difference, with its reason; docs/openai.md, "Request
  forms"): only the status, the choices' number and order, and the usage;
- values that only vLLM may fix (ids, ``created``, ``system_fingerprint``) are never compared;
- streams: each data event is compared by keys as above (vLLM's first event against inferq's
  first, and so on is too strict: pieces may be merged differently), so the keys are compared
  as the union over all chunks; then the choice indexes seen (as a set: how several choices'
  chunks interleave is the engines' timing), the final usage (the last event with ``usage``),
  ``[DONE]`` last, and for greedy cases the concatenated text and the finish reason per index.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import httpx

MODEL = "inferq-demo"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
GREEDY = {"temperature": 0, "seed": 1}
HELLO = [{"role": "user", "content": "Hello!"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

# Keys inferq may add where vLLM has none: OpenAI's own `service_tier` (docs/openai.md,
# "Service tiers"), on responses and stream chunks, anywhere; and by path (list positions as
# `[]`), a model's `ready`, `workers` and `task` on /v1/models (docs/api.md).
EXTRA_KEYS = frozenset({"service_tier"})
EXTRA_PATHS = frozenset({"data[].ready", "data[].workers", "data[].task"})


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any] | None = None  # None: GET
    greedy: bool = False  # the same text on both servers
    note: str = ""
    auth: bool = True  # inferq: send the API key
    # A deliberate difference (docs/openai.md, "Request forms", says why): the status, the
    # choices' number and order and the usage are compared, not the keys or the text.
    differs: str = ""

    @property
    def method(self) -> str:
        return "GET" if self.body is None else "POST"

    @property
    def stream(self) -> bool:
        return bool(self.body and self.body.get("stream"))


def _cmpl(name: str, note: str = "", greedy: bool = True, **body: Any) -> Case:
    fields = {"model": MODEL, "max_tokens": 6, **(GREEDY if greedy else {}), **body}
    return Case(name, CMPL, fields, greedy=greedy, note=note)


def _chat(name: str, note: str = "", greedy: bool = True, differs: str = "", **body: Any) -> Case:
    fields = {"model": MODEL, "max_tokens": 6, **(GREEDY if greedy else {}), **body}
    fields.setdefault("messages", HELLO)
    return Case(name, CHAT, fields, greedy=greedy and not differs, note=note, differs=differs)


USAGE: dict[str, Any] = {"stream_options": {"include_usage": True}}

CASES: list[Case] = [
    # --- /v1/completions: the prompt forms --------------------------------------------------
    _cmpl("cmpl_string", "prompt as a string", prompt="def fibonacci(n):"),
    _cmpl("cmpl_strings", "two prompts as strings", prompt=["def f(x):", "import os"]),
    _cmpl("cmpl_token_ids", "prompt as token ids", prompt=[100, 200, 300]),
    _cmpl("cmpl_token_id_lists", "two prompts as token ids", prompt=[[100, 200, 300], [400, 500]]),
    _cmpl(
        "cmpl_n2",
        "n=2 (sampled: shape only)",
        greedy=False,
        prompt="def f(x):",
        n=2,
        temperature=1.0,
        seed=7,
    ),
    _cmpl(
        "cmpl_strings_n2",
        "two prompts, n=2: choice p*n+j",
        greedy=False,
        prompt=["def f(x):", "import os"],
        n=2,
        temperature=1.0,
        seed=7,
    ),
    _cmpl("cmpl_echo_logprobs", "echo with logprobs=2", prompt="def f(x):", echo=True, logprobs=2),
    _cmpl("cmpl_echo", "echo without logprobs", prompt="def f(x):", echo=True),
    _cmpl("cmpl_prompt_logprobs", "prompt_logprobs=1", prompt="def f(x):", prompt_logprobs=1),
    _cmpl("cmpl_nul", "NUL inside the prompt", prompt="a\u0000b = 1\n"),
    _cmpl("cmpl_stop", "a stop string", prompt="def fibonacci(n):", max_tokens=12, stop=["]"]),
    _cmpl("cmpl_logprobs", "logprobs=2", prompt="def fibonacci(n):", logprobs=2),
    _cmpl(
        "cmpl_seed_sampled",
        "temperature 1 with a seed (shape only)",
        greedy=False,
        prompt="def fibonacci(n):",
        temperature=1.0,
        seed=42,
    ),
    _cmpl("cmpl_stream_usage", "stream with usage", prompt="def f(x):", stream=True, **USAGE),
    _cmpl(
        "cmpl_stream_strings",
        "two prompts streamed, with usage",
        prompt=["def f(x):", "import os"],
        stream=True,
        **USAGE,
    ),
    _cmpl(
        "cmpl_stream_prompt_logprobs",
        "prompt_logprobs with stream (vLLM refuses it)",
        prompt="def f(x):",
        stream=True,
        prompt_logprobs=1,
    ),
    _cmpl("cmpl_suffix", "suffix (vLLM refuses it)", prompt="def f(x):", suffix="return x"),
    # --- /v1/chat/completions -------------------------------------------------------------
    _chat("chat_basic", "a plain chat, greedy"),
    _chat(
        "chat_content_parts",
        "content as text parts",
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}],
            }
        ],
    ),
    _chat(
        "chat_developer",
        "the developer role",
        messages=[{"role": "developer", "content": "Be brief."}, *HELLO],
    ),
    _chat("chat_max_completion_tokens", "max_completion_tokens", max_completion_tokens=4),
    _chat("chat_n2", "n=2 (sampled: shape only)", greedy=False, n=2, temperature=1.0, seed=7),
    _chat(
        "chat_json_object",
        "response_format json_object",
        max_tokens=12,
        response_format={"type": "json_object"},
    ),
    _chat("chat_tools_auto", "tools, tool_choice auto (hermes)", tools=TOOLS),
    _chat(
        "chat_tools_named",
        "tools, a named tool_choice",
        differs="inferq holds a named tool_choice to the function's arguments (the call is "
        "made, OpenAI's meaning); vLLM 0.32 holds it to its tool parser's own format, which "
        "the demo model does not finish in 16 tokens (content, no tool_calls)",
        max_tokens=16,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    ),
    _chat(
        "chat_tool_history",
        "an assistant's tool call and the tool's answer in the messages",
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    ),
    _chat("chat_logprobs", "logprobs with top_logprobs=2", logprobs=True, top_logprobs=2),
    _chat("chat_prompt_logprobs", "vLLM's prompt_logprobs=1", prompt_logprobs=1),
    _chat("chat_nul", "NUL inside a message", messages=[{"role": "user", "content": "a\u0000b"}]),
    _chat("chat_stream_usage", "stream with usage", stream=True, **USAGE),
    _chat(
        "chat_stream_n2",
        "stream, n=2 (sampled)",
        greedy=False,
        n=2,
        temperature=1.0,
        seed=7,
        stream=True,
        **USAGE,
    ),
    # --- vLLM's utility endpoints ------------------------------------------------------------
    Case("tokenize", "/tokenize", {"model": MODEL, "prompt": "def fibonacci(n):"}),
    Case("tokenize_chat", "/tokenize", {"model": MODEL, "messages": HELLO}),
    Case("detokenize", "/detokenize", {"model": MODEL, "tokens": [100, 200, 300]}),
    Case("version", "/version"),
    Case("models", "/v1/models"),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES)


# --- sending ---------------------------------------------------------------------------------


def send(client: httpx.Client, case: Case) -> dict[str, Any]:
    """The raw answer: ``status``, and ``body`` (JSON, or text when it is not JSON) or, for a
    stream that answered 200, ``events``: every SSE data payload in order (JSON, or the text
    ``[DONE]``)."""
    if not case.stream:
        response = client.request(case.method, case.path, json=case.body)
        return {"status": response.status_code, "body": _json(response.text)}
    with client.stream(case.method, case.path, json=case.body) as response:
        if response.status_code != 200:
            response.read()
            return {"status": response.status_code, "body": _json(response.text)}
        events: list[Any] = []
        for line in response.iter_lines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else _json(data))
        return {"status": 200, "events": events}


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# --- comparing -------------------------------------------------------------------------------


def differences(case: Case, vllm: dict[str, Any], inferq: dict[str, Any]) -> list[str]:
    """How inferq's answer differs from vLLM's (empty: conformant)."""
    if vllm["status"] >= 400:
        # A form vLLM refuses: inferq refuses it too, with OpenAI's envelope; its status may
        # be another 4xx (inferq answers a field it refuses with 422, vLLM every refusal 400).
        if not 400 <= inferq["status"] < 500:
            return [f"status: vLLM {vllm['status']} (refused), inferq {inferq['status']}"]
        return envelope_problems(inferq.get("body"))
    if vllm["status"] != inferq["status"]:
        return [f"status: vLLM {vllm['status']}, inferq {inferq['status']}"]
    if "events" in vllm:
        if "events" not in inferq:
            return ["vLLM streamed, inferq did not"]
        return stream_differences(case, vllm["events"], inferq["events"])
    found: list[str] = []
    v, q = vllm["body"], inferq["body"]
    if case.differs:
        compare_choices(case, v.get("choices") or [], q.get("choices") or [], found)
        compare_usage(v.get("usage"), q.get("usage"), found)
        return found
    compare_keys(v, q, "", found)
    if case.path in (CMPL, CHAT) and isinstance(v, dict) and isinstance(q, dict):
        compare_choices(case, v.get("choices") or [], q.get("choices") or [], found)
        compare_usage(v.get("usage"), q.get("usage"), found)
        pv, pq = prompt_logprob_shape(v.get("prompt_logprobs")), q.get("prompt_logprobs")
        if pv is not None and pv != prompt_logprob_shape(pq):  # chat: beside the choices
            found.append(f"prompt_logprobs: vLLM {pv}, inferq {prompt_logprob_shape(pq)}")
    elif case.path in ("/tokenize", "/detokenize"):
        for key in ("tokens", "count", "max_model_len", "prompt"):
            if isinstance(v, dict) and key in v and isinstance(q, dict) and q.get(key) != v[key]:
                found.append(f"{key}: vLLM {v[key]!r}, inferq {q.get(key)!r}")
    elif case.path == "/v1/models" and isinstance(v, dict) and isinstance(q, dict):
        mv = [(m.get("id"), m.get("max_model_len")) for m in v.get("data", [])]
        mq = [(m.get("id"), m.get("max_model_len")) for m in q.get("data", [])]
        if mv != mq:
            found.append(f"models (id, max_model_len): vLLM {mv}, inferq {mq}")
    return found


def envelope_problems(body: Any) -> list[str]:
    """OpenAI's error envelope: ``{"error": {"message", "type", "param", "code"}}``."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return [f"refusal without OpenAI's envelope: {body!r}"]
    missing = {"message", "type", "param", "code"} - set(error)
    if missing or not isinstance(error.get("message"), str):
        return [f"error envelope lacks {sorted(missing)} or a message: {error!r}"]
    return []


def compare_keys(v: Any, q: Any, at: str, found: list[str]) -> None:
    """inferq (``q``) has every key vLLM (``v``) gives a non-null value, and none vLLM lacks
    (``EXTRA_KEYS`` aside); recursively, lists item by item."""
    if isinstance(v, dict):
        if not isinstance(q, dict):
            found.append(f"{at or 'body'}: vLLM has an object, inferq {type(q).__name__}")
            return
        missing = sorted(k for k, x in v.items() if x is not None and k not in q)
        where = re.sub(r"\[\d+\]", "[]", at)
        extra = sorted(
            k
            for k in q
            if k not in v and k not in EXTRA_KEYS and f"{where}.{k}".lstrip(".") not in EXTRA_PATHS
        )
        if missing:
            found.append(f"{at or 'body'}: inferq lacks {missing}")
        if extra:
            found.append(f"{at or 'body'}: inferq has keys vLLM has not: {extra}")
        for k, x in v.items():
            if x is not None and k in q and q[k] is not None:
                # top_logprobs maps tokens to logprobs on completions: keys are data there.
                if k == "top_logprobs" and isinstance(x, list) and at.endswith("logprobs"):
                    continue
                compare_keys(x, q[k], f"{at}.{k}" if at else k, found)
            elif x is not None and k in q:
                found.append(f"{at}.{k}: vLLM has a value, inferq null")
    elif isinstance(v, list):
        if not isinstance(q, list):
            found.append(f"{at}: vLLM has a list, inferq {type(q).__name__}")
            return
        for i, (x, y) in enumerate(zip(v, q, strict=False)):
            compare_keys(x, y, f"{at}[{i}]", found)


def _text(choice: dict[str, Any]) -> str | None:
    if "text" in choice:
        return str(choice["text"])
    part = choice.get("message") or choice.get("delta") or {}
    content = part.get("content")
    return None if content is None else str(content)


def _calls(choice: dict[str, Any]) -> list[tuple[Any, Any]]:
    message = choice.get("message") or {}
    return [
        (c.get("function", {}).get("name"), c.get("function", {}).get("arguments"))
        for c in message.get("tool_calls") or []
    ]


def compare_choices(
    case: Case, v: list[dict[str, Any]], q: list[dict[str, Any]], found: list[str]
) -> None:
    iv, iq = [c.get("index") for c in v], [c.get("index") for c in q]
    if iv != iq:
        found.append(f"choice indexes: vLLM {iv}, inferq {iq}")
        return
    if not case.greedy:
        return
    for cv, cq in zip(v, q, strict=True):
        i = cv.get("index")
        if _text(cv) != _text(cq):
            found.append(f"choice {i} text: vLLM {_text(cv)!r}, inferq {_text(cq)!r}")
        if cv.get("finish_reason") != cq.get("finish_reason"):
            found.append(
                f"choice {i} finish_reason: vLLM {cv.get('finish_reason')!r}, "
                f"inferq {cq.get('finish_reason')!r}"
            )
        if _calls(cv) != _calls(cq):
            found.append(f"choice {i} tool calls: vLLM {_calls(cv)}, inferq {_calls(cq)}")
        if cv.get("stop_reason") is not None and cv["stop_reason"] != cq.get("stop_reason"):
            found.append(
                f"choice {i} stop_reason: vLLM {cv['stop_reason']!r}, "
                f"inferq {cq.get('stop_reason')!r}"
            )
        for what, pv, pq in (
            ("logprobs", logprob_shape(cv.get("logprobs")), logprob_shape(cq.get("logprobs"))),
            (
                "prompt_logprobs",
                prompt_logprob_shape(cv.get("prompt_logprobs")),
                prompt_logprob_shape(cq.get("prompt_logprobs")),
            ),
        ):
            if pv is not None and pv != pq:
                found.append(f"choice {i} {what}: vLLM {pv}, inferq {pq}")


def logprob_shape(logprobs: Any) -> Any:
    """What greedy logprobs must agree on (values aside: a float may differ in its last bits
    between two engine runs): completions' tokens, text offsets and the number of alternatives
    per token (null where null); chat's tokens and number of alternatives."""
    if not isinstance(logprobs, dict):
        return None
    if "content" in logprobs:
        return [(t.get("token"), len(t.get("top_logprobs") or [])) for t in logprobs["content"]]
    tops = logprobs.get("top_logprobs") or []
    return {
        "tokens": logprobs.get("tokens"),
        "text_offset": logprobs.get("text_offset"),
        "alternatives": [None if t is None else len(t) for t in tops],
        "nulls": [i for i, x in enumerate(logprobs.get("token_logprobs") or []) if x is None],
    }


def prompt_logprob_shape(entries: Any) -> Any:
    """vLLM's ``prompt_logprobs``: per prompt token null, or the token ids it maps (sorted)."""
    if not isinstance(entries, list):
        return None
    return [None if e is None else sorted(e, key=str) for e in entries]


def compare_usage(v: Any, q: Any, found: list[str]) -> None:
    if v is None:
        return
    if not isinstance(q, dict):
        found.append(f"usage: vLLM {v}, inferq {q!r}")
        return
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    cv, cq = {k: v.get(k) for k in counts}, {k: q.get(k) for k in counts}
    if cv != cq:
        found.append(f"usage: vLLM {cv}, inferq {cq}")


def _union(events: list[Any]) -> dict[str, Any]:
    """One object with every key any chunk had (a non-null value wins), choices merged by
    position into one, so that chunks are compared by the keys they use at all."""
    merged: dict[str, Any] = {}
    for event in events:
        if isinstance(event, dict):
            _merge(merged, event)
    return merged


def _merge(into: dict[str, Any], event: dict[str, Any]) -> None:
    for k, x in event.items():
        held = into.get(k)
        sub: dict[str, Any] = held if isinstance(held, dict) else {}
        if isinstance(x, dict):
            _merge(sub, x)
            into[k] = sub
        elif isinstance(x, list) and x and all(isinstance(i, dict) for i in x):
            for item in x:
                _merge(sub, item)
            into[k] = sub
        elif k not in into or (x is not None and x != []):
            # An empty list (the usage chunk's choices) or a null keeps what other chunks had.
            into[k] = x


def stream_summary(events: list[Any]) -> dict[str, Any]:
    """What a stream said: choice indexes in first-seen order, text per index, finish reason
    per index, the last usage, whether ``[DONE]`` ended it."""
    order: list[int] = []
    text: dict[int, str] = {}
    finish: dict[int, Any] = {}
    usage = None
    for event in events:
        if not isinstance(event, dict):
            continue
        if event.get("usage"):
            usage = event["usage"]
        for c in event.get("choices") or []:
            i = c.get("index")
            if i not in order:
                order.append(i)
            text[i] = text.get(i, "") + (_text(c) or "")
            if c.get("finish_reason") is not None:
                finish[i] = c["finish_reason"]
    return {
        "indexes": order,
        "text": text,
        "finish": finish,
        "usage": usage,
        "done": bool(events) and events[-1] == "[DONE]",
    }


def stream_differences(case: Case, v: list[Any], q: list[Any]) -> list[str]:
    found: list[str] = []
    compare_keys(_union(v), _union(q), "chunks", found)
    sv, sq = stream_summary(v), stream_summary(q)
    if not sq["done"]:
        found.append("inferq's stream does not end with [DONE]")
    if sorted(sv["indexes"]) != sorted(sq["indexes"]):
        found.append(f"stream choice indexes: vLLM {sv['indexes']}, inferq {sq['indexes']}")
    compare_usage(sv["usage"], sq["usage"], found)
    if case.greedy:
        for i in sv["indexes"]:
            if sv["text"].get(i) != sq["text"].get(i):
                found.append(
                    f"stream choice {i} text: vLLM {sv['text'].get(i)!r}, "
                    f"inferq {sq['text'].get(i)!r}"
                )
            if sv["finish"].get(i) != sq["finish"].get(i):
                found.append(
                    f"stream choice {i} finish_reason: vLLM {sv['finish'].get(i)!r}, "
                    f"inferq {sq['finish'].get(i)!r}"
                )
    return found


# --- the summary of one server's answers ----------------------------------------------------


def key_paths(value: Any, at: str = "") -> dict[str, str]:
    """Every key path of a JSON value -> "null" or its type, lists merged over their items."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for k, x in value.items():
            k = "<token id>" if k.isdigit() else k  # prompt_logprobs: {id: {...}}
            path = f"{at}.{k}" if at else k
            if out.get(path) not in (None, "null"):
                out.update(key_paths(x, path))
                continue
            out[path] = "null" if x is None else type(x).__name__
            if not (k == "top_logprobs" and isinstance(x, list) and at.endswith("logprobs")):
                out.update(key_paths(x, path))
    elif isinstance(value, list):
        for item in value:
            for path, kind in key_paths(item, f"{at}[]").items():
                if out.get(path) in (None, "null"):
                    out[path] = kind
    return out
