"""The engine protocol every backend implements, and the types that cross it.

An engine is driven from one asyncio event loop (the runner's). ``generate`` streams deltas and
ends with a chunk that carries ``finish_reason``; many ``generate`` calls are in flight at once,
and an engine with continuous batching batches them at every step. An engine of a pooling
model (its ``task`` embed or score) serves ``pool`` instead: a job's inputs go to the engine
together, each its own engine request (vLLM's), so they are batched with everything in flight.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.core.contract.chat_template import developer_as_system, supports_developer


@dataclass(frozen=True)
class GenRequest:
    request_id: str
    # A completion's prompt: its text, or its token ids (handed to the engine as tokens, vLLM's
    # ``TokensPrompt``: never re-tokenized).
    prompt: str | Sequence[int] | None = None
    messages: Sequence[dict[str, Any]] | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    stop: Sequence[str] = ()
    seed: int | None = None
    priority: int = 1  # lower runs first (vLLM's convention)
    arrival: float = 0.0
    # The other sampling options the caller set, by ``SamplingParams``' names (top_k, min_p,
    # logit_bias, ...: app/core/contract/params.py ``JobParams``); absent ones are at their
    # defaults.
    options: Mapping[str, Any] = field(default_factory=dict)
    # A chat's tools, tool_choice and parallel_tool_calls (``jobs.tools``); the chat template
    # shows the tools to the model, and workers/inference/tools.py finds the calls in the output.
    tools: Mapping[str, Any] | None = None
    # A LoRA adapter of this engine's model the job names (docs/scheduling.md, "Many models"), and
    # its directory; a name without a path is one this worker does not have.
    adapter: str | None = None
    adapter_path: str | None = None
    # ``echo``: each choice's output starts with what the request's prompt was (echo_text); the
    # engine says it on its first chunk (``GenChunk.prompt_text``) and the runner puts it in
    # front of every choice.
    echo: bool = False
    # Several prompts in one request (a completion's list of prompts): the runner runs one
    # engine request per prompt (``prompt`` set to it, ``prompts`` empty) and numbers the
    # choices prompt by prompt, ``n`` each (workers/inference/runner.py). Engines never see it.
    prompts: Sequence[str | Sequence[int]] = ()

    @property
    def tool_choice(self) -> str | dict[str, str]:
        return "none" if self.tools is None else self.tools["tool_choice"]


@dataclass(frozen=True)
class PoolRequest:
    """A pooled job for the engine (docs/engines.md, "Pooling models"): ``inputs`` to embed
    (texts, or lists of token ids), or ``pairs`` (query, document) to score."""

    request_id: str
    task: str  # "embed" or "score" (app.core.models.JobKind)
    inputs: Sequence[str | Sequence[int]] = ()
    pairs: Sequence[tuple[str, str]] = ()
    # vLLM's pooling options the caller set: dimensions, truncate_prompt_tokens, use_activation.
    options: Mapping[str, Any] = field(default_factory=dict)
    priority: int = 1  # lower runs first (vLLM's convention)
    arrival: float = 0.0


@dataclass
class PoolResult:
    """What the engine pooled: one row of ``width`` float32 values per input, in input order,
    packed as ``Job.pooled`` stores them (app/core/contract/pooling.py, ``pack``). An input
    the engine refused on its own (too long, a token id out of range) has a row of zeros and
    its error in ``errors``; the others are unaffected."""

    data: bytes
    width: int
    prompt_tokens: int
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)  # index -> (code, message)
    counts: list[int] = field(default_factory=list)  # each input's prompt tokens (0: refused)
    finished_at: float | None = None
    abort_reason: str | None = None  # set when the runner stopped it: cancelled, deadline, ...


@dataclass
class GenChunk:
    text: str
    num_tokens: int
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    index: int = 0  # which choice (a request with ``n`` > 1 has several)
    # With ``logprobs`` asked: one ``token_logprob`` per token of ``text``.
    logprobs: list[dict[str, Any]] | None = None
    # The ids of the tokens of ``text`` (an engine that has them): tool parsers read them.
    token_ids: Sequence[int] = ()
    # On a choice's last chunk: the stop string (or stop token id) that ended it, None when it
    # ended otherwise (vLLM's ``stop_reason``).
    stop_reason: str | int | None = None
    # On the request's first chunk only (whichever choice it is for):
    # - with ``req.echo``: what every choice's output starts with (echo_text);
    prompt_text: str | None = None
    # - with ``options["prompt_logprobs"]`` (k): one prompt_token_logprob per prompt token, in
    #   order, the first with no logprob (nothing precedes it), each with its k best
    #   alternatives (vLLM's ``RequestOutput.prompt_logprobs``).
    prompt_logprobs: list[dict[str, Any]] | None = None


@dataclass
class ToolDelta:
    """What one piece of a choice's output adds to its message: ``content`` and pieces of
    ``calls``, OpenAI's ``delta.tool_calls`` entries (``index``; ``id``, ``type`` and the
    function's ``name`` on a call's first piece; pieces of ``arguments``)."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolStream(Protocol):
    """The calls in one choice's output as it streams (``Engine.tool_stream``)."""

    def feed(self, text: str, token_ids: Sequence[int], finished: bool) -> ToolDelta:
        """The message's part of the next piece of output (``finished``: the last one)."""
        ...


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None
    generated_tokens_per_s: float = 0.0
    # Prompt tokens looked up in the prefix cache and found there, since the engine started
    # (vLLM's prefix caching; 0 for an engine without one). Hit rate: hits / queries.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def token_logprob(
    token: str, logprob: float, top: Sequence[tuple[str, float]] = ()
) -> dict[str, Any]:
    """One output token's log-probability and its ``top`` alternatives, best first: the shape
    a job stores and shows (OpenAI's chat ``logprobs.content`` item, less ``bytes``)."""
    return {
        "token": token,
        "logprob": logprob,
        "top_logprobs": [{"token": t, "logprob": lp} for t, lp in top],
    }


