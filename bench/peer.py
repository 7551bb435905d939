"""The ``peer`` scenario: the same workload against ``vllm serve`` and against inferq.

Both sides run the same model (the configured one, or the demo model) with the same vLLM
engine arguments (``VLLMEngine.engine_args``, the KV cache given in bytes to both) and get the
same client. Two clients (``Options.client``):

- ``bench``: this package's streaming client (bench/streaming.py): ``/v1/completions`` from
  ``PEER_CLIENTS`` concurrent clients, each sending its next request when the previous one has
  ended, with the mixed lengths of the other scenarios; one server after the other.
- ``vllm``: vLLM's own ``vllm bench serve`` (bench/vllm_client.py): random prompts of
  ``input_len`` tokens, ``output_len`` tokens each with ``--ignore-eos``, at each of
  ``concurrencies`` and on ``/v1/completions`` and ``/v1/chat/completions``; inferq first, then
  ``vllm serve``, alternating. Where a GPU is, both servers run together (each with
  ``TOGETHER_FRACTION`` as its memory fraction) and every run alternates; otherwise (a CPU)
  inferq's stack runs all its loads, then ``vllm serve`` runs the same, as many rounds as
  ``--repeat``. Beside each run: the CPU milliseconds of each server's process tree per request
  the client sent, and the engine's own inter-token time from vLLM's metrics on each side (vLLM
  stamps it with the engine core's clock: does inferq's worker slow what the engine produces?).
  A pair with a failed request, or none answered, has no comparison (the report says missed).

On inferq every request is a realtime job (stored, queued, leased, recorded) whose tokens are
relayed from the worker through Redis. docs/benchmarks.md ("peer") says how to read it.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from app.cli.stack import wait_ready
from bench.harness import POLL_S, BenchStack, free_port, gpus
from bench.metrics import gauge, read_gauges, summarize
from bench.overhead import WARMUP_ROUNDS, cpu_per_call, cpu_sample
from bench.scenarios import Options, Spec, workload
from bench.streaming import stream_all
from bench.vllm_client import ENDPOINTS, Load
from bench.vllm_client import run as run_client
from workers.engines import resolve_model
from workers.engines.vllm import VLLMEngine

PEER_CLIENTS = 16
# The `vllm` client's targets (the GPU issue): inferq's output tok/s at least this share of
# vllm serve's, its TTFT p50 at most this much above, at every concurrency and endpoint.
TARGETS = {"bench": (0.9, 30.0), "vllm": (0.95, 20.0)}
ROUNDS = 6  # prompts of a run: ROUNDS times its concurrency (times --scale), at least one round
# Of a GPU's memory, each side's when both run together: what both took on an H200 (docs/gpu.md).
TOGETHER_FRACTION = 0.40
GPU_KV_GIB = 20  # the KV cache of each side on a GPU unless INFERQ_VLLM_ENGINE_ARGS gives one
# The parts of each server whose CPU is counted (BenchStack's child names).
INFERQ_PARTS = {"api": "api", "worker": "worker0", "dispatcher": "dispatch", "redis": "redis"}
SERVE_PARTS = {"vllm serve": "vllm-serve"}


def engine_args(opts: Options, together: bool = False) -> dict[str, Any]:
    """The engine arguments both sides run with: the deployment's, with the KV cache in bytes
    (the one given, else ``GPU_KV_GIB`` on a GPU, ``INFERQ_VLLM_CPU_KVCACHE_GIB`` on a CPU) and,
    where both run ``together``, ``TOGETHER_FRACTION`` as each side's memory fraction. With the
    KV cache given in bytes vLLM sizes nothing by the fraction (v1/worker/gpu_worker.py): it is
    what its start checks is free, so each side holds its weights, that cache and its
    activations."""
    settings = opts.settings(engine="vllm")
    model, served = resolve_model(settings)
    args = VLLMEngine(model, served, settings).engine_args()
    if "kv_cache_memory_bytes" not in args:
        gib = GPU_KV_GIB if gpus() else settings.vllm_cpu_kvcache_gib
        args["kv_cache_memory_bytes"] = gib << 30
    if together:
        share = min(float(args["gpu_memory_utilization"]), TOGETHER_FRACTION)
        args["gpu_memory_utilization"] = share
    return args


def _together(opts: Options) -> bool:
    return opts.together if opts.together is not None else bool(gpus())


def _serve_argv(args: dict[str, Any], port: int) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1"]
    argv += ["--port", str(port)]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif isinstance(value, dict):
            argv += [flag, json.dumps(value)]
        else:
            argv += [flag, str(value)]
    return argv


@dataclass
class Server:
    """One side, started: where its API and vLLM's metrics are, and whose CPU counts."""

    name: str  # "inferq" or "vllm_serve"
    url: str
    metrics_url: str
    stack: BenchStack
    parts: dict[str, str]


