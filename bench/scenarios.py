"""The scenarios of docs/benchmarks.md; each returns one JSON-able object with its comparison.

Every comparison runs in one invocation, on the same engine settings and the same seeded
workload: the platform side through a stack of real processes (API, Redis, workers, database),
baselines through the same engine in this process.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.core.models import LANE_PRIORITY
from app.core.settings import Settings
from bench.harness import BenchStack, direct_runner, run_direct
from bench.metrics import percentile, summarize
from workers.engines.base import GenRequest

WARMUP = 5
MIXED_STEP_BUDGET_MS = 12.0  # the third side of `mixed`: INFERQ_REALTIME_STEP_MS
MIXED_REALTIME = 300  # realtime jobs per side of `mixed`: a p99 over at least 3 jobs
EFFICIENCY_TARGET = {"simulated": 0.95, "vllm": 0.90}  # docs/benchmarks.md, efficiency
CEILING_SLOTS = 2048
CEILING_CHUNK = 256

Progress = Callable[[str, int, int], None]  # (what, done, total)


@dataclass
class Options:
    engine: str = "simulated"
    database: str = "sqlite"  # or a PostgreSQL admin URL
    postgres: str = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
    workdir: Path = Path(".inferq/bench")
    scale: float = 1.0  # multiplies job counts (0.1 for a quick look)
    repeat: int = 1  # efficiency: direct/platform pairs, alternating; the median pair counts
    history_jobs: int | None = None  # history: finished jobs (None: HISTORY times the scale)
    # peer (bench/peer.py): whose client, and with vLLM's: its loads; both servers at once
    # (None: where a GPU is)
    client: str = "bench"
    concurrencies: tuple[int, ...] = (16, 64)
    input_len: int = 512
    output_len: int = 128
    together: bool | None = None
    progress: Progress = field(default=lambda what, done, total: None)
    env: dict[str, str] = field(default_factory=dict)

    def n(self, jobs: int) -> int:
        return max(8, int(jobs * self.scale))

    def stack_env(self, **values: Any) -> dict[str, str]:
        env = {"INFERQ_ENGINE": self.engine, **self.env}
        env.update({f"INFERQ_{k.upper()}": str(v) for k, v in values.items()})
        return env

    def settings(self, **values: Any) -> Settings:
        fields = {k.removeprefix("INFERQ_").lower(): v for k, v in self.stack_env().items()}
        return Settings(**{**fields, **values})


@dataclass(frozen=True)
class Spec:
    prompt: str
    max_tokens: int
    lane: str
    model: str | None = None  # None: the deployment's default model

    def body(self) -> dict[str, Any]:
        body = {"prompt": self.prompt, "lane": self.lane, "params": {"max_tokens": self.max_tokens}}
        return body if self.model is None else {**body, "model": self.model}

    def request(self, i: int) -> GenRequest:
        return GenRequest(
            request_id=f"direct-{i}",
            prompt=self.prompt,
            messages=None,
            max_tokens=self.max_tokens,
            priority=LANE_PRIORITY[self.lane],
        )


_VOCAB = "tokens queue lane worker engine batch prompt result job model gpu".split()


def workload(n: int, *, seed: int, lane: str, tokens: tuple[int, int], mean: int) -> list[Spec]:
    """Mixed lengths: prompts of 8-256 words, output lengths long-tailed (log-normal) in range."""
    rng = random.Random(seed)
    lo, hi = tokens
    specs = []
    for i in range(n):
        words = rng.randint(8, 256)
        prompt = f"{i} " + " ".join(rng.choice(_VOCAB) for _ in range(words))
        out = int(min(hi, max(lo, rng.lognormvariate(0, 0.8) * mean)))
        specs.append(Spec(prompt, out, lane))
    return specs


# --- platform runs -------------------------------------------------------------------------


def through_platform(
    opts: Options,
    specs: list[Spec],
    what: str,
    *,
    workers: int = 1,
    database: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    db = database or opts.database
    with BenchStack(db, opts.stack_env(**settings), opts.workdir) as stack:
        stack.start(workers=workers)
        start = stack.submit([s.body() for s in specs])
        stack.wait_all(len(specs), 3600, lambda done: opts.progress(what, done, len(specs)))
        rows = stack.rows()
    metrics = summarize(rows, start)
    metrics["database"] = "sqlite" if db == "sqlite" else "postgresql"
    return metrics


def direct(opts: Options, specs: list[Spec], what: str, **settings: Any) -> dict[str, Any]:
    with direct_runner(opts.settings(**settings)) as runner:
        records = run_direct(
            runner,
            [s.request(i) for i, s in enumerate(specs)],
            lambda done: opts.progress(what, done, len(specs)),
        )
    return summarize(records)


def _sim(opts: Options, **values: Any) -> dict[str, Any]:
    """Settings that only apply to the simulated engine."""
    return values if opts.engine == "simulated" else {}


# --- scenarios -----------------------------------------------------------------------------


def efficiency(opts: Options) -> dict[str, Any]:
    n = opts.n(2000) if opts.engine == "simulated" else opts.n(1000)
    mean = 48 if opts.engine == "simulated" else 24
    specs = workload(n, seed=1, lane="bulk", tokens=(4, 256), mean=mean)
    pairs = []
    for r in range(opts.repeat):
        tag = f" ({r + 1}/{opts.repeat})" if opts.repeat > 1 else ""
        base = direct(opts, specs, f"efficiency: direct engine{tag}")
        platform = through_platform(opts, specs, f"efficiency: platform{tag}")
        pairs.append((platform["output_throughput"] / base["output_throughput"], base, platform))
    # On a shared machine one pair can be off by 10-20 % either way (docs/benchmarks.md):
    # alternating pairs and taking the median pair is robust to one slow phase.
    ordered = sorted(pairs, key=lambda pair: pair[0])
    ratio, base, platform = ordered[(len(ordered) - 1) // 2]
    return {
        "engine": opts.engine,
        "jobs": n,
        "direct": base,
        "platform": platform,
        "ratio": ratio,
        "ratios": [round(pair[0], 3) for pair in pairs],
        "target": EFFICIENCY_TARGET.get(opts.engine, 0.9),
    }


def ladder(opts: Options) -> dict[str, Any]:
    n = opts.n(160)
    specs = workload(n, seed=2, lane="bulk", tokens=(4, 512), mean=48)
    # Serial is slow by nature; half speed keeps the ladder short while steps stay long
    # enough (~17 ms) that Python's per-step cost does not blur the comparison.
    scale = _sim(opts, sim_time_scale=0.5)
    serial = through_platform(opts, specs, "ladder: serial", worker_concurrency=1, **scale)
    static = through_platform(
        opts,
        specs,
        "ladder: static micro-batches",
        batching="micro",
        micro_batch_max_size=16,
        micro_batch_max_wait_ms=100,
        **scale,
    )
    continuous = through_platform(opts, specs, "ladder: continuous", **scale)
    return {
        "engine": opts.engine,
        "jobs": n,
        "time_scale": scale.get("sim_time_scale", 1.0),
        "serial": serial,
        "static": static,
        "continuous": continuous,
        "continuous_over_static": continuous["output_throughput"] / static["output_throughput"],
        "continuous_over_serial": continuous["output_throughput"] / serial["output_throughput"],
    }


def _realtime_load(
    stack: BenchStack,
    specs: list[Spec],
    rate: float,
    what: str,
    opts: Options,
    each_second: Callable[[], None] = lambda: None,
) -> list[str]:
    ids: list[str] = []
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        t0 = time.monotonic()
        for i, spec in enumerate(specs):
            if i % int(rate) == 0:
                each_second()
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            r = c.post("/v1/jobs", json=spec.body())
            r.raise_for_status()
            ids.append(r.json()["id"])
            opts.progress(what, i + 1, len(specs))
    return ids


def _realtime_run(
    opts: Options,
    rt: list[Spec],
    bulk: list[Spec],
    what: str,
    workers: tuple[dict[str, str], ...] = ({},),
    **settings: Any,
) -> dict[str, Any]:
    """Realtime jobs at 10/s, alone or once a bulk backlog fills its lane; ``workers``: the
    extra environment of each worker (one model each in ``models``)."""
    # Heartbeats each second: the worker's record in Redis (its intake, its engine's step time)
    # stays fresh enough to tell when bulk has reached its cap and how long a step takes.
    env = opts.stack_env(heartbeat_s=1, **settings)
    with BenchStack(opts.database, env, opts.workdir) as stack:
        stack.start(workers=0)
        for i, worker_env in enumerate(workers):
            stack.add_worker(i, worker_env)
        if bulk:
            stack.submit([s.body() for s in bulk])

            def saturated() -> bool:
                for record in stack.worker_records():
                    intake = record.get("intake") or {}
                    reserved = intake.get("reserved", {})
                    cap = intake.get("slots", 0) - sum(
                        v for k, v in reserved.items() if k != "bulk"
                    )
                    if intake.get("used", {}).get("bulk", 0) >= cap - 32:
                        return True
                return False

            deadline = time.monotonic() + 120
            while not saturated() and time.monotonic() < deadline:
                time.sleep(0.2)
        # Warm the path up (first claims, statement caches) outside the measurement.
        warm = _realtime_load(stack, rt[:WARMUP], 10.0, f"{what} (warm-up)", opts)
        stack.wait_all(len(warm), 300, ids=warm)
        step_ms: list[float] = []
        start = time.time()
        ids = _realtime_load(stack, rt, 10.0, what, opts, lambda: step_ms.extend(_steps(stack)))
        stack.wait_all(len(ids), 300, ids=ids)
        end = time.time()
        rows = stack.rows(ids)
        bulk_running = stack.rows(lane="bulk", status="running")
        bulk_done = stack.rows(lane="bulk", status="succeeded") if bulk else []
        model_of = {r["worker_id"]: r["model"] for r in stack.worker_records()}
        ran = [r for r in stack.rows() if r["lease_owner"] is not None]
    metrics = summarize(rows)
    # Jobs that ran on a worker of another model than their own (the job rows say who ran them).
    metrics["misrouted"] = sum(1 for r in ran if model_of.get(r["lease_owner"]) != r["model"])
    metrics["jobs_run"] = len(ran)
    metrics["bulk_running_at_end"] = len(bulk_running)
    if bulk:
        # Bulk's output rate while the realtime load lasted: what protecting realtime costs.
        tokens = sum(
            r["completion_tokens"] or 0 for r in bulk_done if start <= r["finished_at"] <= end
        )
        metrics["bulk_output_throughput"] = tokens / (end - start)
    metrics["engine_step_ms"] = statistics.median(step_ms) if step_ms else None
    metrics["stages"] = job_stages(rows)
    return metrics


def _steps(stack: BenchStack) -> list[float]:
    """The engine step time the workers announce (median of their recent steps)."""
    return [r["step_ms"] for r in stack.worker_records() if r.get("step_ms") is not None]


# (name, from, to) over a job's own timestamps: where a realtime job's time to first token goes.
JOB_STAGES = (
    ("accepted_to_enqueued", "created_at", "enqueued_at"),
    ("enqueued_to_claimed", "enqueued_at", "started_at"),
    ("claimed_to_first_token", "started_at", "first_token_at"),
)


def job_stages(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p99 (ms) of each stage of :data:`JOB_STAGES` over the jobs that have them all."""
    complete = [
        r for r in rows if all(r.get(c) is not None for _, a, b in JOB_STAGES for c in (a, b))
    ]
    return {
        name: {
            "p50_ms": percentile([(r[end] - r[start]) * 1000 for r in complete], 50),
            "p99_ms": percentile([(r[end] - r[start]) * 1000 for r in complete], 99),
        }
        for name, start, end in JOB_STAGES
    } | {"jobs": len(complete)}