def prompt_token_logprob(
    token_id: int,
    token: str,
    logprob: float | None,
    rank: int | None,
    top: Sequence[tuple[int, str, float, int]] = (),
) -> dict[str, Any]:
    """One prompt token's log-probability given the tokens before it (None for the first), its
    rank among the vocabulary, and its ``top`` alternatives (id, text, logprob, rank), best
    first: what ``GenChunk.prompt_logprobs`` holds and a choice stores as ``prompt_logprobs``
    (rendered as OpenAI's echo logprobs and as vLLM's ``prompt_logprobs``:
    app/core/openai/openai_format.py). -inf is -9999.0, as vLLM's server writes it."""
    return {
        "token_id": token_id,
        "token": token,
        "logprob": None if logprob is None else max(logprob, -9999.0),
        "rank": rank,
        "top_logprobs": [
            {"token_id": i, "token": t, "logprob": max(lp, -9999.0), "rank": r}
            for i, t, lp, r in top
        ],
    }


def token_prompt(req: GenRequest) -> list[int] | None:
    """A completion's prompt of token ids, as they are (None: a text or a chat); an empty one
    fails the request as vLLM fails it."""
    if req.messages is not None or req.prompt is None or isinstance(req.prompt, str):
        return None
    if not req.prompt:
        raise EngineRequestError("invalid_request", "The decoder prompt cannot be empty")
    return list(req.prompt)


def echo_text(req: GenRequest, decode: Callable[[Sequence[int]], str]) -> str:
    """What an ``echo`` request's choices start with, as vLLM's server shows it: a completion's
    prompt (token ids decoded by the engine's tokenizer, ``decode``); of a chat, the last
    message's content if it is the assistant's (the reply continues it), else nothing."""
    if req.messages is not None:
        last = req.messages[-1] if req.messages else {}
        content = last.get("content") if last.get("role") == "assistant" else None
        return content if isinstance(content, str) else ""
    ids = token_prompt(req)
    return decode(ids) if ids is not None else str(req.prompt or "")