@contextmanager
def _vllm_serve(opts: Options, args: dict[str, Any]) -> Iterator[Server]:
    port = free_port()
    settings = opts.settings(engine="vllm")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_cpu_kvcache_gib)}
    with BenchStack("sqlite", opts.stack_env(), opts.workdir) as stack:
        serve = stack.spawn("vllm-serve", _serve_argv(args, port), env)
        url = f"http://127.0.0.1:{port}"
        wait_ready(
            "vllm serve",
            900,
            lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
            serve,
            poll_s=POLL_S,
        )
        yield Server("vllm_serve", url, f"{url}/metrics", stack, SERVE_PARTS)


@contextmanager
def _inferq(opts: Options, args: dict[str, Any]) -> Iterator[Server]:
    env = opts.stack_env(engine="vllm", vllm_engine_args=json.dumps(_extra(opts, args)))
    with BenchStack(opts.database, env, opts.workdir) as stack:
        stack.start()
        (record,) = stack.worker_records()
        yield Server("inferq", stack.url, str(record["metrics_url"]), stack, INFERQ_PARTS)


def _extra(opts: Options, args: dict[str, Any]) -> dict[str, Any]:
    """INFERQ_VLLM_ENGINE_ARGS: the deployment's, with what ``engine_args`` set (the worker
    applies these last, so they win over ``INFERQ_VLLM_*`` as they do on `vllm serve`)."""
    extra = dict(opts.settings(engine="vllm").vllm_engine_args)
    for key in ("kv_cache_memory_bytes", "gpu_memory_utilization"):
        extra[key] = args[key]
    return extra


# vLLM's own counters of what its engine did (v1/metrics/loggers.py): the inter-token latency
# is stamped with the engine core's clock, so under load its mean is the engine's step time as
# the engine sees it; iteration_tokens_total is observed once a step; the prompt and generated
# tokens split a step's tokens into prefill and decoding (one token a decoding sequence), what
# the simulated engine's step cost is a function of (docs/engines.md).
ITL = "vllm:inter_token_latency_seconds"
STEP_TOKENS = "vllm:iteration_tokens_total"
PROMPT = "vllm:prompt_tokens_total"
GENERATED = "vllm:generation_tokens_total"
COUNTERS = (
    f"{ITL}_sum", f"{ITL}_count", f"{STEP_TOKENS}_sum", f"{STEP_TOKENS}_count", PROMPT, GENERATED
)  # fmt: skip


def _engine_counters(url: str) -> dict[str, float]:
    samples = read_gauges(url)
    return {name: gauge(samples, name) or 0.0 for name in COUNTERS}


