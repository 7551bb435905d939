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
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.core.settings import Settings
from app.core.tokens import WORDS, count_words
from workers.engines.base import (
    EngineRequestError,
    EngineStats,
    GenChunk,
    GenRequest,
    StepObserver,
    TokenWindow,
    ToolStream,
    apply_stop,
    check_adapter,
    ignore_step,
    prompt_text,
    refuse_options,
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

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: float) -> CostModel:
        values = {
            "base_ms": settings.sim_base_ms,
            "prefill_ms_per_token": settings.sim_prefill_ms_per_token,
            "decode_ms_per_seq": settings.sim_decode_ms_per_seq,
            "max_num_seqs": settings.sim_max_num_seqs,
            "max_num_batched_tokens": settings.sim_max_num_batched_tokens,
            "time_scale": settings.sim_time_scale,
            "kv_cache_tokens": settings.sim_kv_cache_tokens,
            **overrides,
        }
        return cls(**values)  # type: ignore[arg-type]

    def step_ms(self, prefill_tokens: int, decoding: int) -> float:
        return (
            self.base_ms
            + self.prefill_ms_per_token * prefill_tokens
            + self.decode_ms_per_seq * decoding
        )


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


class SimulatedEngine:
    """SIMULATED engine; see the module docstring."""

    name = "simulated"
    continuous_batching = True
    own_processes = False
    tool_parser: str | None = None  # tool_choice auto is refused (refuse_options)

    def __init__(
        self, cost: CostModel, model_name: str = "simulated", max_model_len: int = 131_072
    ) -> None:
        self.cost = cost
        self.model_name = model_name
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

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name="simulated-engine")

    async def generate(self, req: GenRequest) -> AsyncIterator[GenChunk]:
        assert self._wake is not None, "start() first"
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
        """Schedule one step: returns the sequences that emit a token and the prefill tokens."""
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
            take = min(seq.prefill_left, budget)
            seq.prefill_left -= take
            budget -= take
            prefill += take
            self._running.append(seq)
            if seq.prefill_left == 0:
                emitting.append(seq)
        self._scheduled = (list(self._running), sum(1 for *_, w in self._waiting if not w.done))
        return emitting, prefill

    def _emit(self, seq: _Seq) -> None:
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
            decoding = len(emitting)
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
                if not seq.done:
                    self._emit(seq)
                    emitted += 1
            self._emitted.add(emitted)
            self.on_step(decoding, emitted)