class EngineRequestError(Exception):
    """This request cannot run (bad input for this model); other requests are unaffected."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def refuse_options(req: GenRequest, honoured: frozenset[str], engine: str) -> None:
    """An engine that cannot honour a sampling option the request sets fails that request (as
    ``invalid_request``, naming the option) rather than quietly sampling without it."""
    missing = sorted(set(req.options) - honoured)
    if req.tool_choice != "none" and "tools" not in honoured:
        missing.append("tools")
    if missing:
        raise EngineRequestError(
            "invalid_request",
            f"{', '.join(missing)}: not supported by the {engine} engine (vLLM supports it)",
        )


def check_adapter(req: GenRequest, model_name: str) -> None:
    """Refuse a request for an adapter this worker was not given for its model (a deployment
    whose API and workers disagree on ``INFERQ_ADAPTERS``)."""
    if req.adapter is not None and req.adapter_path is None:
        raise EngineRequestError(
            "model_not_found",
            f"{req.adapter!r} is no LoRA adapter of {model_name!r} on this worker "
            "(INFERQ_ADAPTERS)",
        )


def wrong_task(engine: str, model: str, task: str, asked: str) -> EngineRequestError:
    """What an engine raises for a job its model's task cannot run (the API refuses such a job
    before it is written; a worker can still meet one whose model changed task since)."""
    return EngineRequestError(
        "wrong_task", f"the {engine} engine runs {model!r} as a {task} model, not to {asked}"
    )


class EngineDeadError(Exception):
    """The engine cannot serve anything any more; the worker must stop."""


# Called by the engine after each step with (sequences in the step, tokens it generated); the
# worker points it at its metrics (workers/metrics.py).
StepObserver = Callable[[int, int], None]


class TokenWindow:
    """Tokens generated in the last ``window`` seconds, step by step, with their sum kept as
    steps come and go: the worker reads an engine's stats at every step (its intake), and
    summing the window each time cost a step O(the steps in the window), quadratic for an
    engine as fast as the simulated one at time scale 0. Any thread may add or read."""

    def __init__(self, window: float = 5.0) -> None:
        self.window = window
        self._steps: deque[tuple[float, int]] = deque()
        self._total = 0
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._steps.append((time.monotonic(), tokens))
            self._total += tokens

    def read(self) -> tuple[int, float | None]:
        """(tokens in the window, how long ago its oldest step was; None when it has none)."""
        now = time.monotonic()
        with self._lock:
            while self._steps and self._steps[0][0] < now - self.window:
                self._total -= self._steps.popleft()[1]
            return self._total, (now - self._steps[0][0]) if self._steps else None

    def per_s(self) -> float:
        """Tokens a second over the whole window."""
        return self.read()[0] / self.window


def ignore_step(sequences: int, tokens: int) -> None:
    """The observer until the worker sets one (benchmarks and tests drive engines bare)."""


class Engine(Protocol):
    name: str
    model_name: str
    # What the model does: generate, embed or score (app.core.models.JobKind), known once
    # start() has returned; an engine serves ``generate`` or ``pool``, as its task says.
    task: str
    # An embedding model's vectors: how many dimensions, and whether ``dimensions`` may cut
    # them (a matryoshka model); None and False otherwise. Known once start() has returned.
    embed_dim: int | None
    matryoshka: bool
    continuous_batching: bool
    # The engine's compute runs in processes of its own (vLLM's EngineCore), not in this one.
    own_processes: bool

    # The context length in tokens, known once start() has returned.
    max_model_len: int
    # vLLM's parser of the model's tool calls (``tool_choice: auto``), if it has one.
    tool_parser: str | None
    on_step: StepObserver

    async def start(self) -> None: ...

    def tokenizer_json(self) -> str | None:
        """The tokenizer as a ``tokenizer.json`` for the API to count prompts with
        (app/core/scheduling/tokens.py; ``WORDS``: the simulated word counter); None where there
        is none."""
        ...

    def chat_template(self) -> dict[str, Any] | None:
        """The model's chat template for the API to render chats with (``POST /tokenize``'s
        ``messages``; chat_template_card's shape); None where chats are not rendered by one."""
        ...

    def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]: ...

    async def pool(self, req: PoolRequest) -> PoolResult:
        """Embed or score ``req``'s inputs, all of them in flight at once (an engine whose task
        is not ``req.task`` raises EngineRequestError)."""
        ...

    def extract_tool_calls(
        self, text: str, tools: Sequence[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """The model's own tool calls in ``text`` (``tool_choice: auto``): the content around
        them and the calls (``name`` and ``arguments``, a JSON text). Only an engine with a
        tool parser is asked (one that honours ``tools`` with ``auto``)."""
        ...

    def tool_stream(self, tools: Mapping[str, Any]) -> ToolStream:
        """A parser of one streamed choice's calls under ``tools`` (``jobs.tools``), as the
        engine's server streams them: what ``extract_tool_calls`` finds in the whole text, found
        piece by piece. Only an engine that honours ``tools`` is asked."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    async def shutdown(self) -> None: ...


FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A stored message as chat templates read it: a call's arguments as an object, as vLLM's
    server hands them over (templates write them with ``tojson``)."""
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = dict(call["function"])
        with contextlib.suppress(ValueError):
            function["arguments"] = json.loads(function["arguments"])
        calls.append({**call, "function": function})
    return {**message, "tool_calls": calls}


def chat_template_card(tokenizer: Any) -> dict[str, Any] | None:
    """What the API renders chats with (``Engine.chat_template``): the tokenizer's chat
    template (``templates``: its one template under ``""``, or its named ones), the special
    tokens transformers hands every template (``special_tokens``: bos_token, eos_token, ...),
    and how each template reads a message's content (``formats``: vLLM's detection, "string"
    or "openai"; None where vLLM is not installed to tell). None without a template."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not template:
        return None
    templates = dict(template) if isinstance(template, dict) else {"": str(template)}
    try:
        from vllm.renderers.hf import _detect_content_format

        formats: dict[str, str | None] = {
            name: _detect_content_format(text, default="string") for name, text in templates.items()
        }
    except ImportError:
        formats = dict.fromkeys(templates)
    special = {
        k: v
        for k, v in dict(getattr(tokenizer, "special_tokens_map", {}) or {}).items()
        if isinstance(v, str | list)
    }
    return {"templates": templates, "formats": formats, "special_tokens": special}


def render_chat(
    messages: Sequence[dict[str, Any]],
    tokenizer: Any = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """Turn chat messages into one prompt: the tokenizer's chat template (given the tools),
    else a plain one. A ``developer`` message meets a template that does not know the role as
    vLLM's server hands it over (developer_as_system)."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        template = tokenizer.get_chat_template(None, tools=list(tools) if tools else None)
        if any(m["role"] == "developer" for m in messages) and not supports_developer(template):
            messages = developer_as_system(messages)
        rendered = tokenizer.apply_chat_template(
            [_for_template(m) for m in messages],
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=True,
        )
        return str(rendered)
    parts = [f"<|{m['role']}|>\n{m.get('content') or ''}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def hf_tokenizer_json(tokenizer: Any) -> str | None:
    """A transformers (or vLLM) tokenizer's ``tokenizer.json``; None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return None if backend is None else str(backend.to_str())


def prompt_text(req: GenRequest, tokenizer: Any = None) -> str:
    """The request's prompt as text: a chat rendered, a completion's text. A prompt of token
    ids has none: the engine hands the ids over as they are (it checks for them first)."""
    if req.messages is not None:
        return render_chat(req.messages, tokenizer, req.tools["tools"] if req.tools else None)
    if token_prompt(req) is not None:
        raise TypeError("a prompt of token ids is not rendered as text")
    return str(req.prompt or "")


def apply_stop(
    text: str, stop: Sequence[str], *, include: bool = False, since: int = 0
) -> tuple[str, str | None]:
    """Cut ``text`` at the stop string that ends first after ``since`` (the text already
    checked; a tie goes to the one listed first, as vLLM's ``check_stop_strings``), after it
    with ``include`` (vLLM's ``include_stop_str_in_output``); returns (text, the stop string
    that matched or None: vLLM's ``stop_reason``)."""
    best: tuple[int, int, str] | None = None  # (end, start, the stop string)
    for s in stop:
        at = text.find(s, max(0, since - len(s) + 1))
        if at >= 0 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), at, s)
    if best is None:
        return text, None
    end, start, matched = best
    return text[: end if include else start], matched
