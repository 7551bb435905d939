"""The ``prefix`` scenario's entry (:func:`prefix`) and its part across workers: prefix
affinity against the shared queues, with 1, 2 and 4 workers of one model (docs/scheduling.md,
"Prefix affinity"; docs/benchmarks.md).

The load is many tenants, each with a long system prompt of its own (llm-d's benchmark: 150
tenants with 6k-token prefixes), ``TENANTS_PER_WORKER`` of them per worker: the fleet is sized
to its tenants, as it is grown when they are added. Each tenant submits ``opts.n(25)`` chat
jobs at once, into the standard lane; fair share serves the tenants in turn, so each engine
sees their prefixes interleaved. Each engine caches ``CACHED_PREFIXES`` prefixes (more than
a worker's share of the tenants, fewer than two workers' shares): with the shared queues each
engine sees every tenant and its LRU cache holds too few of them; with affinity it sees about
its share. On the SIMULATED engine a cached prefix skips its prefill (``INFERQ_SIM_PREFIX_CACHE``,
workers/engines/simulated.py); on vLLM-CPU (``--engine vllm``, two workers) the hit rate is
vLLM's own count.

Each run reports, for its N workers: ``hit_rate`` (prompt tokens found in the engines' prefix
caches / prompt tokens looked up, from the workers' /metrics), ``tokens_per_s`` (completion
tokens / (last finished_at - first started_at)), ``ttft_p50_ms`` (first token - submission,
waits included) and ``max_load_over_mean`` (sampled every ``SAMPLE_S`` while jobs wait unsent:
the largest worker's running jobs plus its own queue, over the mean the dispatcher's bound
takes: the workers' running and listed jobs and the shared queue's, over N; only while every
worker runs something, so neither the start nor the tail counts). ``hot``: one
tenant's one prefix, all of its jobs, on 4 workers: bounded load must spread it. ``join``: 2
workers, a third joins mid-run; the share of prefixes whose worker changed, against 1/3.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

import redis
from sqlalchemy import text
from sqlalchemy.orm import Session

from app.core.messaging.names import (
    AFFINITY_OVERFLOW_KEY,
    AFFINITY_SENT_KEY,
    own_queue,
    queue_of,
)
from app.core.tenants.keys import create_key
from bench.harness import BenchStack
from bench.metrics import percentile
from bench.prefix import KV_BLOCKS, one_worker, prefix_counters, system_prompts
from bench.prefix import PREFIX_WORDS as VLLM_PREFIX_WORDS
from bench.scenarios import Options

TENANTS_PER_WORKER = 8
CACHED_PREFIXES = 12
PREFIX_WORDS = 1500  # simulated tokens: one word each
MAX_TOKENS = 16
TIME_SCALE = 6.0  # the simulated engine's steps, slowed so that the engines, not this
#                   two-core machine's platform processes, bound the throughput
RUNNING = 16  # sequences an engine runs at once: a GPU's KV cache bounds them so, and a
#               backlog then waits in the database, where the dispatcher places it
SAMPLE_S = 0.25
WORKER_COUNTS = (1, 2, 4)
LOAD_FACTOR = 1.25


def _bodies(tenant: int, jobs: int, prompt: str) -> list[dict[str, Any]]:
    return [
        {
            "messages": [
                {"role": "system", "content": prompt},
                {"role": "user", "content": f"Tenant {tenant}, request {i}: what next?"},
            ],
            "params": {"max_tokens": MAX_TOKENS},
            "lane": "standard",
        }
        for i in range(jobs)
    ]


class _LoadSampler:
    """Each worker's running jobs and own queue, every SAMPLE_S while jobs wait unsent."""

    def __init__(self, stack: BenchStack, model: str) -> None:
        self.stack, self.model = stack, model
        self.worst = 0.0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        client = redis.Redis(port=self.stack.redis_port)
        while not self._stop.wait(SAMPLE_S):
            workers = [str(r["worker_id"]) for r in self.stack.worker_records()]
            with self.stack.db().connect() as conn:
                unsent = conn.execute(
                    text(
                        "SELECT count(*) FROM jobs WHERE status = 'queued' AND enqueued_at IS NULL"
                    )
                ).scalar()
                running: dict[str, int] = dict(
                    conn.execute(
                        text(
                            "SELECT lease_owner, count(*) FROM jobs WHERE status = 'running' "
                            "GROUP BY lease_owner"
                        )
                    ).all()
                )
            if not unsent or not workers:
                continue
            running_now = [int(running.get(w, 0)) for w in workers]
            if min(running_now) < 1:
                continue  # a worker not at work yet (the start) or any more (the tail)
            load = [
                r + int(client.llen(own_queue("standard", self.model, w)))
                for r, w in zip(running_now, workers, strict=True)
            ]
            # The mean as the dispatcher's bound takes it: what the workers run and have
            # listed, and what the shared queue holds (app/dispatcher/affinity.py).
            shared = int(client.llen(queue_of("standard", self.model)))
            mean = (sum(load) + shared) / len(load)
            self.samples += 1
            self.worst = max(self.worst, max(load) / mean)


