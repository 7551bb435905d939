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
it has no end-of-sequence token in free text (every sequence runs to max_tokens unless a stop
string ends it), so ``ignore_eos`` holds by construction; ``min_tokens`` and
``include_stop_str_in_output`` act as in vLLM, and a stop string that ends a sequence is its
``stop_reason``. ``stop_token_ids`` fails its request (the words it writes have no ids a caller
would know).

Its vocabulary is ``VOCABULARY`` (the words it writes): token id ``i`` is the word
``VOCABULARY[i % len(VOCABULARY)]``, so any id that is not negative is a token (the API's word
counter, ``WORDS``, takes any too) and a negative one fails as ``invalid_token_ids``, as vLLM
says it. A prompt of token ids is the text of those words joined by spaces, ``len(ids)`` tokens:
it produces what that text would (the text counts the same under ``count_words``). A text
prompt's tokens are its words and marks as ``count_words`` counts them, each with the
whitespace before it (a word outside the vocabulary has a stable id past it).

``n`` runs ``n`` sequences (each a sequence of the cost model, with its own prefill, as vLLM's
child requests), choice ``j``'s text seeded by (prompt, seed, j); choice 0 is the text of
``n=1``. ``structured_outputs`` ``json_object`` writes a JSON object of vocabulary words as big
as (seeded) fits ``max_tokens`` with the end-of-sequence token after it (finish ``stop``, no
``stop_reason``); with ``max_tokens`` too small even for ``{}``, a prefix and ``length``, as
vLLM would. ``json`` writes a value of the schema (types, properties and required, items and
the array bounds, enum, const, anyOf/oneOf, numeric and length bounds; a schema with another
keyword fails its request), cut with ``length`` where it does not fit; ``choice`` writes one of
the choices. Each JSON string, number, mark is one token. ``disable_any_whitespace`` (and a
``whitespace_pattern``) writes no whitespace. ``regex`` and ``grammar`` fail their request.

