"""Benchmark results as a Markdown table (targets checked) and PNG plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# scenario -> (key, comparison, target, label)
TARGETS: dict[str, list[tuple[str, str, float | str, str]]] = {
    "efficiency": [("ratio", ">=", "target+0", "platform / direct engine throughput")],
    "ladder": [
        ("continuous_over_static", ">=", 1.5, "continuous / static micro-batches"),
        ("continuous_over_serial", ">=", 10.0, "continuous / serial"),
    ],
    "mixed": [
        (
            "realtime_ttft_p50_ms",
            "<=",
            "ttft_p50_target_ms+0",
            "realtime TTFT p50 under bulk load (ms): idle p50 + 1.5 engine steps",
        ),
        (
            "realtime_ttft_p99_ms",
            "<=",
            "ttft_p99_target_ms+0",
            "realtime TTFT p99 under bulk load (ms): idle p99 + 2 steps + 30",
        ),
        (
            "budget_realtime_ttft_p50_ms",
            "<=",
            "budget_ttft_p50_target_ms+0",
            "the same with a step budget (ms): idle p50 + 1.5 (shorter) steps",
        ),
        (
            "budget_realtime_ttft_p99_ms",
            "<=",
            "budget_ttft_p99_target_ms+0",
            "the same with a step budget (ms): idle p99 + 2 steps + 30",
        ),
    ],
    "ceiling": [("jobs_per_s", ">=", 4000.0, "jobs/s end to end, instant engine, PostgreSQL")],
    "scaleout": [("two_over_one", ">=", 1.8, "two workers / one worker throughput")],
    "models": [
        ("ttft_p50_ratio", "<=", 1.10, "model B's realtime TTFT p50, A's backlog / B alone"),
        ("ttft_p99_over_alone_ms", "<=", 25.0, "B's TTFT p99, A's backlog - B alone (ms)"),
        ("misrouted", "<=", 0.0, "jobs that ran on a worker of another model"),
    ],
    "autoscale": [
        ("missed_deadlines", "<=", 0.0, "burst jobs that missed their deadline"),
        (
            "worker_seconds_ratio",
            "<=",
            0.6,
            "worker-seconds, autoscaled / fixed fleet for the peak",
        ),
        ("lost", "<=", 0.0, "jobs lost"),
        ("run_twice", "<=", 0.0, "jobs claimed twice (scale-in handed them back)"),
        (
            "estimate_error_abs",
            "<=",
            0.25,
            "drain estimate at the burst's start vs measured (relative error, absolute)",
        ),
    ],
    "embed": [
        (
            "ceiling_inputs_per_s",
            ">=",
            10_000.0,
            "embedding inputs/s, a batch of one-input lines, instant engine",
        ),
        ("vs_offline", ">=", 0.90, "inputs/s through inferq / vLLM's offline LLM.embed"),
    ],
    "history": [
        ("jobs_per_s_ratio", ">=", 0.9, "ceiling jobs/s, with history / empty database"),
        ("ttft_p50_ratio", "<=", 1.1, "16 clients: TTFT p50, with history / empty"),
        ("ttft_p99_ratio", "<=", 1.1, "16 clients: TTFT p99, with history / empty"),
        ("status_max_ms", "<=", 500.0, "`inferq status`'s reads with history, slowest of 5"),
        ("status_command_max_ms", "<=", 500.0, "the `inferq status` command, start-up too (ms)"),
        # (status_command_no_api_max_ms: the same with no API to ask, reported beside it)
        ("jobs_page_max_ms", "<=", 500.0, "GET /v1/jobs with history, slowest of 5 (ms)"),
        ("console_pages_max_ms", "<=", 500.0, "the console's pages with history, slowest (ms)"),
        ("sweep_jobs_per_s", ">=", 4000.0, "retention sweep, jobs deleted/s under load"),
        (
            "sweep_ttft_p99_ratio",
            "<=",
            1.1,
            "16 clients: TTFT p99, sweeping / not (every round's calls together)",
        ),
    ],
    # The targets depend on the client (bench/peer.py's TARGETS); with vLLM's, the worst pair.
    "peer": [
        (
            "inferq_over_vllm_serve",
            ">=",
            "throughput_target+0",
            "output tok/s, inferq / vllm serve (with vLLM's client: the lowest pair)",
        ),
        (
            "ttft_p50_over_vllm_serve_ms",
            "<=",
            "ttft_target_ms+0",
            "TTFT p50, inferq - vllm serve (ms; with vLLM's client: the highest pair)",
        ),
    ],
}

# overhead: clients -> (key, comparison, target, label), against the floor (docs/benchmarks.md)
OVERHEAD_TARGETS: dict[str, list[tuple[str, str, float, str]]] = {
    "16": [
        ("throughput_ratio", ">=", 0.95, "output tok/s, inferq / floor"),
        ("ttft_p50_over_floor_ms", "<=", 10.0, "TTFT p50, inferq - floor (ms)"),
        ("ttft_p99_over_floor_ms", "<=", 30.0, "TTFT p99, inferq - floor (ms)"),
        ("inferq_cpu_ms_per_call", "<=", 6.0, "CPU per call, API + worker + dispatcher (ms)"),
    ],
    "64": [
        ("throughput_ratio", ">=", 0.95, "output tok/s, inferq / floor"),
        ("ttft_p99_over_floor_ms", "<=", 60.0, "TTFT p99, inferq - floor (ms)"),
    ],
}

VARIANTS = {
    "efficiency": ("direct", "platform"),
    "ladder": ("serial", "static", "continuous"),
    "mixed": ("idle", "loaded", "budget"),
    "ceiling": ("platform",),
    "scaleout": ("one", "two"),
    "models": ("alone", "loaded"),
    "peer": ("vllm_serve", "inferq"),
    "prefix": ("grouped", "arrival"),
}

COLUMNS = (
    ("request_throughput", "req/s"),
    ("output_throughput", "out tok/s"),
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
    ("median_itl_ms", "ITL p50"),
    ("median_e2el_ms", "E2EL p50"),
    ("p99_e2el_ms", "E2EL p99"),
)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    return str(value)


def _target(result: dict[str, Any], target: float | str) -> float:
    if isinstance(target, str):
        key, plus = target.split("+")
        return float(result[key]) + float(plus)
    return target


def _check(scenario: str, label: str, value: Any, op: str, goal: float) -> str:
    met = value is not None and (value >= goal if op == ">=" else value <= goal)
    verdict = "yes" if met else "NO"
    return f"| {scenario} | {label} | {_fmt(value)} | {op} {_fmt(goal)} | {verdict} |"


def markdown(results: dict[str, Any]) -> str:
    lines = ["| scenario | measure | value | target | met |", "|---|---|---|---|---|"]
    for scenario, checks in TARGETS.items():
        result = results.get(scenario)
        if not result or "skipped" in result:
            continue
        for key, op, target, label in checks:
            if key in result:  # a scenario's checks differ by engine (embed)
                lines.append(_check(scenario, label, result[key], op, _target(result, target)))
    overhead = results.get("overhead") or {}
    for clients, overhead_checks in OVERHEAD_TARGETS.items():
        run: dict[str, Any] = overhead.get(clients) or {}
        for key, op, goal, label in overhead_checks if run else []:
            lines.append(_check("overhead", f"{clients} clients: {label}", run[key], op, goal))
        # The same bounds with `inferq api --workers 2`: shown beside them, not a target.
        two = run.get("api_processes_2") or {}
        for key, op, goal, label in overhead_checks if two else []:
            what = f"{clients} clients, 2 API processes: {label}"
            lines.append(_check("overhead", what, two[key], op, goal))
    header = "| scenario | run | " + " | ".join(c[1] for c in COLUMNS) + " |"
    table = ["", header, "|" + "---|" * (len(COLUMNS) + 2)]
    for scenario, variants in VARIANTS.items():
        result = results.get(scenario)
        if not result or "skipped" in result:
            continue
        for variant in (v for v in variants if v in result):
            metrics = result[variant]
            cells = " | ".join(_fmt(metrics.get(key)) for key, _ in COLUMNS)
            table.append(f"| {scenario} | {variant} | {cells} |")
    for clients in OVERHEAD_TARGETS:
        run = overhead.get(clients) or {}
        for side in ("floor", "inferq") if run else ():
            cells = " | ".join(_fmt(run[side].get(key)) for key, _ in COLUMNS)
            table.append(f"| overhead {clients} | {side} | {cells} |")
        two = run.get("api_processes_2")
        if two:
            cells = " | ".join(_fmt(two["inferq"].get(key)) for key, _ in COLUMNS)
            table.append(f"| overhead {clients} | inferq, 2 API processes | {cells} |")
    if len(table) > 3:  # a run of scenarios without such rows (autoscale alone) has no table
        lines += table
    cpu_runs = {
        c: overhead[c]["inferq"]["cpu_ms_per_call"]
        for c in OVERHEAD_TARGETS
        if "cpu_ms_per_call" in (overhead.get(c) or {}).get("inferq", {})
    }
    if cpu_runs:
        parts = list(next(iter(cpu_runs.values())))
        lines += [
            "",
            "| CPU per call (ms) | " + " | ".join(f"{c} clients" for c in cpu_runs) + " |",
        ]
        lines.append("|---|" + "---|" * len(cpu_runs))
        for part in parts:
            cells = " | ".join(_fmt(run.get(part)) for run in cpu_runs.values())
            lines.append(f"| inferq {part} | {cells} |")
        floors = " | ".join(
            _fmt(overhead[c]["floor"].get("cpu_ms_per_call", {}).get("total")) for c in cpu_runs
        )
        lines.append(f"| floor | {floors} |")
    stage_runs = {c: overhead[c]["inferq"]["stages"] for c in OVERHEAD_TARGETS if c in overhead}
    if stage_runs:
        names = [n for n in next(iter(stage_runs.values())) if n != "jobs"]
        lines += [
            "",
            "| inferq stage (ms) | "
            + " | ".join(f"{c} clients p50 / p99" for c in stage_runs)
            + " |",
            "|---|" + "---|" * len(stage_runs),
        ]
        for name in names:
            cells = " | ".join(
                f"{_fmt(s[name]['p50_ms'])} / {_fmt(s[name]['p99_ms'])}"
                for s in stage_runs.values()
            )
            lines.append(f"| {name.replace('_', ' ')} | {cells} |")
    mixed = results.get("mixed") or {}
    if "loaded" in mixed and "stages" in mixed["loaded"]:
        sides = [s for s in ("idle", "loaded", "budget") if s in mixed]
        lines += [
            "",
            "| mixed stage (ms) | " + " | ".join(f"{s} p50 / p99" for s in sides) + " |",
            "|---|" + "---|" * len(sides),
            "| engine step (median while loaded) | - | "
            + " | ".join(_fmt(mixed[s].get("engine_step_ms")) for s in sides[1:])
            + " |",
            "| bulk output tok/s during the realtime load | - | "
            + " | ".join(_fmt(mixed[s].get("bulk_output_throughput")) for s in sides[1:])
            + " |",
        ]
        for name in (n for n in mixed["loaded"]["stages"] if n != "jobs"):
            cells = " | ".join(
                f"{_fmt(mixed[s]['stages'][name]['p50_ms'])} / "
                f"{_fmt(mixed[s]['stages'][name]['p99_ms'])}"
                for s in sides
            )
            lines.append(f"| {name.replace('_', ' ')} | {cells} |")
    batch = results.get("batchfile")
    if batch and "skipped" not in batch:
        memory = batch["memory_mb"]
        lines += [
            "",
            "| batchfile | lines | file MB | upload s | validate + start s | lines/s "
            "| API RSS growth MB | ops RSS growth MB |",
            "|---|---|---|---|---|---|---|---|",
            f"| {batch['database']} | {batch['lines']:,} | {_fmt(batch['file_mb'])} "
            f"| {_fmt(batch['upload_s'])} | {_fmt(batch['validate_and_start_s'])} "
            f"| {_fmt(batch['lines_per_s'])} | {_fmt(memory['api']['growth'])} "
            f"| {_fmt(memory['ops']['growth'])} |",
        ]
    lines += _embed_table(results.get("embed"))
    lines += _files_table(results.get("files"))
    lines += _autoscale_table(results.get("autoscale"))
    lines += _prefix_table(results.get("prefix"))
    lines += _peer_table(results.get("peer"))
    lines += _fairness_table(results.get("fairness"))
    machine = results.get("machine", {})
    gpus = ", ".join(
        f"{g['name']} ({g['memory_mib']} MiB, driver {g['driver']})"
        for g in machine.get("gpus") or []
    )
    versions = machine.get("versions") or {}
    lines += [
        "",
        f"Machine: {machine.get('cpu')} ({machine.get('cores')} cores), "
        f"{'GPU ' + gpus if gpus else 'no GPU'}, "
        f"vLLM {versions.get('vllm') or '-'}, torch {versions.get('torch') or '-'}, "
        f"Python {machine.get('python')}; reference: a fixed Python loop "
        f"{_fmt(machine.get('python_loop_ms'))} ms, a Redis round trip "
        f"{_fmt(machine.get('redis_rtt_us'))} µs; engine: {machine.get('engine')}; "
        f"database: {machine.get('database')}. "
        "Latencies in ms; ITL only where tokens are observed one by one."
        + (f" Command: `{machine['command']}`." if machine.get("command") else ""),
    ]
    return "\n".join(lines)


def _peer_table(result: dict[str, Any] | None) -> list[str]:
    """With vLLM's client: each endpoint and concurrency, both sides (medians over rounds)."""
    if not result or result.get("client") != "vllm":
        return []
    where = "together" if result["together"] else "one after the other"
    lines = [
        "",
        f"| peer, `vllm bench serve` ({result['input_len']} in / {result['output_len']} out, "
        f"{where}) | side | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 "
        "| engine ITL mean | CPU ms/request | failed | inferq / vllm serve | TTFT p50 + ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, pair in result["pairs"].items():
        for side in ("inferq", "vllm_serve"):
            r = pair[side]
            ratio = _fmt(pair["inferq_over_vllm_serve"]) if side == "inferq" else ""
            more = _fmt(pair["ttft_p50_over_vllm_serve_ms"]) if side == "inferq" else ""
            lines.append(
                f"| {key} | {side} | {_fmt(r['output_throughput'])} "
                f"| {_fmt(r['median_ttft_ms'])} | {_fmt(r['p99_ttft_ms'])} "
                f"| {_fmt(r['median_tpot_ms'])} | {_fmt(r['median_itl_ms'])} "
                f"| {_fmt(r['engine_itl_mean_ms'])} | {_fmt(r['cpu_ms_per_request'])} "
                f"| {r['failed']} | {ratio} | {more} |"
            )
    return lines


def _embed_table(result: dict[str, Any] | None) -> list[str]:
    if not result or "skipped" in result:
        return []
    sides: list[tuple[str, dict[str, Any]]] = [("through inferq (a batch)", result["platform"])]
    if "offline" in result:
        sides.append(("vLLM offline LLM.embed", result["offline"]))
    lines = [
        "",
        "| embed | inputs | seconds | inputs/s | tokens/s | validating / running / finalizing s |",
        "|---|---|---|---|---|---|",
    ]
    for name, side in sides:
        phases = side.get("phases_s")
        split = " / ".join(_fmt(v) for v in phases.values()) if phases else "-"
        lines.append(
            f"| {name} | {side['inputs']:,} | {_fmt(side['seconds'])} "
            f"| {_fmt(side['inputs_per_s'])} | {_fmt(side['tokens_per_s'])} | {split} |"
        )
    realtime = result.get("realtime")
    if realtime:
        lines += [
            "",
            "| embed: one-input /v1/embeddings (ms) | p50 | p99 |",
            "|---|---|---|",
            *(
                f"| {side} | {_fmt(v['p50_ms'])} | {_fmt(v['p99_ms'])} |"
                for side, v in realtime.items()
            ),
        ]
    return lines


def _files_table(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    rss, start = result["target_api_rss_growth_mb"], result["target_batch_start_s"]
    lines = [
        "",
        f"| files ({result['database']}) | upload MB/s | download MB/s | API RSS growth MB "
        f"(≤ {_fmt(rss)}) | batch of {result['lines']:,} lines: upload to first line s "
        f"(≤ {_fmt(start)}) |",
        "|---|---|---|---|---|",
    ]
    for side in ("local", "s3"):
        r = result[side]
        grew = "met" if r["api_rss_growth_mb"] <= rss else "**missed**"
        began = "met" if r["batch_start_s"] <= start else "**missed**"
        lines.append(
            f"| {side} | {_fmt(r['upload_mb_s'])} | {_fmt(r['download_mb_s'])} "
            f"| {_fmt(r['api_rss_growth_mb'])} ({grew}) | {_fmt(r['batch_start_s'])} ({began}) |"
        )
    return lines


def _autoscale_table(result: dict[str, Any] | None) -> list[str]:
    if not result:
        return []
    drain = result.get("drain") or {}
    rows = [
        ("cold start: first job waiting -> first token (s)", result.get("cold_start_s")),
        ("realtime TTFT p99 during the burst, autoscaled (ms)", result.get("realtime_ttft_p99_ms")),
        ("the same on the fixed fleet (ms)", result.get("fixed_realtime_ttft_p99_ms")),
        ("peak workers (= the fixed fleet)", result.get("peak_workers")),
        (
            "worker-seconds, autoscaled / fixed",
            f"{_fmt(result.get('worker_seconds'))} / {_fmt(result.get('fixed_worker_seconds'))}",
        ),
        (
            "burst drained in (s), autoscaled / fixed",
            f"{_fmt(result.get('burst_drain_s'))} / "
            f"{_fmt((result.get('fixed') or {}).get('drain_s'))}",
        ),
        (
            "drain estimate / measured (s), taken at",
            f"{_fmt(drain.get('estimate_s'))} / "
            f"{_fmt(drain.get('measured_s'))}, {_fmt(drain.get('estimate_at_s'))} s into the burst",
        ),
    ]
    return ["", "| autoscale | value |", "|---|---|", *(f"| {k} | {_fmt(v)} |" for k, v in rows)]


def _prefix_table(result: dict[str, Any] | None) -> list[str]:
    """The ``prefix`` scenario: on vLLM, one worker grouped against arrival order, and two
    workers with and without affinity; across 1, 2 and 4 SIMULATED workers, affinity against
    the shared queues, the hot prefix and a worker joining (bench/affinity.py)."""
    if not result or "skipped" in result:
        return []
    lines: list[str] = []
    if "grouped" in result:
        lines += [
            "",
            "| prefix | dispatch policy | jobs | prefix-cache hit rate | out tok/s | seconds |",
            "|---|---|---|---|---|---|",
        ]
        for side in ("grouped", "arrival"):
            r = result[side]
            lines.append(
                f"| {side} | {r['dispatch_policy']} | {r['jobs']} | {_fmt(r['prefix_hit_rate'])} "
                f"| {_fmt(r['output_throughput'])} | {_fmt(r['seconds'])} |"
            )
    runs = [
        (f"{n} workers", side, r)
        for side in ("affinity", "shared")
        for n, r in (result.get(side) or {}).items()
    ]
    runs += [("2 workers (vLLM)", side, r) for side, r in (result.get("two_workers") or {}).items()]
    runs += [("hot prefix, 4 workers", side, r) for side, r in (result.get("hot") or {}).items()]
    if runs:
        lines += [
            "",
            "| prefix across workers | routing | jobs | hit rate | out tok/s | TTFT p50 (ms) "
            "| max load / mean |",
            "|---|---|---|---|---|---|---|",
        ]
        for what, side, r in sorted(runs, key=lambda x: (x[0], x[1])):
            lines.append(
                f"| {what} | {side} | {r['jobs']} | {_fmt(r['hit_rate'])} "
                f"| {_fmt(r['tokens_per_s'])} | {_fmt(r['ttft_p50_ms'])} "
                f"| {_fmt(r['max_load_over_mean'])} |"
            )
    join = (result.get("join") or {}).get("join")
    if join:
        lines.append(
            f"\nA third worker joined: {join['moved']} of {join['prefixes']} prefixes moved "
            f"({_fmt(join['moved_share'])}; rendezvous hashing predicts 1/3)."
        )
    return lines


def _fairness_table(result: dict[str, Any] | None) -> list[str]:
    """The ``fairness`` scenario: the shares of two backlogged tenants, and what it cost; then
    the engine-full cases, B behind A's backlog against B alone."""
    if not result:
        return []
    lines: list[str] = []
    if "equal" in result:
        lines += [
            "",
            "| fairness (simulated) | weights | B's share | A's share | Jain, lowest window "
            "| out tok/s | measured s |",
            "|---|---|---|---|---|---|---|",
        ]
        for side in ("equal", "weighted", "arrival"):
            r = result[side]
            lines.append(
                f"| {side} ({r['policy']}) | {r['weights'][0]:g}:{r['weights'][1]:g} "
                f"| {_fmt(r['share_b'])} | {_fmt(r['share_a'])} | {_fmt(r['jain_min'])} "
                f"| {_fmt(r['output_throughput'])} | {_fmt(r['measured_s'])} |"
            )
        lines.append(
            f"\nb_share {_fmt(result['b_share'])} (>= 0.45), jain_min "
            f"{_fmt(result['jain_min'])} (>= 0.95), weighted_share_a "
            f"{_fmt(result['weighted_share_a'])} (0.75 +- 0.05), throughput_vs_arrival "
            f"{_fmt(result['throughput_vs_arrival'])} (>= 0.97)"
        )
    cases = {
        "full_seqs": "simulated, max_num_seqs 16",
        "full_kv": "simulated, KV cache for 16",
        "full_vllm": "vLLM CPU, KV cache of blocks",
    }
    present = [name for name in cases if isinstance(result.get(name), dict)]
    if present:
        lines += [
            "",
            "| engine full | engine | B alone s | B behind A s | b_slowdown (<= 2.5) "
            "| b_share to B's end (>= 0.45) | b_share while backlogged | engine speed vs alone "
            "| A's jobs done meanwhile |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in present:
            r = result[name]
            lines.append(
                f"| {name} | {cases[name]} | {_fmt(r['b_alone_s'])} | {_fmt(r['b_behind_s'])} "
                f"| {_fmt(r['b_slowdown'])} | {_fmt(r['b_share'])} "
                f"| {_fmt(r['b_share_backlogged'])} | {_fmt(r.get('engine_speed', 0.0))} "
                f"| {r['a_jobs_done_meanwhile']:,} |"
            )
    return lines


def plots(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for scenario, variants in VARIANTS.items():
        result = results.get(scenario)
        if not result or "skipped" in result:
            continue
        present = [v for v in variants if isinstance(result.get(v), dict)]
        fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
        left.bar(present, [result[v].get("output_throughput") or 0 for v in present])
        left.set_title(f"{scenario}: output tokens/s")
        p50 = [result[v].get("median_ttft_ms") or 0 for v in present]
        p99 = [result[v].get("p99_ttft_ms") or 0 for v in present]
        xs = range(len(present))
        right.bar([x - 0.2 for x in xs], p50, width=0.4, label="p50")
        right.bar([x + 0.2 for x in xs], p99, width=0.4, label="p99")
        right.set_xticks(list(xs), present)
        right.set_title(f"{scenario}: TTFT (ms)")
        right.legend()
        fig.tight_layout()
        path = out / f"{scenario}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
