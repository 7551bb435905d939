"""`inferq bench` (``python -m bench``): run scenarios, print and write the results."""

from __future__ import annotations

import json
import logging
import shlex
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench import report
from bench.affinity import prefix
from bench.autoscale import autoscale
from bench.embed import embed
from bench.fairness import fairness
from bench.files import files
from bench.harness import environment, postgres_answers
from bench.history import history
from bench.overhead import overhead
from bench.scenarios import SCENARIOS, Options

ALL = (
    "efficiency",
    "ladder",
    "mixed",
    "ceiling",
    "scaleout",
    "batchfile",
    "models",
    "overhead",
    "peer",
    "prefix",
    "fairness",
    "embed",
    "files",
)
# Run by name only, not in "all" (docs/benchmarks.md): autoscale is mostly idle on purpose, about
# 15 minutes; history writes three million rows.
ALONE = ("autoscale", "history")


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@click.command()
@click.option(
    "--scenario",
    default="all",
    show_default=True,
    help=f"Comma-separated: {', '.join(ALL + ALONE)}, or all (all but {', '.join(ALONE)}).",
)
@click.option(
    "--engine",
    type=click.Choice(["simulated", "vllm", "hf"]),
    default="simulated",
    show_default=True,
)
@click.option(
    "--database",
    type=click.Choice(["auto", "postgresql", "sqlite"]),
    default="auto",
    show_default=True,
    help="Database of the stacks; auto: PostgreSQL when --postgres answers, else SQLite.",
)
@click.option(
    "--postgres",
    default="postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    show_default=True,
    help="PostgreSQL admin URL: a fresh database is created for each stack and dropped after.",
)
@click.option("--scale", type=float, default=1.0, show_default=True, help="Job-count factor.")
@click.option(
    "--repeat",
    type=click.IntRange(1, 9),
    default=1,
    show_default=True,
    help="efficiency: run the direct/platform pair this many times (alternating); the median "
    "pair is reported. history: the same for its ceiling pair (empty / with history), as "
    "many 16-client loads on each database (their calls together), and as many rounds of "
    "its sweep beside the load (every round's calls together). peer with --client vllm: "
    "rounds of every run on both servers, each figure the median.",
)
@click.option(
    "--history-jobs",
    type=click.IntRange(min=1),
    default=None,
    help="history: finished jobs in the database (default: 1,000,000 times --scale).",
)
@click.option(
    "--client",
    type=click.Choice(["bench", "vllm"]),
    default="bench",
    show_default=True,
    help="peer: whose client measures both servers; vllm: vLLM's own `vllm bench serve` at "
    "each --concurrency, on completions and chat.",
)
@click.option(
    "--concurrency",
    default="16,64",
    show_default=True,
    help="peer with --client vllm: comma-separated concurrent clients.",
)
@click.option(
    "--input-len",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="peer with --client vllm: prompt tokens.",
)
@click.option(
    "--output-len",
    type=click.IntRange(min=1),
    default=128,
    show_default=True,
    help="peer with --client vllm: output tokens (--ignore-eos).",
)
@click.option(
    "--together/--one-at-a-time",
    default=None,
    help="peer with --client vllm: both servers started at once (the default where a GPU "
    "is) or one after the other (the default on a CPU); the bench client runs them one after "
    "the other.",
)
@click.option("--json", "json_path", type=click.Path(path_type=Path), default=None)
@click.option("--markdown", "md_path", type=click.Path(path_type=Path), default=None)
@click.option(
    "--plots", "plots_dir", type=click.Path(path_type=Path), default=None, help="PNG directory."
)
@click.option(
    "--workdir", type=click.Path(path_type=Path), default=Path(".inferq/bench"), show_default=True
)
def main(
    scenario: str,
    engine: str,
    database: str,
    postgres: str,
    scale: float,
    repeat: int,
    history_jobs: int | None,
    client: str,
    concurrency: str,
    input_len: int,
    output_len: int,
    together: bool | None,
    json_path: Path | None,
    md_path: Path | None,
    plots_dir: Path | None,
    workdir: Path,
) -> None:
    """Run the scenarios of docs/benchmarks.md side by side; report vllm-bench-serve metrics."""
    logging.basicConfig(level=logging.WARNING)
    # SIGTERM unwinds like Ctrl-C, so every stack started so far is torn down.
    signal.signal(signal.SIGTERM, _interrupt)
    names = list(ALL) if scenario == "all" else [s.strip() for s in scenario.split(",")]
    unknown = [n for n in names if n not in ALL + ALONE]
    if unknown:
        raise click.BadParameter(f"unknown scenario(s) {unknown}; choose from {ALL + ALONE}")
    try:
        concurrencies = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        raise click.BadParameter(f"{concurrency!r}: comma-separated integers") from None
    if not concurrencies or min(concurrencies) < 1:
        raise click.BadParameter(f"{concurrency!r}: each at least 1")
    workdir.mkdir(parents=True, exist_ok=True)
    if database == "auto":
        database = "postgresql" if postgres_answers(postgres) else "sqlite"
    console = Console(stderr=True)
    results: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        tasks: dict[str, Any] = {}

        def tick(what: str, done: int, total: int) -> None:
            if what not in tasks:
                tasks[what] = progress.add_task(what, total=total)
            progress.update(tasks[what], completed=done, total=total)

        opts = Options(
            engine=engine,
            database=postgres if database == "postgresql" else "sqlite",
            postgres=postgres,
            workdir=workdir.resolve(),
            scale=scale,
            repeat=repeat,
            history_jobs=history_jobs,
            client=client,
            concurrencies=concurrencies,
            input_len=input_len,
            output_len=output_len,
            together=together,
            progress=tick,
        )
        for name in names:
            started = time.monotonic()
            if name == "peer":
                if engine != "vllm":
                    results[name] = {"skipped": "peer compares with `vllm serve`: --engine vllm"}
                    continue
                from bench.peer import peer

                results[name] = peer(opts)
            elif name == "overhead":
                results[name] = overhead(opts)
            elif name == "prefix":
                results[name] = prefix(opts)
            elif name == "fairness":
                results[name] = fairness(opts)
            elif name == "autoscale":
                results[name] = autoscale(opts)
            elif name == "embed":
                results[name] = embed(opts)
            elif name == "files":
                results[name] = files(opts)
            elif name == "history":
                results[name] = history(opts)
            else:
                results[name] = SCENARIOS[name](opts)
            results[name]["wall_s"] = round(time.monotonic() - started, 1)
            console.print(f"[bold]{name}[/bold] done in {results[name]['wall_s']} s")
    results["machine"] = {
        **environment(),
        "engine": engine,
        "database": database,
        "command": shlex.join(["inferq", "bench", *sys.argv[1:]]),
    }
    table = report.markdown(results)
    click.echo(table)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    if md_path is not None:
        md_path.write_text(table + "\n")
    if plots_dir is not None:
        for path in report.plots(results, plots_dir):
            console.print(f"plot: {path}")


if __name__ == "__main__":
    main()