def _engine_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    delta = {name: after[name] - before[name] for name in after}
    steps = delta[f"{STEP_TOKENS}_count"]
    itls = delta[f"{ITL}_count"]
    return {
        "engine_itl_mean_ms": 1000 * delta[f"{ITL}_sum"] / itls if itls else None,
        "engine_steps": steps,
        "engine_tokens_per_step": delta[f"{STEP_TOKENS}_sum"] / steps if steps else None,
        "engine_prompt_tokens_per_step": delta[PROMPT] / steps if steps else None,
        "engine_generated_tokens_per_step": delta[GENERATED] / steps if steps else None,
    }


def _measure(opts: Options, server: Server, load: Load, name: str) -> dict[str, Any]:
    children = server.stack.children
    cpu_before = cpu_sample(children, server.parts)
    engine_before = _engine_counters(server.metrics_url)
    opts.progress(f"peer: {name}", 0, load.prompts)
    summary = run_client(load, server.url, opts.workdir / "peer", name)
    opts.progress(f"peer: {name}", summary.get("completed") or 0, load.prompts)
    # Per request the client sent: its readiness check and warm-up requests ran on the server
    # too, and are of the same shape.
    sent = int(summary.get("completed") or 0) + int(summary.get("failed") or 0)
    cpu = cpu_per_call(
        cpu_before,
        cpu_sample(children, server.parts),
        sent + summary["unmeasured"],
        list(server.parts),
    )
    return {
        **summary,
        "cpu_ms_per_request": cpu,
        **_engine_step(engine_before, _engine_counters(server.metrics_url)),
    }


def _loads(opts: Options, args: dict[str, Any]) -> list[Load]:
    """Each endpoint at each concurrency, on the model both sides serve (``args``)."""
    return [
        Load(
            endpoint=endpoint,
            concurrency=c,
            prompts=max(c, round(ROUNDS * c * opts.scale)),
            input_len=opts.input_len,
            output_len=opts.output_len,
            model=str(args["served_model_name"]),
            tokenizer=str(args["model"]),
        )
        for endpoint in ENDPOINTS
        for c in opts.concurrencies
    ]


def _key(load: Load) -> str:
    return f"{load.endpoint}/{load.concurrency}"


def _with_vllm_client(opts: Options) -> dict[str, Any]:
    together = _together(opts)
    args = engine_args(opts, together)
    loads = _loads(opts, args)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        _key(load): {"inferq": [], "vllm_serve": []} for load in loads
    }

    def one(server: Server, load: Load, r: int) -> None:
        name = f"{server.name}-{load.endpoint}-c{load.concurrency}-r{r}"
        runs[_key(load)][server.name].append(_measure(opts, server, load, name))

    if together:
        with ExitStack() as started:
            # Both at once: each profiles its memory within its own share, and the KV cache
            # is the same bytes on both (docs/gpu.md).
            ours = started.enter_context(_inferq(opts, args))
            theirs = started.enter_context(_vllm_serve(opts, args))
            for r in range(opts.repeat):
                for load in loads:
                    one(ours, load, r)
                    one(theirs, load, r)
    else:
        for r in range(opts.repeat):
            with _inferq(opts, args) as ours:
                for load in loads:
                    one(ours, load, r)
            with _vllm_serve(opts, args) as theirs:
                for load in loads:
                    one(theirs, load, r)
    pairs = {key: _pair(sides) for key, sides in runs.items()}
    throughput, ttft = TARGETS["vllm"]
    return {
        "client": "vllm",
        "together": together,
        "engine_args": args,
        "input_len": opts.input_len,
        "output_len": opts.output_len,
        "concurrencies": list(opts.concurrencies),
        "repeat": opts.repeat,
        "pairs": pairs,
        "runs": runs,
        # Every pair must meet the targets: the worst one is what the table checks, and a pair
        # with a failed request, or none answered, has no figure (the table says missed).
        "inferq_over_vllm_serve": _worst(pairs, "inferq_over_vllm_serve", min),
        "ttft_p50_over_vllm_serve_ms": _worst(pairs, "ttft_p50_over_vllm_serve_ms", max),
        "failed": sum(p[side]["failed"] for p in pairs.values() for side in SIDES),
        "throughput_target": throughput,
        "ttft_target_ms": ttft,
    }