``prompt_logprobs`` (k) gives each prompt token but the first a logprob and rank from a hash of
it and the token before it (geometric over the ranks: the probabilities sum below one), and the
k best alternatives by rank (the token itself among them where its rank is within k);
``logprobs`` (k) gives each output token, in each chunk, a logprob and its k best
alternatives the same way, hashed from it, the token before it (the prompt's last for the
first) and its place: the token written ranks first where the request is greedy (temperature
0), else rank r with chance 2^-r up to the 8th (an output token's text is what the chunk
says of it, cut where a stop string cut it, "" for a structured output's end of sequence, so
the tokens' texts join into the output's). ``echo`` gives the prompt's text (token ids decoded
as above). None of these changes the text or the timing.
"""

from __future__ import annotations

import asyncio
import hashlib
import heapq
import itertools
import json
import math
import re
import time
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.core.contract.pooling import pack
from app.core.scheduling.fairshare import PREFIX_CHARS
from app.core.scheduling.tokens import (
    SIM_VOCABULARY,
    SIM_WORDS,
    WORDS,
    count_words,
    sim_decode,
    sim_token_id,
)
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
    echo_text,
    ignore_step,
    prompt_text,
    prompt_token_logprob,
    refuse_options,
    token_logprob,
    token_prompt,
    wrong_task,
)

# The words it writes, and its vocabulary: token id i is VOCABULARY[i % len(VOCABULARY)] (see
# the module docstring; the API's word model counts, encodes and decodes with the same).
_WORDS = SIM_WORDS
VOCABULARY = SIM_VOCABULARY
# A prompt's tokens as count_words counts them (app/core/scheduling/tokens.py), each with the
# whitespace before it.
_TOKEN_RE = re.compile(r"\s*(?:\w+|[^\w\s])")


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
# A temperature below this is greedy (vLLM's _SAMPLING_EPS): the best token is the one written.
_GREEDY = 1e-5


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
    index: int = 0  # which choice of its request (``n``)
    # A structured output's tokens, written in order, the last the end of sequence (""); None:
    # free text from the generator.
    pieces: list[str] | None = None
    # ``options["logprobs"]`` (k), None when not asked; and the id of its last token so far (the
    # prompt's last before it has generated), which its next token's logprobs are hashed with.
    logprobs: int | None = None
    last_id: int = 0

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
        "n",
        "structured_outputs",
        "prompt_logprobs",
        "logprobs",
    }
)


decode = sim_decode  # token ids as text: their words, one space apart
token_id = sim_token_id  # a word's id: its place in the vocabulary, else a stable one past it


def prompt_tokens_of(prompt: str | Sequence[int]) -> list[tuple[int, str]]:
    """A prompt's tokens, (id, text) each: the text of each with the whitespace before it, so
    that they join into the prompt (a text's trailing whitespace aside). An empty text is one
    token, as ``count_words`` counts it."""
    if isinstance(prompt, str):
        pieces = _TOKEN_RE.findall(prompt) or [""]
        return [(token_id(piece.lstrip()), piece) for piece in pieces]
    size = len(VOCABULARY)
    return [
        (i, VOCABULARY[i % size] if p == 0 else " " + VOCABULARY[i % size])
        for p, i in enumerate(prompt)
    ]


def _ranked(
    key: str, tid: int, text: str, k: int, lead: str = " ", rank: int | None = None
) -> tuple[float, int, list[tuple[int, str, float, int]]]:
    """A token's logprob and rank given what precedes it, and the k best alternatives (id,
    text, logprob, rank) by rank (-1: the whole vocabulary), all from a hash of ``key``: the
    logprob of rank r falls geometrically with r (the probabilities sum below one), and the
    token itself is among the alternatives, at its rank, where that is within k. ``rank``: the
    token's rank where the caller knows it (a greedy choice's is 1); ``lead``: what the
    alternatives' texts start with."""
    size = len(VOCABULARY)
    k = size if k < 0 else min(k, size)
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")
    head = 0.05 + (h & 0xFFFF) / 0xFFFF  # what rank 1 falls short of certainty by
    decay = 0.3 + ((h >> 16) & 0xFF) / 255 * 1.2
    scale = math.log1p(-math.exp(-decay))

    def logprob(r: int) -> float:
        return -head + scale - decay * (r - 1)

    if rank is None:
        rank = 1 + (h >> 24) % 8
    start = h >> 32
    others = (c for m in range(size) if (c := (start + m) % size) != tid)
    top = []
    for r in range(1, k + 1):
        if r == rank:
            top.append((tid, text, logprob(r), r))
        else:
            other = next(others)
            top.append((other, lead + VOCABULARY[other], logprob(r), r))
    return logprob(rank), rank, top


def prompt_logprobs(
    tokens: Sequence[tuple[int, str]], k: int, salt: str = ""
) -> list[dict[str, Any]]:
    """A prompt's logprobs (``options["prompt_logprobs"]``, k; -1: the whole vocabulary):
    deterministic from each token, the one before it and ``salt`` (see the module docstring)."""
    first_id, first_text = tokens[0]
    out = [prompt_token_logprob(first_id, first_text, None, None)]
    for p in range(1, len(tokens)):
        tid, text = tokens[p]
        key = f"{tokens[p - 1][0]}\x00{tid}\x00{p}\x00{salt}"
        logprob, rank, top = _ranked(key, tid, text, k)
        out.append(prompt_token_logprob(tid, text, logprob, rank, top))
    return out


