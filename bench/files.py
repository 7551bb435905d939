"""The ``files`` scenario: file bytes through the API to the store and back, the local
directory against S3 (SeaweedFS on loopback, bench/objectstore.py), in one run
(docs/benchmarks.md, "files").

For each side, on a stack of its own (the API, a dispatcher, one SIMULATED worker, the ops
worker):

- a 200 MB upload (50,000 JSONL lines of 4 KB, within OpenAI's batch limits) and its download
  through the API: MB/s each way, and the API's resident memory at its peak (``VmHWM``) over
  what it was before (``api_rss_growth_mb``; target <= 64 MB: the file never sits in memory);
- a 50,000-line batch of chat lines (~1 KB each, batchfile's shape): from the start of its
  upload to the start of its first line in the worker (``batch_start_s``; target <= 5 s).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench.harness import BenchStack
from bench.objectstore import Seaweed
from bench.scenarios import Options, _rss_mb

UPLOAD_MB_TARGET_RSS = 64.0
BATCH_START_TARGET_S = 5.0
LINE_BYTES = 4000


def _big_file(path: Path, lines: int) -> int:
    """``lines`` JSONL lines of LINE_BYTES each; its size."""
    bare = len(json.dumps({"custom_id": "big-000000", "pad": ""}))
    pad = "x" * (LINE_BYTES - 1 - bare)
    with path.open("w") as out:
        for i in range(lines):
            out.write(json.dumps({"custom_id": f"big-{i:06d}", "pad": pad}) + "\n")
    return path.stat().st_size


def _batch_file(path: Path, lines: int, model: str) -> None:
    prompt = " ".join(f"word{i % 97}" for i in range(160))  # ~1 KB a line, as batchfile's
    with path.open("w") as out:
        for i in range(lines):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"{i} {prompt}"}],
                "max_tokens": 4,
            }
            line = {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            out.write(json.dumps({**line, "body": body}) + "\n")


def _side(opts: Options, name: str, env: dict[str, str], big: Path, batch: Path) -> dict[str, Any]:
    stack_env = {**opts.stack_env(sim_time_scale=0), **env}
    with BenchStack(opts.database, stack_env, opts.workdir) as stack:
        stack.start(workers=1)
        stack.add_ops()
        api = next(c for c in stack.children if c.name == "api")
        assert api.proc is not None
        before = _rss_mb(api.proc.pid)["rss_mb"]
        size = big.stat().st_size
        with httpx.Client(base_url=stack.url, timeout=600) as c:
            opts.progress(f"files ({name}): upload", 0, 3)
            started = time.perf_counter()
            file_id = stack.upload(c, big)
            upload_s = time.perf_counter() - started
            opts.progress(f"files ({name}): download", 1, 3)
            started = time.perf_counter()
            got = 0
            with c.stream("GET", f"/v1/files/{file_id}/content") as answer:
                answer.raise_for_status()
                for chunk in answer.iter_bytes():
                    got += len(chunk)
            download_s = time.perf_counter() - started
            if got != size:
                raise RuntimeError(f"downloaded {got} bytes of {size}")
            peak = _rss_mb(api.proc.pid)["peak_mb"]
            opts.progress(f"files ({name}): a batch to its first line", 2, 3)
            sent = time.time()
            batch_file = stack.upload(c, batch)
            body = {
                "input_file_id": batch_file,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            }
            batch_id = c.post("/v1/batches", json=body).json()["id"]
            first = None
            deadline = time.monotonic() + 300
            while first is None and time.monotonic() < deadline:
                with stack.db().connect() as conn:
                    first = conn.execute(
                        text("SELECT min(started_at) FROM jobs WHERE batch_id = :b"),
                        {"b": batch_id},
                    ).scalar()
                time.sleep(0.05)
            if first is None:
                raise RuntimeError(f"no line of batch {batch_id} started in 300 s")
            opts.progress(f"files ({name}): done", 3, 3)
    mb = size / 1e6
    return {
        "file_mb": mb,
        "upload_mb_s": mb / upload_s,
        "download_mb_s": mb / download_s,
        "api_rss_before_mb": before,
        "api_rss_growth_mb": peak - before,
        "batch_start_s": float(first) - sent,
    }


def files(opts: Options) -> dict[str, Any]:
    lines = max(100, int(50_000 * opts.scale))
    big, batch = opts.workdir / "files-big.jsonl", opts.workdir / "files-batch.jsonl"
    _big_file(big, lines)
    _batch_file(batch, lines, opts.settings().model_name)
    weed = Seaweed(opts.workdir / "seaweed")
    weed.start()
    try:
        sides = {
            "local": _side(opts, "local", {}, big, batch),
            "s3": _side(opts, "s3", weed.settings(), big, batch),
        }
    finally:
        weed.stop()
    return {
        "engine": "simulated (instant) for the batch's first line",
        "database": "postgresql" if opts.database != "sqlite" else "sqlite",
        "lines": lines,
        **sides,
        "target_api_rss_growth_mb": UPLOAD_MB_TARGET_RSS,
        "target_batch_start_s": BATCH_START_TARGET_S,
    }