def _ttft_targets(idle: dict[str, Any], step: float) -> tuple[float, float]:
    """docs/benchmarks.md, "mixed": the physical limit of an engine that does not preempt its
    step. A realtime request arriving during a bulk step waits half of it on average, then
    takes its own prefill step: loaded p50 ≤ idle p50 + 1.5 steps; p99 ≤ idle p99 + 2 steps
    + 30 ms."""
    return idle["median_ttft_ms"] + 1.5 * step, idle["p99_ttft_ms"] + 2 * step + 30.0


def mixed(opts: Options) -> dict[str, Any]:
    rt = workload(opts.n(MIXED_REALTIME), seed=3, lane="realtime", tokens=(8, 64), mean=24)
    bulk = workload(opts.n(4000), seed=4, lane="bulk", tokens=(16, 256), mean=96)
    idle = _realtime_run(opts, rt, [], "mixed: realtime on an idle system")
    loaded = _realtime_run(opts, rt, bulk, "mixed: realtime with a bulk backlog")
    budget = _realtime_run(
        opts,
        rt,
        bulk,
        f"mixed: the same, steps kept under {MIXED_STEP_BUDGET_MS:g} ms",
        realtime_step_ms=MIXED_STEP_BUDGET_MS,
    )
    p50_target, p99_target = _ttft_targets(idle, loaded["engine_step_ms"] or 0.0)
    budget_p50_target, budget_p99_target = _ttft_targets(idle, budget["engine_step_ms"] or 0.0)
    return {
        "engine": opts.engine,
        "realtime_jobs": len(rt),
        "bulk_backlog": len(bulk),
        "engine_step_ms": loaded["engine_step_ms"],
        "idle": idle,
        "loaded": loaded,
        # The same backlog with INFERQ_REALTIME_STEP_MS: targets as below, against its own
        # (shorter) step, and the bulk throughput it gives up (docs/benchmarks.md, "mixed").
        "budget": budget,
        "step_budget_ms": MIXED_STEP_BUDGET_MS,
        "budget_engine_step_ms": budget["engine_step_ms"],
        "budget_realtime_ttft_p50_ms": budget["median_ttft_ms"],
        "budget_realtime_ttft_p99_ms": budget["p99_ttft_ms"],
        "budget_ttft_p50_target_ms": budget_p50_target,
        "budget_ttft_p99_target_ms": budget_p99_target,
        # None when no bulk job ended during the load (a small --scale can drain the backlog).
        "budget_bulk_throughput_ratio": budget["bulk_output_throughput"]
        / loaded["bulk_output_throughput"]
        if loaded["bulk_output_throughput"]
        else None,
        "idle_realtime_ttft_p99_ms": idle["p99_ttft_ms"],
        "realtime_ttft_p99_ms": loaded["p99_ttft_ms"],
        "idle_realtime_ttft_p50_ms": idle["median_ttft_ms"],
        "realtime_ttft_p50_ms": loaded["median_ttft_ms"],
        "idle_realtime_e2el_p99_ms": idle["p99_e2el_ms"],
        "realtime_e2el_p99_ms": loaded["p99_e2el_ms"],
        "ttft_p50_target_ms": p50_target,
        "ttft_p99_target_ms": p99_target,
    }