def output_logprob(
    before: int, tid: int, text: str, position: int, k: int, salt: str = "", greedy: bool = False
) -> dict[str, Any]:
    """An output token's logprobs (``options["logprobs"]``, k): its logprob and the k best
    alternatives, deterministic from it, the token before it (``before``), its place in the
    sequence and ``salt`` as a prompt token's are; a ``greedy`` choice's token ranks first.
    Every alternative's text starts as the token's does (with a space, or not at the start)."""
    key = f"{before}\x00{tid}\x00{position}\x00{salt}\x00out"
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big")
    # Sampled: rank r with chance 2^-r (the trailing ones of the hash), at most 8.
    rank = 1 if greedy else 1 + min(7, (~h & (h + 1)).bit_length() - 1)
    lead = " " if text[:1].isspace() else ""
    logprob, _, top = _ranked(key, tid, text, k, lead, rank)
    return token_logprob(text, logprob, [(t, lp) for _, t, lp, _ in top])


class _Draw:
    """Deterministic choices for a structured output (the LCG of _Seq, from its state)."""

    def __init__(self, state: int) -> None:
        self.state = state

    def __call__(self, n: int) -> int:
        self.state = (self.state * _LCG_A + _LCG_C) & _MASK64
        return (self.state >> 33) % max(1, n)

    def words(self, count: int) -> str:
        return " ".join(_WORDS[self(len(_WORDS))] for _ in range(count))


# The JSON schema keywords the simulated engine writes values for (others fail the request).
_SCHEMA_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "items",
        "enum",
        "const",
        "anyOf",
        "oneOf",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "additionalProperties",
        "title",
        "description",
        "default",
        "examples",
        "$schema",
        "$id",
        "$comment",
    }
)
_JSON_TOKEN_RE = re.compile(r'\s*(?:"(?:[^"\\]|\\.)*"|[{}\[\],:]|[^\s{}\[\],:"]+)')


def _check_schema(schema: Any, path: str = "json") -> None:
    if not isinstance(schema, dict):
        return
    unknown = sorted(set(schema) - _SCHEMA_KEYWORDS)
    if unknown:
        raise EngineRequestError(
            "invalid_request",
            f"structured_outputs.{path}: {', '.join(unknown)}: not supported by the simulated "
            "engine (vLLM supports it)",
        )
    for name, sub in (schema.get("properties") or {}).items():
        _check_schema(sub, f"{path}.properties.{name}")
    for key in ("items", "additionalProperties"):
        _check_schema(schema.get(key), f"{path}.{key}")
    for key in ("anyOf", "oneOf"):
        for i, sub in enumerate(schema.get(key) or ()):
            _check_schema(sub, f"{path}.{key}.{i}")


def _object(draw: _Draw, members: int) -> dict[str, Any]:
    """Any JSON object (json_object): ``members`` members of vocabulary words."""
    keys = list(dict.fromkeys(VOCABULARY[draw(len(VOCABULARY))] for _ in range(members)))
    return {key: _member(draw) for key in keys}


def _member(draw: _Draw) -> Any:
    kind = draw(3)
    return draw.words(1 + draw(2)) if kind == 0 else draw(1000) if kind == 1 else bool(draw(2))


