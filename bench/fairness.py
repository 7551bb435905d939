"""The ``fairness`` scenario (SIMULATED engine): how one lane's engine tokens are shared by
tenants (docs/benchmarks.md, "fairness"; docs/architecture.md, "Fair share").

Tenant A submits ``FAIR_A`` bulk jobs; ``FAIR_DELAY_S`` later tenant B submits ``FAIR_B`` of the
same size. From B's submission until B has no job left waiting (at most ``MEASURE_S``), both
tenants are backlogged, and the tokens each one is served are read from the job rows: a job's
completion tokens are spread evenly over its time in the engine (first token to end), so a
window counts what the engine produced in it, whichever jobs end in it. Three runs, each on a
stack of its own, with the same workload and engine:

- ``equal``: fair share, equal weights. ``b_share`` = B's share of the tokens while both are
  backlogged (target >= 0.45); ``jain_min`` = the lowest Jain index of the two tenants' tokens
  over the ``WINDOW_S`` windows of that time, (a + b)^2 / (2 (a^2 + b^2)) (target >= 0.95; of
  tokens over weight in the weighted run);
- ``weighted``: fair share, A's key weighs 3 and B's 1. ``weighted_share_a`` (target 0.75 +-
  0.05);
- ``arrival``: the dispatcher in arrival order (``INFERQ_DISPATCH_POLICY=arrival``), where B
  waits behind A's whole backlog. ``throughput_vs_arrival`` = ``equal``'s output tokens/s over
  this run's, in the same stretch after B's submission (target >= 0.97): the fair order costs
  the engine nothing.

Two more cases where the engine runs fewer sequences than the worker has slots
(``INFERQ_WORKER_CONCURRENCY`` left at its default), so whatever the worker admits beyond the
engine's capacity waits inside the engine, outside fair share (docs/architecture.md, "Fair
share"):

- ``full_seqs``: the engine's ``max_num_seqs`` is ``FULL_SEQS``;
- ``full_kv``: ``max_num_seqs`` stays 256 but the KV cache holds ``FULL_SEQS`` of the case's
  long sequences (``INFERQ_SIM_KV_CACHE_TOKENS``; a prompt of ``LONG_PROMPT`` words).

In each, B's ``FULL_B`` jobs (``VLLM_B`` on vLLM) run first alone, then again ``FULL_DELAY_S``
after A has submitted ``FULL_A``: ``b_slowdown`` = B's completion time (submission to its last
job's end) behind the backlog over alone (target <= 2.5: half an engine's share would give
about 2), and ``b_share`` = B's share of the tokens from its submission to its end (target >=
0.45).
"""

from __future__ import annotations

import json
import time
from typing import Any

from bench.harness import BenchStack
from bench.scenarios import Options

FAIR_A = 20_000
FAIR_B = 500
FAIR_DELAY_S = 10.0
MEASURE_S = 30.0  # the longest stretch measured after B's submission
WINDOW_S = 10.0
MAX_TOKENS = 64
SLOTS = 16
# Small bulk messages: a worker of 16 slots holds four; with the default 32 one message would
# be more than the worker holds.
CHUNK = 4
FULL_A = 3_000
FULL_B = 100
FULL_DELAY_S = 1.0
FULL_SEQS = 16
LONG_PROMPT = 200  # words (the simulated engine's tokens)
FULL_TIMEOUT_S = 600.0
# vLLM's CPU engine with the demo model: its KV cache is 1 KiB a token (2 layers x 2 KV heads x
# 64 x K and V x 2 bytes), so the smallest VLLM_CPU_KVCACHE_SPACE (1 GiB) holds a million
# tokens; the cache is kept small in blocks (of 128 tokens) instead, as the prefix scenario
# does. A job of ~2.4 demo tokens a word holds 3 blocks: 8 run at once, of 256 slots.
VLLM_KV_BLOCKS = 24
VLLM_PROMPT = 110  # words
VLLM_MAX_TOKENS = 32
# B's jobs on vLLM: 100 of these take about a second alone, too short a stretch to read a
# share in beside the jobs already in the engine when B arrives.
VLLM_B = 400