MODEL_A, MODEL_B = "model-a", "model-b"


def models(opts: Options) -> dict[str, Any]:
    """Two models on two workers: model B's realtime traffic alone, then while model A has a
    bulk backlog (docs/benchmarks.md, "models")."""
    rt = [
        Spec(s.prompt, s.max_tokens, s.lane, MODEL_B)
        for s in workload(opts.n(MIXED_REALTIME), seed=3, lane="realtime", tokens=(8, 64), mean=24)
    ]
    bulk = [
        Spec(s.prompt, s.max_tokens, s.lane, MODEL_A)
        for s in workload(opts.n(4000), seed=4, lane="bulk", tokens=(16, 256), mean=96)
    ]
    workers = tuple({"INFERQ_SERVED_MODEL_NAME": m} for m in (MODEL_A, MODEL_B))
    alone = _realtime_run(opts, rt, [], "models: B's realtime, A idle", workers)
    loaded = _realtime_run(opts, rt, bulk, "models: B's realtime, A's bulk backlog", workers)
    return {
        "engine": opts.engine,
        "realtime_jobs": len(rt),
        "bulk_backlog": len(bulk),
        "alone": alone,
        "loaded": loaded,
        "misrouted": alone["misrouted"] + loaded["misrouted"],
        "jobs_checked": alone["jobs_run"] + loaded["jobs_run"],
        "ttft_p50_ratio": loaded["median_ttft_ms"] / alone["median_ttft_ms"],
        "ttft_p99_over_alone_ms": loaded["p99_ttft_ms"] - alone["p99_ttft_ms"],
    }