def _value(schema: Any, draw: _Draw, depth: int = 0) -> Any:
    """A value of ``schema`` (_SCHEMA_KEYWORDS)."""
    if not isinstance(schema, dict) or not schema:  # true, {}: any value
        return _object(draw, 1 + draw(3)) if depth == 0 else draw.words(1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][draw(len(schema["enum"]))]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return _value(schema[key][0], draw, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((t for t in kind if t != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "string"
    if kind == "object":
        required = set(schema.get("required") or ())
        return {
            name: _value(sub, draw, depth + 1)
            for name, sub in (schema.get("properties") or {}).items()
            if name in required or draw(2)
        }
    if kind == "array":
        least = int(schema.get("minItems", 0))
        most = int(schema.get("maxItems", least + 3))
        count = least + draw(most - least + 1)
        return [_value(schema.get("items"), draw, depth + 1) for _ in range(count)]
    if kind in ("integer", "number"):
        integer = kind == "integer"
        bounds: dict[str, float] = schema
        low = bounds.get("minimum", bounds.get("exclusiveMinimum", 0.0))
        high = bounds.get("maximum", bounds.get("exclusiveMaximum", low + 100))
        if integer:
            low = math.floor(low) + 1 if "exclusiveMinimum" in schema else math.ceil(low)
            high = math.ceil(high) - 1 if "exclusiveMaximum" in schema else math.floor(high)
            return low + draw(high - low + 1)
        # A point strictly inside the bounds (a hundredth of the span from each end at least).
        return low + (high - low) * (1 + draw(98)) / 100
    if kind == "boolean":
        return bool(draw(2))
    if kind == "null":
        return None
    text = draw.words(1 + draw(3))
    least = int(schema.get("minLength", 0))
    while len(text) < least:
        text += " " + draw.words(1)
    return text[: schema.get("maxLength", len(text))]


def _json_pieces(value: Any, compact: bool) -> list[str]:
    text = json.dumps(value, separators=(",", ":") if compact else None)
    return _JSON_TOKEN_RE.findall(text)


def structured_pieces(spec: Mapping[str, Any], state: int, max_tokens: int) -> list[str]:
    """The tokens of a structured output (``options["structured_outputs"]``), the last the end
    of sequence (""): see the module docstring."""
    draw = _Draw(state)
    compact = bool(spec.get("disable_any_whitespace") or spec.get("whitespace_pattern"))
    if spec.get("choice") is not None:
        choice = spec["choice"][draw(len(spec["choice"]))]
        return [*(re.findall(r"\s*\S+", choice) or [choice]), ""]
    if spec.get("json_object"):
        members = 1 + draw(6)
        while True:  # the biggest object of at most ``members`` that fits, with its end
            pieces = _json_pieces(_object(_Draw(state), members), compact)
            if len(pieces) < max_tokens or members == 0:
                return [*pieces, ""]
            members -= 1
    if spec.get("json") is not None:
        schema = spec["json"]
        if isinstance(schema, str):
            schema = json.loads(schema)
        return [*_json_pieces(_value(schema, draw), compact), ""]
    given = sorted(k for k in ("regex", "grammar", "structural_tag") if spec.get(k) is not None)
    raise EngineRequestError(
        "invalid_request",
        f"structured_outputs.{', '.join(given) or 'the constraint'}: not supported by the "
        "simulated engine (vLLM supports it)",
    )


def _prefix(req: GenRequest, prompt: str) -> str:
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
        self._by_id: dict[str, list[_Seq]] = {}  # a request's sequences (n)
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
        ids = token_prompt(req)
        if ids is not None:
            if min(ids) < 0:  # vLLM's words
                raise EngineRequestError(
                    "invalid_token_ids", f"Token id {min(ids)} is out of vocabulary"
                )
            text, tokens = decode(ids), len(ids)
        else:
            text = prompt_text(req)
            tokens = count_words(text)
        if tokens >= self.max_model_len:  # vLLM's rule: room for one output token
            raise EngineRequestError(
                "context_length_exceeded",
                f"the prompt has {tokens} tokens; this model's context is {self.max_model_len}",
            )
        structured = req.options.get("structured_outputs")
        top = req.options.get("logprobs")
        last_id = 0
        if top is not None:
            last_id = ids[-1] if ids is not None else prompt_tokens_of(text)[-1][0]
        # An adapter changes the model's output, so it changes the simulated text too.
        seed = f"{req.seed or 0}\x00{req.adapter or ''}\x00{text}"
        out: asyncio.Queue[GenChunk] = asyncio.Queue()  # every choice's chunks
        seqs = []
        for index in range(int(req.options.get("n", 1))):
            digest = hashlib.sha256((f"{seed}\x00{index}" if index else seed).encode()).digest()
            seq = _Seq(req, tokens, tokens, int.from_bytes(digest[:8], "big"), out, index=index)
            if top is not None:
                seq.logprobs, seq.last_id = int(top), last_id
            if structured is not None:
                if structured.get("json") is not None:
                    _check_schema(structured["json"])
                seq.pieces = structured_pieces(structured, seq.state, req.max_tokens)
            if self.cost.prefix_cache:
                seq.prefix = _prefix(req, text)
                seq.prefix_tokens = min(count_words(seq.prefix), tokens - 1) if seq.prefix else 0
            seqs.append(seq)
        # What the request's first chunk says of its prompt.
        echoed = echo_text(req, decode) if req.echo else None
        k = req.options.get("prompt_logprobs")
        scored = None
        if k is not None:
            scored = prompt_logprobs(
                prompt_tokens_of(text if ids is None else ids), int(k), req.adapter or ""
            )
        self._by_id[req.request_id] = seqs
        for seq in seqs:
            heapq.heappush(self._waiting, (req.priority, next(self._order), seq))
        self._wake.set()
        try:
            left, first = len(seqs), True
            while left:
                chunk = await out.get()
                if first:
                    chunk.prompt_text, chunk.prompt_logprobs, first = echoed, scored, False
                yield chunk
                if chunk.finish_reason is not None:
                    left -= 1
        finally:
            # A consumer that stops early (cancelled, deadline) aborts the sequences.
            for seq in seqs:
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
            self._by_id[sub.request_id] = [seq]
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
        for seq in self._by_id.get(request_id, ()):
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

    def chat_template(self) -> None:
        return None  # its chats are rendered by the plain template (base.render_chat)

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
        for seqs in list(self._by_id.values()):
            for seq in seqs:
                self._finish(seq, "abort")
        if self._task is not None:
            self._task.cancel()

    def _finish(self, seq: _Seq, reason: str, *, emit: bool = True) -> None:
        if seq.done:
            return
        seq.done = True
        seqs = self._by_id.get(seq.req.request_id)
        if seqs is not None and all(s.done for s in seqs):
            del self._by_id[seq.req.request_id]
        if emit:
            seq.out.put_nowait(GenChunk("", 0, reason, seq.prompt_tokens, seq.index))

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
        seq.generated += 1
        ended = False  # a structured output's end-of-sequence token
        if seq.pieces is None:
            seq.state = (seq.state * _LCG_A + _LCG_C) & _MASK64
            word = _WORDS[(seq.state >> 33) % len(_WORDS)]
            piece = word if seq.generated == 1 else " " + word
        else:
            piece = seq.pieces[seq.generated - 1]
            ended = seq.generated == len(seq.pieces)
            word = piece.strip()
        checked = len(seq.text)
        seq.text += piece
        reason = matched = None
        # As in vLLM, stop strings apply once min_tokens have been generated, to new text only.
        if seq.req.stop and seq.generated >= seq.req.options.get("min_tokens", 0):
            keep = bool(seq.req.options.get("include_stop_str_in_output"))
            cut, matched = apply_stop(seq.text, seq.req.stop, include=keep, since=checked)
            if matched is not None:
                piece = piece[: max(0, len(piece) - (len(seq.text) - len(cut)))]
                seq.text = cut
                reason = "stop"
        if reason is None and ended:
            reason = "stop"
        if reason is None and seq.generated >= seq.req.max_tokens:
            reason = "length"
        scored = None
        if seq.logprobs is not None:
            # The token as emitted (a stop string may have cut it): the texts join into the
            # chunks'. Its id is the whole token's.
            tid = token_id(word)
            scored = [
                output_logprob(
                    seq.last_id,
                    tid,
                    piece,
                    seq.prompt_tokens + seq.generated - 1,
                    seq.logprobs,
                    seq.req.adapter or "",
                    greedy=seq.req.temperature < _GREEDY,
                )
            ]
            seq.last_id = tid
        seq.out.put_nowait(
            GenChunk(
                piece,
                1,
                reason,
                seq.prompt_tokens,
                seq.index,
                logprobs=scored,
                stop_reason=matched,
            )
        )
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