SIDES = ("inferq", "vllm_serve")


def _worst(pairs: dict[str, dict[str, Any]], key: str, pick: Any) -> float | None:
    values = [pair[key] for pair in pairs.values()]
    return None if None in values else pick(values)


def _pair(sides: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One endpoint and concurrency: each side's runs (the median of each figure over
    ``--repeat`` rounds) and the two comparisons."""

    def median(side: str, key: str) -> float | None:
        values = [run[key] for run in sides[side] if run.get(key) is not None]
        return statistics.median(values) if values else None

    figures = (
        "output_throughput",
        "request_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "median_itl_ms",
        "median_e2el_ms",
        "engine_itl_mean_ms",
    )
    out: dict[str, Any] = {
        side: {
            **{key: median(side, key) for key in figures},
            "cpu_ms_per_request": statistics.median(
                run["cpu_ms_per_request"]["total"] for run in sides[side]
            ),
            "failed": sum(int(run.get("failed") or 0) for run in sides[side]),
            "completed": sum(int(run.get("completed") or 0) for run in sides[side]),
        }
        for side in SIDES
    }
    ours, theirs = out["inferq"], out["vllm_serve"]
    whole = all(
        side["failed"] == 0 and side["completed"] > 0 and side["output_throughput"]
        for side in (ours, theirs)
    )
    out["inferq_over_vllm_serve"] = (
        ours["output_throughput"] / theirs["output_throughput"] if whole else None
    )
    out["ttft_p50_over_vllm_serve_ms"] = (
        ours["median_ttft_ms"] - theirs["median_ttft_ms"] if whole else None
    )
    return out


# --- the bench client --------------------------------------------------------------------------


def _stream_all(
    opts: Options, url: str, model: str, specs: list[Spec], what: str
) -> dict[str, Any]:
    """``PEER_CLIENTS`` concurrent clients, each streaming one completion after another; the
    first rounds warm up and are not measured (bench/streaming.py)."""
    warm = specs[: WARMUP_ROUNDS * PEER_CLIENTS]
    bodies = [
        {
            "model": model,
            "prompt": spec.prompt,
            "max_tokens": spec.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for spec in [*warm, *specs]
    ]
    total = len(bodies)
    records = stream_all(
        url,
        "/v1/completions",
        bodies,
        PEER_CLIENTS,
        lambda done: opts.progress(what, done, total),
        skip=len(warm),
    )
    return summarize(records)


def _with_bench_client(opts: Options) -> dict[str, Any]:
    specs = workload(opts.n(128), seed=6, lane="realtime", tokens=(8, 64), mean=32)
    args = engine_args(opts)  # one server after the other
    model = opts.settings(engine="vllm").model_name
    with _vllm_serve(opts, args) as theirs:
        serve = _stream_all(opts, theirs.url, model, specs, "peer: vllm serve")
    with _inferq(opts, args) as ours:
        # The same client as for vllm serve: each call is a realtime job whose tokens the
        # worker relays through Redis as the engine produces them.
        inferq = _stream_all(opts, ours.url, model, specs, "peer: inferq")
    throughput, ttft = TARGETS["bench"]
    return {
        "client": "bench",
        "jobs": len(specs),
        "clients": PEER_CLIENTS,
        "vllm_serve": serve,
        "inferq": inferq,
        "inferq_over_vllm_serve": inferq["output_throughput"] / serve["output_throughput"],
        "ttft_p50_over_vllm_serve_ms": inferq["median_ttft_ms"] - serve["median_ttft_ms"],
        "throughput_target": throughput,
        "ttft_target_ms": ttft,
    }


def peer(opts: Options) -> dict[str, Any]:
    result = _with_vllm_client(opts) if opts.client == "vllm" else _with_bench_client(opts)
    return {"engine": "vllm", **result}