def ceiling(opts: Options) -> dict[str, Any]:
    n = opts.n(20000)
    specs = [Spec(f"ceiling {i}", 1, "bulk") for i in range(n)]
    metrics = through_platform(
        opts,
        specs,
        "ceiling: instant engine",
        database=opts.postgres,
        engine="simulated",
        sim_time_scale=0,
        # With an engine that costs nothing, the worker's slots are not an engine limit: give
        # it many, and larger bulk messages, so that the platform's own cost is what is measured.
        worker_concurrency=CEILING_SLOTS,
        sim_max_num_seqs=CEILING_SLOTS,
        bulk_chunk_size=CEILING_CHUNK,
    )
    return {
        "engine": "simulated (instant: time_scale 0)",
        "worker_concurrency": CEILING_SLOTS,
        "bulk_chunk_size": CEILING_CHUNK,
        "jobs": n,
        "database": "postgresql",
        "jobs_per_s": metrics["request_throughput"],
        "platform": metrics,
    }


def scaleout(opts: Options) -> dict[str, Any]:
    n = opts.n(3000)
    specs = workload(n, seed=5, lane="bulk", tokens=(4, 128), mean=32)
    one = through_platform(opts, specs, "scaleout: one worker", workers=1)
    two = through_platform(opts, specs, "scaleout: two workers", workers=2)
    return {
        "engine": opts.engine,
        "jobs": n,
        "one": one,
        "two": two,
        "two_over_one": two["output_throughput"] / one["output_throughput"],
    }