def _run(
    opts: Options,
    workers: int,
    affinity: bool,
    what: str,
    *,
    tenants: int,
    one_prefix: bool = False,
    join_at: float | None = None,
    prefix_words: int = PREFIX_WORDS,
) -> dict[str, Any]:
    """One run of ``tenants`` tenants' jobs on ``workers`` workers; ``one_prefix``: one tenant
    whose jobs all share one prefix; ``join_at``: a worker joins once that share has ended."""
    env = opts.stack_env(
        affinity=str(affinity).lower(),
        affinity_load_factor=LOAD_FACTOR,
        require_auth="true",
        sim_prefix_cache=CACHED_PREFIXES,
        sim_time_scale=TIME_SCALE,
        sim_max_num_seqs=RUNNING,
        worker_concurrency=RUNNING,
    )
    per_tenant = opts.n(25)
    prompts = system_prompts(max(tenants, 1), prefix_words)
    with BenchStack(opts.database, env, opts.workdir) as stack:
        opts.progress(f"{what}: starting {workers} worker(s)", 0, 1)
        stack.start(workers=workers)
        model = str(stack.worker_records()[0]["model"])
        keys = []
        with Session(stack.db()) as session:
            for t in range(tenants):
                _, key = create_key(session, f"tenant-{t}")
                keys.append(key)
            session.commit()
        urls = {str(r["worker_id"]): str(r["metrics_url"]) for r in stack.worker_records()}
        before = {w: prefix_counters(u) for w, u in urls.items()}
        jobs = [
            (keys[t], _bodies(t, per_tenant * (tenants if one_prefix else 1), prompts[t]))
            for t in range(1 if one_prefix else tenants)
        ]
        total = sum(len(bodies) for _, bodies in jobs)
        joined_at: float | None = None
        with _LoadSampler(stack, model) as sampler:
            threads = [
                threading.Thread(target=stack.submit, args=(bodies,), kwargs={"key": key})
                for key, bodies in jobs
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()

            def progress(done: int) -> None:
                nonlocal joined_at
                opts.progress(what, done, total)
                if join_at is not None and joined_at is None and done >= join_at * total:
                    stack.add_worker(workers)
                    joined_at = time.time()

            stack.wait_all(total, 1800, progress)
        for record in stack.worker_records():
            urls.setdefault(str(record["worker_id"]), str(record["metrics_url"]))
        after = {w: prefix_counters(u) for w, u in urls.items()}
        rows = stack.rows()
        routed = redis.Redis(port=stack.redis_port)
        sent = sum(int(v) for v in routed.hgetall(AFFINITY_SENT_KEY).values())
        overflow = sum(int(v) for v in routed.hgetall(AFFINITY_OVERFLOW_KEY).values())
        with stack.db().connect() as conn:
            prefixes: dict[str, str] = dict(conn.execute(text("SELECT id, prefix FROM jobs")).all())
    ok = [r for r in rows if r["status"] == "succeeded"]
    queries = sum(after[w][0] - before.get(w, (0.0, 0.0))[0] for w in after)
    hits = sum(after[w][1] - before.get(w, (0.0, 0.0))[1] for w in after)
    span = (max(r["finished_at"] for r in ok) - min(r["started_at"] for r in ok)) if ok else 0.0
    ttft = [
        (r["first_token_at"] - r["created_at"]) * 1000
        for r in ok
        if r["first_token_at"] is not None
    ]
    result: dict[str, Any] = {
        "workers": workers,
        "affinity": affinity,
        "tenants": tenants,
        "jobs": len(ok),
        "failed": len(rows) - len(ok),
        "seconds": span,
        "hit_rate": hits / queries if queries else None,
        "tokens_per_s": sum(r["completion_tokens"] or 0 for r in ok) / span if span else None,
        "ttft_p50_ms": percentile(ttft, 50),
        "max_load_over_mean": sampler.worst or None,
        "load_samples": sampler.samples,
        "jobs_by_worker": dict(Counter(str(r["lease_owner"]) for r in ok)),
        # The dispatcher's counts: jobs sent to a worker's own queue, and those not sent to
        # their prefix's home (its home past the load bound: to the shared queue).
        "sent_by_affinity": sent,
        "not_to_home": overflow,
    }
    if joined_at is not None:
        result["join"] = _moved(ok, prefixes, joined_at)
    return result


def _moved(
    rows: list[dict[str, Any]], prefixes: dict[str, str], joined_at: float
) -> dict[str, Any]:
    """Which worker ran most of each prefix's jobs before the join, and which after it (from
    two seconds on: the new worker announced, the lists refilled); the share that changed."""
    before: dict[str, Counter[str]] = {}
    after: dict[str, Counter[str]] = {}
    for r in rows:
        side = (
            before
            if r["started_at"] < joined_at
            else after
            if r["started_at"] > joined_at + 2
            else None
        )
        if side is not None:
            side.setdefault(prefixes[r["id"]], Counter())[str(r["lease_owner"])] += 1
    both = [p for p in before if p in after]
    moved = [p for p in both if before[p].most_common(1)[0][0] != after[p].most_common(1)[0][0]]
    return {
        "prefixes": len(both),
        "moved": len(moved),
        "moved_share": len(moved) / len(both) if both else None,
        "predicted_share": 1 / 3,
    }


def across_workers(opts: Options) -> dict[str, Any]:
    """Affinity against the shared queues for each worker count, then the hot prefix and the
    join (the module docstring)."""
    found: dict[str, Any] = {"affinity": {}, "shared": {}}
    for n in WORKER_COUNTS:
        for side, on in (("affinity", True), ("shared", False)):
            found[side][str(n)] = _run(
                opts, n, on, f"prefix: {n} worker(s), {side}", tenants=TENANTS_PER_WORKER * n
            )
    found["hot"] = {
        side: _run(
            opts, 4, on, f"prefix: one hot prefix, 4 workers, {side}", tenants=16, one_prefix=True
        )
        for side, on in (("affinity", True), ("shared", False))
    }
    found["join"] = _run(
        opts, 2, True, "prefix: a third worker joins", tenants=TENANTS_PER_WORKER * 3, join_at=0.3
    )
    found["summary"] = summary(found)
    return found


def summary(found: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, each as measured (docs/benchmarks.md)."""
    one = found["affinity"]["1"]["hit_rate"] or 0.0
    out: dict[str, Any] = {"one_worker_hit_rate": one, "load_factor": LOAD_FACTOR}
    for n in map(str, WORKER_COUNTS):
        a, s = found["affinity"][n], found["shared"][n]
        out[n] = {
            "hit_rate_over_one_worker": (a["hit_rate"] or 0.0) / one if one else None,
            "throughput_ratio": a["tokens_per_s"] / s["tokens_per_s"]
            if s["tokens_per_s"]
            else None,
            "ttft_p50_ratio": a["ttft_p50_ms"] / s["ttft_p50_ms"] if s["ttft_p50_ms"] else None,
            "max_load_over_mean": a["max_load_over_mean"],
        }
    hot = found["hot"]
    out["hot"] = {
        "throughput_ratio": hot["affinity"]["tokens_per_s"] / hot["shared"]["tokens_per_s"]
        if hot["shared"]["tokens_per_s"]
        else None,
        "max_load_over_mean": hot["affinity"]["max_load_over_mean"],
    }
    return out


def vllm_two_workers(opts: Options) -> dict[str, Any]:
    """vLLM-CPU, two workers of the demo model: the hit rate by vLLM's own counters with and
    without affinity (the same load, ``TENANTS_PER_WORKER`` tenants a worker; vLLM's KV cache
    kept small so that a worker's share of the prefixes fits and all of them do not)."""
    args = json.loads(opts.env.get("INFERQ_VLLM_ENGINE_ARGS") or "{}")
    args.setdefault("num_gpu_blocks_override", KV_BLOCKS)
    sub = Options(
        **{**opts.__dict__, "env": {**opts.env, "INFERQ_VLLM_ENGINE_ARGS": json.dumps(args)}}
    )
    return {
        side: _run(
            sub,
            2,
            on,
            f"prefix: vLLM, 2 workers, {side}",
            tenants=6,
            prefix_words=VLLM_PREFIX_WORDS,
        )
        for side, on in (("affinity", True), ("shared", False))
    }


def prefix(opts: Options) -> dict[str, Any]:
    """The ``prefix`` scenario: on vLLM, one worker grouped against arrival order
    (bench/prefix.py), then two workers with and without prefix affinity; on the SIMULATED
    engine, prefix affinity across 1, 2 and 4 workers."""
    if opts.engine != "vllm":
        return {"engine": opts.engine, **across_workers(opts)}
    return {**one_worker(opts), "two_workers": vllm_two_workers(opts)}
