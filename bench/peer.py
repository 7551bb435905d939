"""The ``peer`` scenario: the same workload against ``vllm serve`` and against inferq.

Both sides run the same model (the configured one, or the demo model) with the same vLLM
engine arguments, one after the other on this machine, and get the same client: streaming
``/v1/completions`` requests from ``PEER_CLIENTS`` concurrent clients, each sending its next
request when the previous one has ended. TTFT, ITL and E2EL are what the client sees. On
inferq every request is a realtime job (stored, queued, leased, recorded) whose tokens are
relayed from the worker through Redis.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx

from app.cli.stack import wait_ready
from bench.harness import POLL_S, BenchStack, free_port
from bench.metrics import summarize
from bench.overhead import WARMUP_ROUNDS
from bench.scenarios import Options, Spec, workload
from bench.streaming import stream_all
from workers.engines import resolve_model
from workers.engines.vllm import VLLMEngine

PEER_CLIENTS = 16


def _serve_argv(opts: Options, port: int) -> tuple[list[str], dict[str, str]]:
    settings = opts.settings(engine="vllm")
    model, served = resolve_model(settings)
    args = VLLMEngine(model, served, settings).engine_args()
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
    env = {"VLLM_CPU_KVCACHE_SPACE": str(settings.vllm_cpu_kvcache_gib)}
    return argv, env


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


def _against_vllm_serve(opts: Options, specs: list[Spec]) -> dict[str, Any]:
    port = free_port()
    argv, env = _serve_argv(opts, port)
    with BenchStack("sqlite", opts.stack_env(), opts.workdir) as stack:
        serve = stack.spawn("vllm-serve", argv, env)
        url = f"http://127.0.0.1:{port}"
        wait_ready(
            "vllm serve",
            900,
            lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200,
            serve,
            poll_s=POLL_S,
        )
        model = opts.settings(engine="vllm").model_name
        return _stream_all(opts, url, model, specs, "peer: vllm serve")


def _against_inferq(opts: Options, specs: list[Spec]) -> dict[str, Any]:
    with BenchStack(opts.database, opts.stack_env(engine="vllm"), opts.workdir) as stack:
        stack.start()
        model = opts.settings(engine="vllm").model_name
        # The same client as for vllm serve: each call is a realtime job whose tokens the
        # worker relays through Redis as the engine produces them.
        return _stream_all(opts, stack.url, model, specs, "peer: inferq")


def peer(opts: Options) -> dict[str, Any]:
    specs = workload(opts.n(128), seed=6, lane="realtime", tokens=(8, 64), mean=32)
    serve = _against_vllm_serve(opts, specs)
    ours = _against_inferq(opts, specs)
    return {
        "engine": "vllm",
        "jobs": len(specs),
        "clients": PEER_CLIENTS,
        "vllm_serve": serve,
        "inferq": ours,
        "inferq_over_vllm_serve": ours["output_throughput"] / serve["output_throughput"],
        "ttft_p50_over_vllm_serve_ms": ours["median_ttft_ms"] - serve["median_ttft_ms"],
    }
