"""Serving metrics as ``vllm bench serve`` defines them, from per-request timestamps.

TTFT: submission to first token. TPOT: per request, (last token - first token) / (output
tokens - 1). ITL: every gap between consecutive tokens (only where each token's time was seen:
the direct engine and streaming peers; a job's tokens are not observed one by one). E2EL:
submission to completion. Throughputs are over the span from the first submission to the last
completion.
"""

from __future__ import annotations

import statistics
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _dist(name: str, values_s: list[float]) -> dict[str, float | None]:
    ms = [v * 1000.0 for v in values_s]
    return {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else None,
        f"median_{name}_ms": percentile(ms, 50),
        f"p99_{name}_ms": percentile(ms, 99),
    }


def _succeeded(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") == "succeeded" and r.get("finished_at")]


def first_token_spans(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Each succeeded request's (sent, first token), wall-clock seconds."""
    return [
        (r["created_at"], r["first_token_at"])
        for r in _succeeded(records)
        if r.get("first_token_at")
    ]


def ttfts_s(records: list[dict[str, Any]]) -> list[float]:
    """Each succeeded request's time to its first token, in seconds (what ``summarize``'s
    TTFT figures are of)."""
    return [first - sent for sent, first in first_token_spans(records)]


def summarize(records: list[dict[str, Any]], start: float | None = None) -> dict[str, Any]:
    """Metrics over finished requests; ``start`` defaults to the earliest submission."""
    ok = _succeeded(records)
    if not ok:
        return {"completed": 0}
    begin = start if start is not None else min(r["created_at"] for r in ok)
    end = max(r["finished_at"] for r in ok)
    span = max(end - begin, 1e-9)
    out_tokens = sum(int(r.get("completion_tokens") or 0) for r in ok)
    in_tokens = sum(int(r.get("prompt_tokens") or 0) for r in ok)
    ttft = ttfts_s(ok)
    tpot = [
        (r["finished_at"] - r["first_token_at"]) / (r["completion_tokens"] - 1)
        for r in ok
        if r.get("first_token_at") and (r.get("completion_tokens") or 0) > 1
    ]
    itl = [
        b - a
        for r in ok
        for a, b in zip(r.get("token_times") or [], (r.get("token_times") or [])[1:], strict=False)
    ]
    e2el = [r["finished_at"] - r["created_at"] for r in ok]
    result: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": span,
        "request_throughput": len(ok) / span,
        "output_throughput": out_tokens / span,
        "total_token_throughput": (in_tokens + out_tokens) / span,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        result.update(_dist(name, values))
    return result


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def read_gauges(url: str) -> Samples:
    """Every sample of a process's Prometheus ``/metrics``: (name, sorted labels) -> value."""
    text = httpx.get(url, timeout=5).text
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def gauge(samples: Samples, name: str, **labels: str) -> float | None:
    """The first sample of ``name`` whose labels include ``labels``."""
    for (found, pairs), value in samples.items():
        if found == name and all(dict(pairs).get(k) == v for k, v in labels.items()):
            return value
    return None
