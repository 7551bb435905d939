"""The ``prefix`` scenario on one vLLM worker: a batch whose lines share long system prompts,
grouped vs arrival (the scenario's entry and its part across workers: bench/affinity.py).

One OpenAI batch file (``/v1/chat/completions``) of ``opts.n(1000)`` lines; line i opens with
system prompt i % PREFIXES, a few hundred tokens each, then a short user message of its own, so
consecutive lines never share a prefix. It runs twice, each time through a fresh stack (API,
ops worker, one vLLM worker): with ``INFERQ_DISPATCH_POLICY=fair``, where jobs that share a
prompt prefix are sent together, and with ``arrival``, plain submission order. vLLM's KV cache
is kept to KV_BLOCKS blocks, room for a few of the prefixes and not all: in arrival order a
prefix's blocks are evicted before its next line comes, grouped they are reused.

Each side reports vLLM's prefix-cache hit rate over its run (hits / queries, prompt tokens, from
the worker's ``inferq_engine_prefix_cache_*_total``) and its output tokens per second (completion
tokens / (last finished_at - first started_at) of the job rows).
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx

from bench.harness import BenchStack
from bench.metrics import gauge, read_gauges
from bench.scenarios import Options

PREFIXES = 8
# ~2.4 demo-tokenizer tokens a word: ~600 tokens, 4 full vLLM CPU blocks (128 tokens) of it
# shared; with the user message and MAX_TOKENS a line stays in 5 blocks, well inside the demo
# model's 1024-token context.
PREFIX_WORDS = 250
MAX_TOKENS = 16
# vLLM's KV cache in blocks (num_gpu_blocks_override): ~4 lines with different prefixes run at
# once, ~20 with one; either way the cache cannot hold every prefix (8 x 4 blocks).
KV_BLOCKS = 24
POLICIES = (("grouped", "fair"), ("arrival", "arrival"))

_WORDS = (
    "you are a careful assistant answer every question about the queue lane worker engine "
    "batch prompt result job model tenant cache policy briefly and politely never guess "
    "always cite the manual when unsure say so keep replies short"
).split()


def system_prompts(k: int = PREFIXES, words: int = PREFIX_WORDS) -> list[str]:
    """``k`` long system prompts that differ from their first word on (seeded)."""
    prompts = []
    for i in range(k):
        rng = random.Random(1000 + i)
        prompts.append(f"Policy {i}. " + " ".join(rng.choice(_WORDS) for _ in range(words)))
    return prompts


def batch_lines(n: int, model: str) -> list[dict[str, Any]]:
    """The batch file: line i under system prompt i % PREFIXES, interleaved."""
    prompts = system_prompts()
    lines = []
    for i in range(n):
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": prompts[i % len(prompts)]},
                {"role": "user", "content": f"Request {i}: what should job {i} do next?"},
            ],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return lines


def prefix_counters(metrics_url: str) -> tuple[float, float]:
    """(queries, hits) in prompt tokens, from a worker's /metrics."""
    samples = read_gauges(metrics_url)
    return (
        gauge(samples, "inferq_engine_prefix_cache_queries_total") or 0.0,
        gauge(samples, "inferq_engine_prefix_cache_hits_total") or 0.0,
    )


def _engine_args(opts: Options) -> str:
    """INFERQ_VLLM_ENGINE_ARGS with the small KV cache (one the caller set wins)."""
    args = json.loads(opts.env.get("INFERQ_VLLM_ENGINE_ARGS") or "{}")
    args.setdefault("num_gpu_blocks_override", KV_BLOCKS)
    return json.dumps(args)


def _side(opts: Options, lines: list[dict[str, Any]], what: str, policy: str) -> dict[str, Any]:
    env = opts.stack_env(dispatch_policy=policy, vllm_engine_args=_engine_args(opts))
    with BenchStack(opts.database, env, opts.workdir) as stack:
        opts.progress(f"{what}: starting the stack", 0, len(lines))
        stack.start(workers=1)
        stack.add_ops()
        (record,) = stack.worker_records()
        path = stack.workdir / "input.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        with httpx.Client(base_url=stack.url, timeout=120) as c:
            # One job outside the measurement: the engine's first steps are slow.
            warm = c.post("/v1/jobs", json={"prompt": "warm up", "params": {"max_tokens": 4}})
            warm.raise_for_status()
            warm_id = warm.json()["id"]
            stack.wait_all(1, 300, ids=[warm_id])
            before = prefix_counters(record["metrics_url"])
            batch = stack.start_batch(c, stack.upload(c, path))
            if batch["status"] not in ("in_progress", "finalizing", "completed"):
                raise RuntimeError(f"the batch did not start: {batch['status']} {batch}")
        total = len(lines) + 1
        stack.wait_all(total, 1800, lambda done: opts.progress(what, max(done - 1, 0), total - 1))
        after = prefix_counters(record["metrics_url"])
        rows = [r for r in stack.rows() if r["id"] != warm_id]
    ok = [r for r in rows if r["status"] == "succeeded"]
    queries, hits = after[0] - before[0], after[1] - before[1]
    span = (
        max(r["finished_at"] for r in ok) - min(r["started_at"] for r in ok) if ok else 0.0
    ) or 1e-9
    tokens = sum(r["completion_tokens"] or 0 for r in ok)
    return {
        "dispatch_policy": policy,
        "jobs": len(ok),
        "failed": len(rows) - len(ok),
        "seconds": span,
        "prefix_hit_rate": hits / queries if queries else None,
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "output_throughput": tokens / span,
        "request_throughput": len(ok) / span,
        "mean_prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok) / len(ok) if ok else None,
    }


def one_worker(opts: Options) -> dict[str, Any]:
    """One vLLM worker: the batch grouped by prefix (``fair``) against arrival order."""
    n = opts.n(1000)
    lines = batch_lines(n, opts.settings().model_name)
    sides = {
        name: _side(opts, lines, f"prefix: {name} (INFERQ_DISPATCH_POLICY={policy})", policy)
        for name, policy in POLICIES
    }
    grouped, arrival = sides["grouped"], sides["arrival"]
    return {
        "engine": opts.engine,
        "jobs": n,
        "prefixes": PREFIXES,
        "max_tokens": MAX_TOKENS,
        "kv_blocks": json.loads(_engine_args(opts))["num_gpu_blocks_override"],
        **sides,
        "hit_rate_gain": (grouped["prefix_hit_rate"] or 0.0) - (arrival["prefix_hit_rate"] or 0.0),
        "throughput_ratio": grouped["output_throughput"] / arrival["output_throughput"]
        if arrival["output_throughput"]
        else None,
    }