def _rss_mb(pid: int) -> dict[str, float]:
    """Resident memory now and at its peak (Linux ``VmRSS`` / ``VmHWM``), in MiB."""
    fields = {}
    for row in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = row.partition(":")
        if name in ("VmRSS", "VmHWM"):
            fields[name] = int(value.split()[0]) / 1024
    return {"rss_mb": fields["VmRSS"], "peak_mb": fields["VmHWM"]}


def batchfile(opts: Options) -> dict[str, Any]:
    """A large batch input file: upload, validation and the start of its jobs, and memory.

    No inference worker runs: what is measured is the file's way in (API upload, the ops
    worker's streaming pass and the insert of one job per line, a chunk at a time), not
    generation.
    """
    n = max(8, int(50_000 * opts.scale))
    prompt = " ".join(_VOCAB[i % len(_VOCAB)] for i in range(160))  # ~1 KB per line
    with BenchStack(opts.postgres, opts.stack_env(), opts.workdir) as stack:
        stack.start(workers=0)
        ops = stack.add_ops()
        api = next(c for c in stack.children if c.name == "api")
        assert api.proc is not None and ops.proc is not None
        path = stack.workdir / "input.jsonl"
        model = opts.settings().model_name  # once: a Settings a line took the run 5 minutes
        with path.open("w") as out:
            for i in range(n):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": f"{i} {prompt}"}],
                    "max_tokens": 16,
                }
                line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
                out.write(json.dumps({**line, "body": body}) + "\n")
        size = path.stat().st_size
        before = {"api": _rss_mb(api.proc.pid), "ops": _rss_mb(ops.proc.pid)}
        opts.progress("batchfile: upload", 0, 3)
        with httpx.Client(base_url=stack.url, timeout=600) as c:
            started = time.perf_counter()
            file_id = stack.upload(c, path)
            upload_s = time.perf_counter() - started
            opts.progress("batchfile: validate and start", 1, 3)
            created = time.perf_counter()
            batch = stack.start_batch(c, file_id)
            start_s = time.perf_counter() - created
            opts.progress("batchfile: done", 3, 3)
        after = {"api": _rss_mb(api.proc.pid), "ops": _rss_mb(ops.proc.pid)}
    if batch["status"] != "in_progress":
        raise RuntimeError(f"the batch did not start: {batch['status']} {batch.get('errors')}")
    return {
        "engine": "none (no inference worker)",
        "lines": n,
        "file_mb": size / 2**20,
        "upload_s": upload_s,
        "validate_and_start_s": start_s,
        "lines_per_s": n / start_s,
        "database": "postgresql",
        "memory_mb": {
            who: {
                "before": before[who]["rss_mb"],
                "peak": after[who]["peak_mb"],
                "growth": after[who]["peak_mb"] - before[who]["rss_mb"],
            }
            for who in ("api", "ops")
        },
    }


SCENARIOS: dict[str, Callable[[Options], dict[str, Any]]] = {
    "efficiency": efficiency,
    "ladder": ladder,
    "mixed": mixed,
    "ceiling": ceiling,
    "scaleout": scaleout,
    "batchfile": batchfile,
    "models": models,
}
