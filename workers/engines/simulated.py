"""A SIMULATED continuous-batching engine: an iteration-level model of vLLM's scheduler.

It exists for scheduling tests and platform benchmarks and is always reported as simulated.
Each step admits waiting requests by (priority, arrival) up to ``max_num_seqs`` and a token
budget (chunked prefill: running decodes take one token each, prefills take what is left),
costs ``base_ms + prefill_ms_per_token * prefill_tokens + decode_ms_per_seq * decoding`` of
real wall-clock time (times ``time_scale``), and emits one token per decoding sequence; a
sequence whose prefill completes in a step emits its first token in that step, as vLLM does.
Like vLLM's priority policy, a waiting request never preempts a running one.

The KV cache (``kv_cache_tokens``, 0 for unbounded) bounds the running set as a GPU's memory
does: a sequence holds the cache for its prompt and its ``max_tokens`` from the step it is
admitted, and the waiting head is admitted only while what the running sequences hold plus its
own fits::

    admit(head)  iff  running < max_num_seqs  and  Σ_running (prompt + max_tokens)
                      + head.prompt + head.max_tokens <= kv_cache_tokens

(a sequence larger than the whole cache runs alone). Its stats are the last step's schedule,
as vLLM's ``SchedulerStats``: ``running`` the sequences that step ran (those that finished in
it included), ``waiting`` those it left waiting. vLLM allocates blocks as tokens are
generated and preempts the newest sequence when they run out; reserving the whole sequence up
front gives the same number running at once for sequences that run to max_tokens, without
modelling recomputation.

Calibration of the defaults (docs/engines.md has the derivation): LambdaLabsML/vllm-benchmark
``benchmark_v0.md`` reports vLLM 0.5.4 serving Meta-Llama-3.1-8B (FP8) on one H100-80GB-SXM
at 3400.4 output tok/s with 19.75 ms inter-token latency (320 ShareGPT prompts, rate inf),
i.e. about 67 sequences decoding per step. ``base_ms=6`` (one pass over 8 GB of weights plus
launch overhead), ``decode_ms_per_seq=0.17`` and ``prefill_ms_per_token=0.035`` (16 GFLOP per
token at ~45% of 989 TFLOP/s) reproduce it: 6 + 0.17*67 = 17.4 ms, plus ~14% prefill share,
is about 19.8 ms per step, 67 / 19.8 ms = 3380 tok/s.

A prefix cache (``sim_prefix_cache`` prefixes, 0 for none) stands for vLLM's automatic
prefix caching: a prompt's prefix is a chat's leading system (or developer) messages, or a
completion prompt's first ``PREFIX_CHARS`` characters (the dispatcher's grouping key,
app/core/scheduling/fairshare.py ``prefix_of``). A sequence admitted while its prefix is held
skips the prefix's prefill (all but the prompt's last token, as vLLM always computes one); a
prefix is held once a sequence's prefill of it completed, and the least recently used is
dropped past the capacity. The engine counts prompt tokens looked up and found, as vLLM's
``prefix_cache_queries`` and ``hits``.

A pooling model (``task`` embed or score) runs a request as a sequence that prefills all its
inputs' tokens and ends in the step its prefill completes, generating nothing (vLLM's pooling
runner, which runs one request per input: the steps cost the same); its steps
cost ``sim_pool_base_ms + sim_pool_ms_per_token * tokens``, calibrated to vLLM's figure for
an embedding model of 110M parameters (PR #23000: 516k tokens/s with 16 inputs a request). Its
vectors are deterministic from the input: one of 1,024 fixed normalised vectors of ``embed_dim``
values, picked by the input's hash (``dimensions`` or ``use_activation: false``: ``embed_dim``
values from a generator seeded by the input's hash, cut, then normalised or not, as a
matryoshka model's pooler does); a score is the sigmoid of the query's and the document's
vectors' similarity, scaled.

Output text is deterministic from (prompt, seed). It does not sample, so the options that shape
the distribution (temperature, top_p, top_k, min_p, the penalties, logit_bias) change nothing;
it has no end-of-sequence token (every sequence runs to max_tokens unless a stop string ends it),
so ``ignore_eos`` holds by construction; ``min_tokens`` and ``include_stop_str_in_output`` act
as in vLLM. ``stop_token_ids`` needs a real vocabulary: a request that sets it fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import math
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.core.contract.pooling import pack
from app.core.scheduling.fairshare import PREFIX_CHARS
from app.core.scheduling.tokens import WORDS, count_words
from app.core.settings import Settings
from workers.engines.base import (
    EngineRequestError,
    EngineStats,
    GenChunk,
    GenRequest,
    PoolRequest,
    PoolResult,
    StepObserver,
    TokenWindow,
    ToolStream,
    apply_stop,
    check_adapter,
    ignore_step,
    prompt_text,
    refuse_options,
    wrong_task,
)

_WORDS = tuple(
    (
        "the queue holds every job until a worker with free capacity claims it and the engine "
        "batches many sequences in each step so that bulk work keeps the accelerator busy while "
        "realtime requests still start within milliseconds because lanes are served in strict "
        "priority order and leases make sure nothing is lost when a process dies"
    ).split()
)


@dataclass(frozen=True)
class CostModel:
    """The step-cost model; its defaults live in settings (``INFERQ_SIM_*``)."""

    base_ms: float
    prefill_ms_per_token: float
    decode_ms_per_seq: float
    max_num_seqs: int
    max_num_batched_tokens: int
    time_scale: float = 1.0
    kv_cache_tokens: int = 0
    prefix_cache: int = 0  # prefixes held (an LRU); 0: no prefix cache

    @classmethod
    def from_settings(
        cls, settings: Settings, *, pooling: bool = False, **overrides: float
    ) -> CostModel:
        values = {
            "base_ms": settings.sim_pool_base_ms if pooling else settings.sim_base_ms,
            "prefill_ms_per_token": settings.sim_pool_ms_per_token
            if pooling
            else settings.sim_prefill_ms_per_token,
            "decode_ms_per_seq": settings.sim_decode_ms_per_seq,
            "max_num_seqs": settings.sim_max_num_seqs,
            "max_num_batched_tokens": settings.sim_max_num_batched_tokens,
            "time_scale": settings.sim_time_scale,
            "kv_cache_tokens": settings.sim_kv_cache_tokens,
            "prefix_cache": 0 if pooling else settings.sim_prefix_cache,
            **overrides,
        }
        return cls(**values)  # type: ignore[arg-type]

    def step_ms(self, prefill_tokens: int, decoding: int) -> float:
        return (
            self.base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_seq * decoding
        )


# The vectors a simulated scoring model compares a query's and a document's by.
SCORE_DIM = 64
# The fixed vectors a simulated embedding model picks from by an input's hash: built once per
# engine (0.25 s for 384 dimensions), after which an embedding costs a hash and a byte copy.
VECTORS = 1024
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_MASK64 = (1 << 64) - 1


@dataclass(eq=False)
class _Seq:
    req: GenRequest
    prompt_tokens: int
    prefill_left: int
    # Its words' generator: a 64-bit linear congruential one (MMIX's constants), seeded from
    # the prompt and the seed. A random.Random per request cost more than the rest of a
    # one-token request here (docs/benchmarks.md, "ceiling"): this engine should cost nothing.
    state: int
    out: asyncio.Queue[GenChunk] = field(default_factory=asyncio.Queue)
    generated: int = 0
    pooled: bool = False  # an input of a pooling request: it ends when its prefill does
    prefix: str = ""  # its prompt's prefix (the prefix cache's key), '' for none
    prefix_tokens: int = 0

    @property
    def kv_held(self) -> int:
        """The KV cache this sequence holds while it runs: its prompt and its max_tokens."""
        return self.prompt_tokens + self.req.max_tokens

    text: str = ""
    done: bool = False


# See the module docstring: what this engine honours, or has no use for.
HONOURED = frozenset(
    {
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    }
)


def _prefix(req: GenRequest) -> str:
    """The part of a request's prompt that others share (the prefix cache's key): a chat's
    leading system or developer messages, or a long completion prompt's first characters."""
    if req.messages is not None:
        lead = []
        for message in req.messages:
            if message.get("role") not in ("system", "developer"):
                break
            content = message.get("content")
            lead.append(content if isinstance(content, str) else str(content))
        return "\n".join(lead)
    prompt = req.prompt or ""
    return prompt[:PREFIX_CHARS] if len(prompt) > PREFIX_CHARS else ""


