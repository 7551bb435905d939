"""The ``overhead`` scenario: what the realtime lane costs over a bare server, engine held equal.

Both sides run the SIMULATED engine (it spends no CPU, so every millisecond is the platform's)
with the same settings and get the same streaming client (bench/streaming.py): chat
completions with ``stream: true`` from N concurrent clients, each sending its next request
when the previous one has ended, at N = 16 and N = 64.

- **floor**: bench/floor.py, an OpenAI-compatible SSE server holding the engine
  in-process, as vLLM's server holds its own;
- **inferq**: ``/v1/chat/completions`` on the whole stack (API, Redis, one worker, ops worker,
  PostgreSQL), each call a durable realtime job; at 64 clients a second time with two API
  processes (``inferq api --workers 2``: ``api_processes_2``).

Each side's **CPU per call** is measured too (``cpu_ms_per_call``): the CPU time its processes
spent over the run (user + system, the process and its children, psutil), over the calls made
(warm-up rounds included, as their CPU is in the same window): for inferq the API, the worker,
the dispatcher and the ops worker, ``total`` being the first three (what a realtime call goes
through); for the floor its one server.

For inferq the time to first token is split into stages from each job's own timestamps
(docs/benchmarks.md, "overhead"): sent (client) → accepted (``created_at``) → committed (the
``job.queued`` log line, written right after the commit) → enqueued (``enqueued_at``) →
claimed (``started_at``) → first token at the worker (``first_token_at``) → first byte at the
client.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from app.cli.stack import Child, wait_ready
from bench.harness import POLL_S, BenchStack, free_port
from bench.metrics import percentile, summarize
from bench.scenarios import Options, workload
from bench.streaming import stream_all

CLIENTS = (16, 64)
# Where the stack is also run with two API processes (`inferq api --workers 2`) beside one.
API_PROCESSES_AT = (64,)
REQUESTS_PER_CLIENT = 25  # 400 measured requests at 16 clients, 1,600 at 64
# Each client's first rounds warm the path up (connections, caches) inside the same closed
# loop; they are not measured, so neither is the start's burst of N requests at once, a
# transient of the bench that no steady load has (both sides alike).
WARMUP_ROUNDS = 2
PATH = "/v1/chat/completions"
# (name, from, to): the stages of a realtime call, each a span between two timestamps.
STAGES = (
    ("sent_to_accepted", "sent", "accepted"),
    ("accepted_to_committed", "accepted", "committed"),
    ("committed_to_enqueued", "committed", "enqueued"),
    ("enqueued_to_claimed", "enqueued", "claimed"),
    ("claimed_to_first_token", "claimed", "first_token"),
    ("first_token_to_client", "first_token", "client_first_byte"),
)


# The parts a realtime call goes through (their Child names in BenchStack), and the one beside.
CALL_PARTS = {"api": "api", "worker": "worker0", "dispatcher": "dispatch"}
OTHER_PARTS = {"ops": "ops"}


def cpu_seconds(child: Child) -> float:
    """CPU seconds (user + system) a child and its live descendants have used so far."""
    if child.proc is None:
        return 0.0
    try:
        root = psutil.Process(child.proc.pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = process.cpu_times()
            total += times.user + times.system
    return total


def cpu_sample(children: list[Child], parts: Mapping[str, str]) -> dict[str, float]:
    by_name = {child.name: child for child in children}
    return {part: cpu_seconds(by_name[name]) for part, name in parts.items() if name in by_name}


def cpu_per_call(
    before: dict[str, float], after: dict[str, float], calls: int, total_of: list[str]
) -> dict[str, float]:
    """Milliseconds of CPU per call of each part, and ``total`` over ``total_of``."""
    spent = {part: (after[part] - before[part]) * 1000 / max(1, calls) for part in after}
    return {
        **{part: round(ms, 3) for part, ms in spent.items()},
        "total": round(sum(spent[part] for part in total_of if part in spent), 3),
    }


def _bodies(n: int, model: str) -> list[dict[str, Any]]:
    specs = workload(n, seed=7, lane="realtime", tokens=(8, 64), mean=32)
    return [
        {
            "model": model,
            # ~30 words: a short interactive prompt, like the realtime profile's.
            "messages": [{"role": "user", "content": " ".join(s.prompt.split()[:30])}],
            "max_tokens": s.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for s in specs
    ]


def _run(url: str, bodies: list[dict[str, Any]], clients: int, what: str, opts: Options) -> Any:
    warm = WARMUP_ROUNDS * clients
    total = len(bodies)
    return stream_all(
        url, PATH, bodies, clients, lambda done: opts.progress(what, done, total), skip=warm
    )


def _floor(opts: Options, bodies: list[dict[str, Any]], clients: int) -> dict[str, Any]:
    port = free_port()
    with BenchStack("sqlite", opts.stack_env(engine="simulated"), opts.workdir) as stack:
        server = stack.spawn("floor", [sys.executable, "-m", "bench.floor", "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        wait_ready(
            "floor",
            60,
            lambda: httpx.get(f"{url}/health").status_code == 200,
            server,
            poll_s=POLL_S,
        )
        before = cpu_sample(stack.children, {"server": "floor"})
        result = summarize(_run(url, bodies, clients, f"overhead {clients}: floor", opts))
        after = cpu_sample(stack.children, {"server": "floor"})
        result["cpu_ms_per_call"] = cpu_per_call(before, after, len(bodies), ["server"])
        return result


def _committed_at(log: Path) -> dict[str, float]:
    """job id -> when its ``job.queued`` line was written (right after the commit)."""
    found: dict[str, float] = {}
    for line in log.read_text(errors="replace").splitlines():
        if '"event":"job.queued"' not in line:
            continue
        record = json.loads(line)
        found[record["job_id"]] = datetime.fromisoformat(record["ts"]).timestamp()
    return found


def stages(records: list[dict[str, Any]], rows: list[dict[str, Any]], log: Path) -> dict[str, Any]:
    """p50/p99 of each stage (ms) over the calls whose job has every timestamp."""
    by_id = {row["id"]: row for row in rows}
    committed = _committed_at(log)
    spans: dict[str, list[float]] = {name: [] for name, _, _ in STAGES}
    for record in records:
        row = by_id.get(record.get("job_id") or "")
        if row is None or record.get("first_token_at") is None:
            continue
        points = {
            "sent": record["created_at"],
            "accepted": row["created_at"],
            "committed": committed.get(row["id"]),
            "enqueued": row["enqueued_at"],
            "claimed": row["started_at"],
            "first_token": row["first_token_at"],
            "client_first_byte": record["first_token_at"],
        }
        if any(value is None for value in points.values()):
            continue
        for name, start, end in STAGES:
            spans[name].append((points[end] - points[start]) * 1000)
    return {
        name: {"p50_ms": percentile(values, 50), "p99_ms": percentile(values, 99)}
        for name, values in spans.items()
    } | {"jobs": len(spans[STAGES[0][0]])}


def _inferq(
    opts: Options, bodies: list[dict[str, Any]], clients: int, api_processes: int = 1
) -> dict[str, Any]:
    with BenchStack(opts.postgres, opts.stack_env(engine="simulated"), opts.workdir) as stack:
        stack.start(api_processes=api_processes)
        stack.add_ops()
        parts = {**CALL_PARTS, **OTHER_PARTS}
        before = cpu_sample(stack.children, parts)
        records = _run(stack.url, bodies, clients, f"overhead {clients}: inferq", opts)
        after = cpu_sample(stack.children, parts)
        rows = stack.rows([r["job_id"] for r in records if r.get("job_id")])
        result = summarize(records)
        result["cpu_ms_per_call"] = cpu_per_call(before, after, len(bodies), list(CALL_PARTS))
        result["stages"] = stages(records, rows, stack.workdir / "logs" / "api.log")
    return result


def _against(ours: dict[str, Any], floor: dict[str, Any]) -> dict[str, Any]:
    """An inferq run and how it compares with the floor's run of the same calls."""
    return {
        "inferq": ours,
        "throughput_ratio": ours["output_throughput"] / floor["output_throughput"],
        "ttft_p50_over_floor_ms": ours["median_ttft_ms"] - floor["median_ttft_ms"],
        "ttft_p99_over_floor_ms": ours["p99_ttft_ms"] - floor["p99_ttft_ms"],
        "inferq_cpu_ms_per_call": ours["cpu_ms_per_call"]["total"],
        "cpu_ms_per_call_over_floor": ours["cpu_ms_per_call"]["total"]
        / max(1e-9, floor["cpu_ms_per_call"]["total"]),
    }


def overhead(opts: Options) -> dict[str, Any]:
    model = opts.settings(engine="simulated").model_name
    result: dict[str, Any] = {"engine": "simulated", "database": "postgresql", "path": PATH}
    for clients in CLIENTS:
        bodies = _bodies(opts.n(REQUESTS_PER_CLIENT * clients) + WARMUP_ROUNDS * clients, model)
        floor = _floor(opts, bodies, clients)
        ours = _inferq(opts, bodies, clients)
        result[str(clients)] = {
            "clients": clients,
            "requests": len(bodies) - WARMUP_ROUNDS * clients,
            "warmup_requests": WARMUP_ROUNDS * clients,
            "floor": floor,
            **_against(ours, floor),
        }
        if clients in API_PROCESSES_AT:
            # Does a second API process help on the bench's cores, and what does it cost?
            two = _inferq(opts, bodies, clients, api_processes=2)
            result[str(clients)]["api_processes_2"] = _against(two, floor)
    return result