def _body(tenant: str, i: int, pad: int = 0, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    # ignore_eos: every job generates max_tokens (vLLM's random-weight demo model may end early).
    return {
        "prompt": f"fair share {tenant} {i}" + " context" * pad,
        "lane": "bulk",
        "params": {"max_tokens": max_tokens, "ignore_eos": True},
    }


def _tokens(rows: list[dict[str, Any]], start: float, end: float) -> float:
    """Completion tokens the engine produced for ``rows`` between ``start`` and ``end``."""
    total = 0.0
    for row in rows:
        began = row["first_token_at"] or row["started_at"]
        ended = row["finished_at"]
        if began is None or ended is None or not row["completion_tokens"]:
            continue
        overlap = min(ended, end) - max(began, start)
        if overlap > 0:
            total += row["completion_tokens"] * overlap / max(ended - began, 1e-6)
    return total


def _jain(values: list[float]) -> float:
    squares = sum(v * v for v in values)
    return (sum(values) ** 2) / (len(values) * squares) if squares else 1.0


def _run(opts: Options, what: str, policy: str, weights: tuple[float, float]) -> dict[str, Any]:
    n_a, n_b = opts.n(FAIR_A), opts.n(FAIR_B)
    env = opts.stack_env(
        engine="simulated",
        require_auth="true",
        dispatch_policy=policy,
        worker_concurrency=SLOTS,
        sim_max_num_seqs=SLOTS,
        bulk_chunk_size=CHUNK,
    )
    with BenchStack(opts.database, env, opts.workdir) as stack:
        stack.start(workers=1)
        key_a = stack.create_key("tenant-a", weights[0])
        key_b = stack.create_key("tenant-b", weights[1])
        opts.progress(f"{what}: A submits", 0, n_a)
        a_at = stack.submit([_body("a", i) for i in range(n_a)], key=key_a)
        opts.progress(f"{what}: A submits", n_a, n_a)
        time.sleep(max(0.0, a_at + FAIR_DELAY_S - time.time()))
        stack.submit([_body("b", i) for i in range(n_b)], key=key_b)
        t0 = time.time()  # B's jobs are committed: from now both are backlogged
        while time.time() < t0 + MEASURE_S:
            opts.progress(f"{what}: measuring", int(time.time() - t0), int(MEASURE_S))
            time.sleep(0.5)
        time.sleep(3 * MAX_TOKENS * 0.02)  # the jobs in the engine at the end finish
        rows = stack.rows()
    a_rows = [r for r in rows if r["tenant"] == "tenant-a"]
    b_rows = [r for r in rows if r["tenant"] == "tenant-b"]
    b_sent = [r["enqueued_at"] for r in b_rows]
    # B is backlogged until its last job is sent; within MEASURE_S in any case.
    end = t0 + MEASURE_S
    if b_sent and all(at is not None for at in b_sent):
        end = min(end, max(at for at in b_sent if at is not None))
    windows: list[dict[str, float]] = []
    start = t0
    while start + WINDOW_S <= end + 1e-9 or not windows:
        stop = min(start + WINDOW_S, end)
        a, b = _tokens(a_rows, start, stop), _tokens(b_rows, start, stop)
        # Jain's index of the tokens over the weights: 1 when each gets its weighted share.
        jain = _jain([a / weights[0], b / weights[1]])
        windows.append(
            {"start_s": round(start - t0, 1), "a": round(a), "b": round(b), "jain": jain}
        )
        start += WINDOW_S
    a_all, b_all = _tokens(a_rows, t0, end), _tokens(b_rows, t0, end)
    return {
        "policy": policy,
        "weights": list(weights),
        "jobs_a": n_a,
        "jobs_b": n_b,
        "measured_s": round(end - t0, 1),
        "share_a": a_all / (a_all + b_all) if a_all + b_all else 0.0,
        "share_b": b_all / (a_all + b_all) if a_all + b_all else 0.0,
        "output_throughput": (a_all + b_all) / max(end - t0, 1e-6),
        "windows": windows,
        "jain_min": min(w["jain"] for w in windows),
        "b_jobs_done": sum(1 for r in b_rows if r["status"] == "succeeded"),
        "_t0_end": (t0, end),
        "_rows": (a_rows, b_rows),
    }


def _finished_by(stack: BenchStack, tenant: str, n: int, what: str, opts: Options) -> float:
    """When the last of ``tenant``'s ``n`` jobs ended, once they all have."""
    deadline = time.monotonic() + FULL_TIMEOUT_S
    while time.monotonic() < deadline:
        rows = stack.rows(tenant=tenant)
        done = [r["finished_at"] for r in rows if r["finished_at"] is not None]
        opts.progress(what, len(done), n)
        if len(done) >= n:
            return float(max(done))
        time.sleep(0.2)
    raise RuntimeError(f"{what}: {tenant}'s {n} jobs did not finish in {FULL_TIMEOUT_S:.0f}s")


def _engine_full(
    opts: Options,
    what: str,
    env: dict[str, str],
    pad: int,
    max_tokens: int = MAX_TOKENS,
    jobs_b: int = FULL_B,
) -> dict[str, Any]:
    """B alone, then B behind A's backlog, on an engine smaller than the worker's slots."""
    n_a, n_b = opts.n(FULL_A), opts.n(jobs_b)
    with BenchStack(opts.database, env, opts.workdir) as stack:
        stack.start(workers=1)
        key_alone = stack.create_key("b-alone")
        key_a, key_b = stack.create_key("tenant-a"), stack.create_key("tenant-b")
        # A job outside the measurement: an engine's first steps are slow (vLLM's warm-up).
        stack.submit([_body("warm", 0, pad, max_tokens)], key=key_alone)
        _finished_by(stack, "b-alone", 1, f"{what}: warm-up", opts)
        at = stack.submit([_body("b0", i, pad, max_tokens) for i in range(n_b)], key=key_alone)
        alone_s = _finished_by(stack, "b-alone", n_b + 1, f"{what}: B alone", opts) - at
        bodies_a = [_body("a", i, pad, max_tokens) for i in range(n_a)]
        a_at = stack.submit(bodies_a, key=key_a)
        time.sleep(max(0.0, a_at + FULL_DELAY_S - time.time()))
        b_at = stack.submit([_body("b", i, pad, max_tokens) for i in range(n_b)], key=key_b)
        b_end = _finished_by(stack, "tenant-b", n_b, f"{what}: B behind A", opts)
        rows = stack.rows()
    a_rows = [r for r in rows if r["tenant"] == "tenant-a"]
    b_rows = [r for r in rows if r["tenant"] == "tenant-b"]
    # B is backlogged (has jobs not yet sent) until its last job is sent; after that the
    # engine can only give it what is left in flight.
    b_sent = max((r["enqueued_at"] or b_end) for r in b_rows)
    a_tokens, b_tokens = _tokens(a_rows, b_at, b_end), _tokens(b_rows, b_at, b_end)
    a_backlogged, b_backlogged = _tokens(a_rows, b_at, b_sent), _tokens(b_rows, b_at, b_sent)
    slowdown = (b_end - b_at) / alone_s if alone_s > 0 else 0.0
    share = b_tokens / (a_tokens + b_tokens) if a_tokens + b_tokens else 0.0
    return {
        "jobs_a": n_a,
        "jobs_b": n_b,
        "b_alone_s": round(alone_s, 2),
        "b_behind_s": round(b_end - b_at, 2),
        "b_slowdown": slowdown,
        "b_share": share,
        # The engine's tokens a second behind A over alone (B's tokens are the same both
        # times): slowdown = 1 / (share * engine_speed). Below 1, the engine ran slower under
        # the backlog (on vLLM's CPU engine, the API, dispatcher and database share its cores).
        "engine_speed": 1 / (slowdown * share) if slowdown and share else 0.0,
        "b_share_backlogged": b_backlogged / (a_backlogged + b_backlogged)
        if a_backlogged + b_backlogged
        else 0.0,
        "b_backlogged_s": round(b_sent - b_at, 2),
        # Ended otherwise than succeeded (a failed job ends too): the figures mean nothing then.
        "b_not_succeeded": sum(1 for r in b_rows if r["status"] != "succeeded"),
        "a_jobs_done_meanwhile": sum(
            1 for r in a_rows if r["finished_at"] is not None and r["finished_at"] <= b_end
        ),
    }


def engine_full(opts: Options) -> dict[str, Any]:
    """The two cases where the engine is smaller than the worker's slots (module docstring)."""
    kv_per_seq = LONG_PROMPT + 4 + MAX_TOKENS  # the prompt's words, "fair share b i", output
    cases = {
        "full_seqs": ({"sim_max_num_seqs": FULL_SEQS}, 0),
        "full_kv": ({"sim_kv_cache_tokens": FULL_SEQS * kv_per_seq}, LONG_PROMPT),
    }
    out: dict[str, Any] = {}
    for name, (engine, pad) in cases.items():
        env = opts.stack_env(engine="simulated", require_auth="true", **engine)
        out[name] = {**engine, **_engine_full(opts, f"engine full: {name}", env, pad)}
    out["targets"] = {"b_share": ">= 0.45", "b_slowdown": "<= 2.5"}
    return out


def engine_full_vllm(opts: Options) -> dict[str, Any]:
    """The KV-bound case on vLLM's CPU engine (module docstring): its cache kept to
    ``VLLM_KV_BLOCKS`` blocks with ``num_gpu_blocks_override``, long prompts."""
    args = json.loads(opts.env.get("INFERQ_VLLM_ENGINE_ARGS") or "{}")
    args.setdefault("num_gpu_blocks_override", VLLM_KV_BLOCKS)
    env = opts.stack_env(engine="vllm", require_auth="true", vllm_engine_args=json.dumps(args))
    result = _engine_full(
        opts, "engine full: vLLM KV cache", env, VLLM_PROMPT, VLLM_MAX_TOKENS, VLLM_B
    )
    return {
        "engine": "vllm",
        "kv_blocks": args["num_gpu_blocks_override"],
        "prompt_words": VLLM_PROMPT,
        "max_tokens": VLLM_MAX_TOKENS,
        **result,
        "targets": {"b_share": ">= 0.45", "b_slowdown": "<= 2.5"},
    }


def fairness(opts: Options) -> dict[str, Any]:
    if opts.engine == "vllm":
        # The scheduling runs need an engine whose speed is known (simulated); on vLLM the
        # scenario is the KV-bound case.
        return {"full_vllm": engine_full_vllm(opts)}
    equal = _run(opts, "fairness: equal weights", "fair", (1.0, 1.0))
    weighted = _run(opts, "fairness: weights 3:1", "fair", (3.0, 1.0))
    arrival = _run(opts, "fairness: arrival order", "arrival", (1.0, 1.0))
    # The same stretch after B's submission in both runs: equal's measured time.
    span = equal["_t0_end"][1] - equal["_t0_end"][0]
    t0 = arrival["_t0_end"][0]
    a_rows, b_rows = arrival["_rows"]
    arrival_tp = (_tokens(a_rows, t0, t0 + span) + _tokens(b_rows, t0, t0 + span)) / span
    for side in (equal, weighted, arrival):
        del side["_t0_end"], side["_rows"]
    arrival["output_throughput_same_span"] = arrival_tp
    full = engine_full(opts)
    return {
        "engine": "simulated",
        "worker_concurrency": SLOTS,
        "bulk_chunk_size": CHUNK,
        "max_tokens": MAX_TOKENS,
        "equal": equal,
        "weighted": weighted,
        "arrival": arrival,
        "b_share": equal["share_b"],
        "jain_min": equal["jain_min"],
        "weighted_share_a": weighted["share_a"],
        "throughput_vs_arrival": equal["output_throughput"] / arrival_tp if arrival_tp else 0.0,
        "full_seqs": full["full_seqs"],
        "full_kv": full["full_kv"],
        "targets": {
            **{f"full_*.{k}": v for k, v in full["targets"].items()},
            "b_share": ">= 0.45",
            "jain_min": ">= 0.95",
            "weighted_share_a": "0.75 +- 0.05",
            "throughput_vs_arrival": ">= 0.97",
        },
    }