class SimulatedEngine:
    """SIMULATED engine; see the module docstring."""

    name = "simulated"
    continuous_batching = True
    own_processes = False
    tool_parser: str | None = None  # tool_choice auto is refused (refuse_options)

    def __init__(
        self,
        cost: CostModel,
        model_name: str = "simulated",
        max_model_len: int = 131_072,
        *,
        task: str = "generate",
        embed_dim: int = 384,
    ) -> None:
        self.cost = cost
        self.model_name = model_name
        self.task = task
        self.embed_dim: int | None = embed_dim if task == "embed" else None
        self._table: bytes | None = None  # see _row
        self.matryoshka = task == "embed"  # its vectors may be cut (see the module docstring)
        # Like vLLM, a prompt longer than the context fails its own request only.
        self.max_model_len = max_model_len
        self._waiting: list[tuple[int, int, _Seq]] = []
        self._running: list[_Seq] = []
        self._by_id: dict[str, _Seq] = {}
        self._order = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._emitted = TokenWindow()
        # The last step's schedule, as vLLM's SchedulerStats reports it: the sequences it ran
        # (those that finished in it included) and those left waiting after it was planned.
        self._scheduled: tuple[list[_Seq], int] = ([], 0)
        self.steps = 0
        # The largest batch a step has run since the start, kept as it goes: stats() runs at
        # every step (the intake's look), where a max over past steps was most of its cost.
        self.max_batch = 0
        self.on_step: StepObserver = ignore_step
        self._prefixes: OrderedDict[str, None] = OrderedDict()  # the prefix cache, LRU first
        self.prefix_queries = 0
        self.prefix_hits = 0

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="simulated-engine")

    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        assert self._wake is not None, "start() first"
        if self.task != "generate":
            raise wrong_task(self.name, self.model_name, self.task, "generate")
        refuse_options(req, HONOURED, self.name)
        check_adapter(req, self.model_name)
        text = prompt_text(req)
        # An adapter changes the model's output, so it changes the simulated text too.
        seed = f"{req.seed or 0}\x00{req.adapter or ''}\x00{text}"
        digest = hashlib.sha256(seed.encode()).digest()
        tokens = count_words(text)
        if tokens >= self.max_model_len:  # vLLM's rule: room for one output token
            raise EngineRequestError(
                "context_length_exceeded",
                f"the prompt has {tokens} tokens; this model's context is {self.max_model_len}",
            )
        seq = _Seq(req, tokens, tokens, int.from_bytes(digest[:8], "big"))
        if self.cost.prefix_cache:
            seq.prefix = _prefix(req)
            seq.prefix_tokens = min(count_words(seq.prefix), tokens - 1) if seq.prefix else 0
        self._by_id[req.request_id] = seq
        heapq.heappush(self._waiting, (req.priority, next(self._order), seq))
        self._wake.set()
        try:
            while True:
                chunk = await seq.out.get()
                yield chunk
                if chunk.finish_reason is not None:
                    return
        finally:
            # A consumer that stops early (cancelled, deadline) aborts the sequence.
            self._finish(seq, "abort", emit=False)

    async def pool(self, req: PoolRequest) -> PoolResult:
        assert self._wake is not None, "start() first"
        if req.task != self.task:
            raise wrong_task(self.name, self.model_name, self.task, req.task)
        dimensions = req.options.get("dimensions")
        width = self.embed_dim or 1
        if dimensions is not None and not 1 <= dimensions <= width:
            raise EngineRequestError(
                "invalid_request", f"dimensions must be 1 to {width} for this model (matryoshka)"
            )
        texts: list[str] = (
            [t if isinstance(t, str) else " ".join(map(str, t)) for t in req.inputs]
            if req.task == "embed"
            else [f"{q}\x00{d}" for q, d in req.pairs]
        )
        counts = [count_words(t) if isinstance(t, str) else len(t) for t in req.inputs] or [
            count_words(q) + count_words(d) for q, d in req.pairs
        ]
        truncate = req.options.get("truncate_prompt_tokens")
        if truncate is not None:
            most = self.max_model_len if truncate == -1 else min(truncate, self.max_model_len)
            counts = [min(n, most) for n in counts]
        errors = {
            i: (
                "context_length_exceeded",
                f"the input has {n} tokens; this model's limit is {self.max_model_len}",
            )
            for i, n in enumerate(counts)
            if n > self.max_model_len  # a pooler's input must fit whole: it generates nothing
        }
        prefill = sum(n for i, n in enumerate(counts) if i not in errors)
        if prefill:
            # One sequence for the request's inputs, whose prefill is all their tokens: the
            # steps cost what vLLM's (one request per input) would, as the token budget splits
            # them; only the count of running sequences differs.
            sub = GenRequest(req.request_id, max_tokens=0, priority=req.priority)
            seq = _Seq(sub, prefill, prefill, 0, pooled=True)
            self._by_id[sub.request_id] = seq
            heapq.heappush(self._waiting, (req.priority, next(self._order), seq))
            self._wake.set()
            try:
                await seq.out.get()
            finally:  # cancelled (an abort, a deadline): it ends here
                self._finish(seq, "abort", emit=False)
        width = 1 if req.task == "score" else (dimensions or width)
        counted = [0 if i in errors else n for i, n in enumerate(counts)]
        if (
            req.task == "embed"
            and dimensions is None
            and req.options.get("use_activation") is not False
        ):
            # The common case, as cheap as a byte copy: the engine should cost nothing at time
            # scale 0, where the bench measures the platform's own ceiling.
            zeros = bytes(4 * width)
            data = b"".join(zeros if i in errors else self._row(t) for i, t in enumerate(texts))
            return PoolResult(data, width, sum(counted), errors, counted, time.time())
        values = array("f")
        for i, text in enumerate(texts):
            if i in errors:
                values.extend([0.0] * width)
            elif req.task == "score":
                query, document = req.pairs[i]
                similarity = sum(
                    a * b for a, b in zip(self._vector(query), self._vector(document), strict=True)
                )
                values.append(1.0 / (1.0 + math.exp(-8.0 * similarity)))
            else:
                values.extend(self._vector(text, dimensions, req.options.get("use_activation")))
        return PoolResult(pack(values), width, sum(counted), errors, counted, time.time())

    def _row(self, text: str) -> bytes:
        """An input's normalised vector, packed: one of ``VECTORS`` fixed ones, picked by the
        input's hash (the same input always gets the same vector)."""
        if self._table is None:
            self._table = b"".join(pack(self._vector(f"row {k}")) for k in range(VECTORS))
        size = 4 * (self.embed_dim or SCORE_DIM)
        at = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
        return self._table[at % VECTORS * size : at % VECTORS * size + size]

    def _vector(
        self, text: str, dimensions: int | None = None, normalise: bool | None = None
    ) -> list[float]:
        """An input's vector: ``embed_dim`` values seeded by its hash, cut to ``dimensions``
        and normalised (unless ``normalise`` is False), as a matryoshka model's pooler does."""
        state = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")
        vector = []
        for _ in range(dimensions or self.embed_dim or SCORE_DIM):
            state = (state * _LCG_A + _LCG_C) & _MASK64
            vector.append((state >> 11) / (1 << 52) - 1.0)
        if normalise is False:
            return vector
        norm = math.sqrt(sum(v * v for v in vector)) or 1.0
        return [v / norm for v in vector]

    async def abort(self, request_id: str) -> None:
        seq = self._by_id.get(request_id)
        if seq is not None:
            self._finish(seq, "abort")

    def extract_tool_calls(
        self, text: str, tools: Sequence[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        # Never asked: generate refuses tools (refuse_options), as this engine has no parser.
        raise EngineRequestError("invalid_request", "tools: not supported by the simulated engine")

    def tool_stream(self, tools: Mapping[str, Any]) -> ToolStream:
        # Never asked either (generate refuses tools).
        raise EngineRequestError("invalid_request", "tools: not supported by the simulated engine")

    def tokenizer_json(self) -> str:
        return WORDS

    def stats(self) -> EngineStats:
        tokens, age = self._emitted.read()
        span = max(1.0, min(5.0, age)) if age is not None else 5.0
        running, waiting = self._scheduled
        if self.cost.kv_cache_tokens:
            kv = sum(s.kv_held for s in running) / self.cost.kv_cache_tokens
        else:
            kv = sum(s.prompt_tokens + s.generated for s in running) / (
                self.cost.max_num_batched_tokens * 64
            )
        return EngineStats(
            running=len(running),
            waiting=waiting,
            kv_cache_usage=min(1.0, kv),
            generated_tokens_per_s=tokens / span,
            prefix_cache_queries=self.prefix_queries,
            prefix_cache_hits=self.prefix_hits,
            extra={
                "simulated": True,
                "steps": self.steps,
                "max_batch": self.max_batch,
            },
        )

    async def shutdown(self) -> None:
        for seq in list(self._by_id.values()):
            self._finish(seq, "abort")
        if self._task is not None:
            self._task.cancel()

    def _finish(self, seq: _Seq, reason: str, *, emit: bool = True) -> None:
        if seq.done:
            return
        seq.done = True
        self._by_id.pop(seq.req.request_id, None)
        if emit:
            seq.out.put_nowait(GenChunk("", 0, reason, seq.prompt_tokens))

    def _plan(self) -> tuple[list[_Seq], int]:
        """Schedule one step: returns the sequences that emit a token (or, pooled, end) and the
        prefill tokens."""
        cost = self.cost
        self._running = [s for s in self._running if not s.done]
        emitting = [s for s in self._running if s.prefill_left == 0]
        budget = cost.max_num_batched_tokens - len(emitting)
        prefill = 0
        for seq in self._running:
            if seq.prefill_left and budget > 0:
                take = min(seq.prefill_left, budget)
                seq.prefill_left -= take
                budget -= take
                prefill += take
                if seq.prefill_left == 0:
                    emitting.append(seq)
        held = sum(s.kv_held for s in self._running)
        while self._waiting and len(self._running) < cost.max_num_seqs and budget > 0:
            head = self._waiting[0][2]
            if head.done:
                heapq.heappop(self._waiting)
                continue
            full = cost.kv_cache_tokens and held + head.kv_held > cost.kv_cache_tokens
            if full and self._running:
                break  # the head waits for cache, and so does everything behind it
            _, _, seq = heapq.heappop(self._waiting)
            held += seq.kv_held
            self._look_up(seq)
            take = min(seq.prefill_left, budget)
            seq.prefill_left -= take
            budget -= take
            prefill += take
            self._running.append(seq)
            if seq.prefill_left == 0:
                emitting.append(seq)
        self._scheduled = (list(self._running), sum(1 for *_, w in self._waiting if not w.done))
        return emitting, prefill

    def _look_up(self, seq: _Seq) -> None:
        """Admitted: a held prefix is not prefilled again (the module docstring)."""
        if not self.cost.prefix_cache or seq.pooled:
            return
        self.prefix_queries += seq.prompt_tokens
        if seq.prefix and seq.prefix in self._prefixes:
            self._prefixes.move_to_end(seq.prefix)
            seq.prefill_left -= seq.prefix_tokens
            self.prefix_hits += seq.prefix_tokens

    def _hold(self, seq: _Seq) -> None:
        """``seq``'s prefill completed: its prefix is held, the least recently used dropped."""
        if not seq.prefix:
            return
        self._prefixes[seq.prefix] = None
        self._prefixes.move_to_end(seq.prefix)
        while len(self._prefixes) > self.cost.prefix_cache:
            self._prefixes.popitem(last=False)

    def _emit(self, seq: _Seq) -> None:
        if seq.generated == 0:
            self._hold(seq)
        seq.state = (seq.state * _LCG_A + _LCG_C) & _MASK64
        word = _WORDS[(seq.state >> 33) % len(_WORDS)]
        seq.generated += 1
        piece = word if seq.generated == 1 else " " + word
        checked = len(seq.text)
        seq.text += piece
        reason = None
        # As in vLLM, stop strings apply once min_tokens have been generated, to new text only.
        if seq.req.stop and seq.generated >= seq.req.options.get("min_tokens", 0):
            keep = bool(seq.req.options.get("include_stop_str_in_output"))
            cut, stopped = apply_stop(seq.text, seq.req.stop, include=keep, since=checked)
            if stopped:
                piece = piece[: max(0, len(piece) - (len(seq.text) - len(cut)))]
                seq.text = cut
                reason = "stop"
        if reason is None and seq.generated >= seq.req.max_tokens:
            reason = "length"
        seq.out.put_nowait(GenChunk(piece, 1, reason, seq.prompt_tokens))
        if reason is not None:
            self._finish(seq, reason, emit=False)

    async def _loop(self) -> None:
        assert self._wake is not None
        next_at = time.monotonic()
        while True:
            self._waiting = [w for w in self._waiting if not w[2].done]
            heapq.heapify(self._waiting)
            if not self._waiting and not any(not s.done for s in self._running):
                self._running = []
                self._scheduled = ([], 0)
                self._wake.clear()
                await self._wake.wait()
                next_at = time.monotonic()
                continue
            emitting, prefill = self._plan()
            decoding = sum(1 for seq in emitting if not seq.pooled)
            next_at += self.cost.step_ms(prefill, decoding) * self.cost.time_scale / 1000.0
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.05:
                next_at = time.monotonic()  # fell behind (loaded host): do not burst
            else:
                await asyncio.sleep(0)
            self.steps += 1
            self.max_batch = max(self.max_batch, decoding)
            emitted = 0
            for seq in emitting:
                if seq.pooled:
                    self._finish(seq, "stop")  # pooled in its last prefill step
                elif not seq.done:
                    self._emit(seq)
                    emitted += 1
            self._emitted.add(emitted)
            self.on_step(decoding, emitted)
