"""The ``history`` scenario: the same workload on an empty database and on one holding a month of
finished jobs, side by side, and retention's sweep at work (issue 66; docs/benchmarks.md).

- **empty** and **history**: ``ceiling`` (bulk jobs on the instant engine: jobs/s) and
  ``overhead`` at 16 clients (streamed chat completions on the simulated engine: TTFT p50/p99),
  each on a stack of its own; on the history side the database first holds ``HISTORY`` finished
  jobs (1,000,000 at scale 1), written by ``COPY`` on PostgreSQL (an executemany on SQLite)
  before the stack starts, finished within the retention so that nothing sweeps them; each
  stack then runs ``history / 100`` one-token jobs before it measures, on both sides
  (``_settle``: the room a filled history's pages offer new rows once, used up as a deployment
  that wrote its history had used it; their jobs/s is reported, a history just restored). Then,
  with history, how long ``inferq status``, a first page of ``GET /v1/jobs`` and the console's
  pages take, and the database's size per million finished jobs (PostgreSQL: the table and its
  indexes; SQLite: the file).
- **sweep**: a database holding ``HISTORY`` jobs past their retention and the 16-client load
  run on its stack alternately without and with retention's sweep (``retention.sweep``, as the
  ops worker runs it, in a process of its own) deleting them at its pace, then once unpaced:
  jobs deleted a second while each load ran, and each sweeping load's TTFT p99 against the
  mean of the loads without on either side.

``--repeat N`` runs N pairs of ``ceiling`` (alternating) and N rounds of the sweep; the median
ratio of each counts.

SIMULATED engine everywhere; the rows are what a realtime chat call leaves (a short prompt, a
short result, one webhook-less job of tenant ``default`` in ten, the others spread over nine
more tenants).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, func, select, text

from app.core import db
from app.core.lifecycle import retention, transitions
from app.core.lifecycle.changes import changes
from app.core.models import Job, JobStatus, new_id
from app.core.processes.environment import environment
from app.core.settings import get_settings
from bench import overhead
from bench.harness import BenchStack
from bench.metrics import first_token_spans, percentile, summarize
from bench.scenarios import CEILING_CHUNK, CEILING_SLOTS, Options, Spec

HISTORY = 1_000_000  # finished jobs at scale 1
FILL_CHUNK = 10_000  # rows a COPY (or an executemany) and a transaction
# History jobs per job of a stack's settling run (``_settle``): 1 %, about twice what used up
# the room a filled history offers (docs/benchmarks.md, "Issue 66 ... eighth session").
SETTLE_PER = 100
SETTLE_WAVE = 50_000  # settling jobs submitted at once
DAY = 86400.0
TENANTS = ["default", *(f"history-{i}" for i in range(1, 10))]
LOOKS = 5  # timed runs of `inferq status` and of a first page
CLIENTS = 16


def _stack_settings(stack: BenchStack) -> dict[str, str]:
    """The stack's database and Redis, as ``environment`` takes them."""
    return {
        "database_url": stack.env["INFERQ_DATABASE_URL"],
        "redis_url": stack.env["INFERQ_REDIS_URL"],
    }


def rows(
    first: int, n: int, total: int, model: str, *, ended_days_ago: tuple[float, float]
) -> list[dict[str, Any]]:
    """Jobs ``first`` to ``first + n`` of a history of ``total`` succeeded jobs, created and
    ended between the two ages (days), oldest first over the whole history: each a step of the
    span later than the one before, give or take a step.

    Over the whole history, not over each chunk written: a month's rows lie in the order its
    jobs ended (each was inserted when submitted and ended soon after), and retention deletes
    in that order. Chunks that each spanned the whole month interleaved 100 runs of it, and
    every chunk retention deleted touched all of them: on SQLite a chunk of 2,000 wrote about
    1,000 pages (docs/benchmarks.md, "Issue 66 ... sixth session")."""
    rng = random.Random(first)
    stamp = time.time()
    oldest, newest = ended_days_ago
    step = (oldest - newest) * DAY / total
    made = []
    for i in range(first, first + n):
        created = stamp - oldest * DAY + (i + rng.random()) * step - 2.0
        made.append(
            {
                "id": new_id("job", at=created),
                "tenant": TENANTS[i % len(TENANTS)],
                "lane": "realtime",
                "model": model,
                "prompt": None,
                "messages": [{"role": "user", "content": f"question {i} about the history"}],
                "params": {"max_tokens": 32},
                "metadata": {},
                "status": JobStatus.SUCCEEDED.value,
                "attempts": 1,
                "created_at": created,
                "enqueued_at": created + 0.001,
                "started_at": created + 0.01,
                "first_token_at": created + 0.05,
                "finished_at": created + 2.0,
                "updated_at": created + 2.0,
                # Answers of different lengths, as a month of them has (docs/benchmarks.md, "Issue
                # 66 ... fourth session"): rows of one size leave every page of the table the
                # same free crumb, which every new row then fits (or none does).
                "result_text": "an answer of some thirty words " * rng.randint(1, 12),
                "finish_reason": "stop",
                "prompt_tokens": 12,
                "completion_tokens": 32,
            }
        )
    return made


def fill(url: str, n: int, model: str, *, ended_days_ago: tuple[float, float]) -> float:
    """Write ``n`` finished jobs into the database at ``url``, ``FILL_CHUNK`` a transaction
    (``transitions.create_ended``: COPY on PostgreSQL), through the app's own engine; returns
    the seconds it took."""
    started = time.monotonic()
    with environment(database_url=url):
        for offset in range(0, n, FILL_CHUNK):
            chunk = rows(
                offset, min(FILL_CHUNK, n - offset), n, model, ended_days_ago=ended_days_ago
            )
            with changes("ops") as tx:
                transitions.create_ended(tx, chunk)
        if db.get_engine().dialect.name == "postgresql":
            # A month of history has long been vacuumed and analyzed by autovacuum, and written
            # out by checkpoints: so is this one, before the stack starts, rather than in the
            # middle of the run (the checkpoint that the fill's WAL starts spreads its writes
            # over minutes, and every page a run touched first then went to the WAL whole).
            with db.get_engine().connect() as connection:
                autocommit = connection.execution_options(isolation_level="AUTOCOMMIT")
                autocommit.execute(text("VACUUM (ANALYZE) jobs"))
                autocommit.execute(text("CHECKPOINT"))
    return time.monotonic() - started


def _filled(
    n: int, model: str, days: tuple[float, float], into: dict[str, Any]
) -> Callable[[BenchStack], None]:
    def prefill(stack: BenchStack) -> None:
        into["fill_s"] = fill(stack.database_url, n, model, ended_days_ago=days)
        into["rows"] = n

    return prefill


def _settle(stack: BenchStack, n: int, opts: Options) -> dict[str, Any]:
    """``n`` one-token jobs in the bulk lane through the stack, before what it measures (the
    bulk lane goes to a worker in chunks: the standard one's 234 a second took 200,000 past
    14 minutes on one host).

    A history written in by ``COPY`` (this scenario's fill, as a restore from a dump) has never
    offered its pages' room to a new row: PostgreSQL's free-space map offers each page's room
    once, and until it is used every new row version lands one to a page across the whole heap,
    reading an old page and logging it whole (10,000,000 jobs left 201,076 pages with room for
    a new row, and the 20,000 jobs of ``ceiling`` wrote about 100,000 full-page images where
    an empty database wrote 14). A deployment that wrote its history itself used each page's
    room as the page was left; this run uses the fill's, as that traffic did, and is run on both
    sides (the empty one's stack as old). Its jobs/s is reported: a history just restored."""
    if not n:
        return {"jobs": 0}
    what = f"history: settling, {n} jobs"
    start = time.time()
    # In waves: a wave's jobs are the lane's backlog, and the API's admission reads it.
    for first in range(0, n, SETTLE_WAVE):
        wave = range(first, min(n, first + SETTLE_WAVE))
        stack.submit([Spec(f"settle {i}", 1, "bulk").body() for i in wave])
        stack.wait_all(wave.stop, 3600, lambda done: opts.progress(what, done, n), lane="bulk")
    measured = summarize(stack.rows(lane="bulk"), start)
    return {"jobs": n, "jobs_per_s": measured["request_throughput"]}


def _dialect(opts: Options) -> str:
    return "postgresql" if opts.database.startswith("postgresql") else "sqlite"


def size_mb(engine: Engine) -> dict[str, float]:
    """The jobs table's size and its indexes' (PostgreSQL), in MB; SQLite: the whole file's
    (every table), its write-ahead log included."""
    if engine.dialect.name != "postgresql":
        path = str(engine.url.database)
        files = [path, path + "-wal"]
        return {"file_mb": sum(os.path.getsize(f) for f in files if os.path.exists(f)) / 1e6}
    with engine.connect() as connection:
        table = connection.execute(text("SELECT pg_table_size('jobs')")).scalar_one()
        indexes = connection.execute(text("SELECT pg_indexes_size('jobs')")).scalar_one()
    return {"table_mb": table / 1e6, "indexes_mb": indexes / 1e6}


# The console's pages an operator opens (the first page of each; {job}: a job of the history).
CONSOLE_PAGES = [
    "/console",
    "/console/jobs",
    "/console/jobs?status=succeeded",
    "/console/jobs?tenant=history-3",
    "/console/jobs/{job}",
    "/console/batches",
    "/console/tenants",
]
# A search of the jobs list (a job's id or metadata containing the text): one that finds
# recent jobs at once, one that finds none and so reads its whole window
# (INFERQ_CONSOLE_SEARCH_WINDOW of the newest jobs; before it, the whole history).
CONSOLE_SEARCHES = {"found": "/console/jobs?q=job_", "none": "/console/jobs?q=no-such-text"}


def console_looks(stack: BenchStack) -> dict[str, Any]:
    """The slowest of ``LOOKS`` of each console page, in ms, as the operator (keys are off in
    the bench: the first page signs in as the operator, the session cookie is kept)."""
    with stack.db().connect() as connection:
        job = connection.execute(select(func.max(Job.id)).where(Job.lane == "realtime")).scalar()
    slowest: dict[str, float] = {}
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        for path in [*CONSOLE_PAGES, *CONSOLE_SEARCHES.values()]:
            url = path.format(job=job)
            times = []
            for _ in range(LOOKS):
                started = time.monotonic()
                client.get(url).raise_for_status()
                times.append((time.monotonic() - started) * 1000)
            slowest[path] = max(times)
    pages = [slowest[p] for p in CONSOLE_PAGES]
    return {
        "pages_max_ms": max(pages),
        "search_found_max_ms": slowest[CONSOLE_SEARCHES["found"]],
        "search_none_max_ms": slowest[CONSOLE_SEARCHES["none"]],
        "each_max_ms": slowest,
    }


def looks(stack: BenchStack) -> dict[str, Any]:
    """Median and slowest of ``LOOKS`` of: what `inferq status` reads (``status.read_here``, in
    this process on the stack's database and Redis), the whole command (a new process: its
    start-up included) as it runs beside the stack (asking its API) and with no API to ask
    (reading Redis and the database itself), a first page of GET /v1/jobs, and the console's
    pages."""
    from app.cli import status as status_command

    command_env = {**os.environ, **stack.env}
    # Nothing listens on the discard port: the command reads for itself, as with the API down.
    no_api = {**command_env, "INFERQ_API_URL": "http://127.0.0.1:9"}
    reads: list[float] = []
    command: list[float] = []
    here: list[float] = []
    page: list[float] = []
    for _ in range(LOOKS):
        with environment(**_stack_settings(stack)):
            started = time.monotonic()
            status_command.read_here()
            reads.append((time.monotonic() - started) * 1000)
        for env, timed in ((command_env, command), (no_api, here)):
            started = time.monotonic()
            done = subprocess.run(
                [sys.executable, "-m", "app.cli", "status"],
                env=env,
                capture_output=True,
                check=True,
                text=True,
                timeout=120,
            )
            timed.append((time.monotonic() - started) * 1000)
            # The heading says what was read: the API, or the Redis and database themselves.
            heading = done.stdout.splitlines()[0]
            if (": the API at " in heading) != (env is command_env):
                raise RuntimeError(f"inferq status read the wrong source: {heading}")
        started = time.monotonic()
        httpx.get(f"{stack.url}/v1/jobs", params={"limit": 20}, timeout=60).raise_for_status()
        page.append((time.monotonic() - started) * 1000)
    return {
        "status_reads_p50_ms": percentile(reads, 50),
        "status_reads_max_ms": max(reads),
        "status_command_p50_ms": percentile(command, 50),
        "status_command_max_ms": max(command),
        "status_command_no_api_p50_ms": percentile(here, 50),
        "status_command_no_api_max_ms": max(here),
        "jobs_page_p50_ms": percentile(page, 50),
        "jobs_page_max_ms": max(page),
        "console": console_looks(stack),
    }


def _ceiling(opts: Options, n_history: int, settle: int, model: str) -> dict[str, Any]:
    """``ceiling``'s bulk jobs on the instant engine after ``settle`` jobs (``_settle``): the
    bulk lane's rows created since it submitted (the history is of the realtime lane)."""
    fill_info: dict[str, Any] = {}
    specs = [Spec(f"history {i}", 1, "bulk") for i in range(opts.n(20000))]
    env = opts.stack_env(
        engine="simulated",
        sim_time_scale=0,
        worker_concurrency=CEILING_SLOTS,
        sim_max_num_seqs=CEILING_SLOTS,
        bulk_chunk_size=CEILING_CHUNK,
    )
    what = f"history: ceiling, {n_history} finished jobs"
    with BenchStack(opts.database, env, opts.workdir) as stack:
        prefill = _filled(n_history, model, (29.0, 1.0), fill_info) if n_history else None
        stack.start(prefill=prefill)
        settled = _settle(stack, settle, opts)
        start = stack.submit([s.body() for s in specs])
        stack.wait_all(
            settle + len(specs),
            3600,
            lambda done: opts.progress(what, done - settle, len(specs)),
            lane="bulk",
        )
        metrics = summarize([r for r in stack.rows(lane="bulk") if r["created_at"] >= start], start)
    return {"jobs_per_s": metrics["request_throughput"], "fill": fill_info, "settle": settled}


def _bodies(opts: Options, model: str) -> list[dict[str, Any]]:
    """A 16-client load's calls, as ``overhead``'s (its warm-up rounds included)."""
    return overhead._bodies(opts.n(overhead.REQUESTS_PER_CLIENT * CLIENTS) + 2 * CLIENTS, model)


def _overhead(opts: Options, n_history: int, settle: int, model: str) -> dict[str, Any]:
    """16 streaming clients on a stack whose database holds ``n_history`` finished jobs, after
    ``settle`` jobs (``_settle``): ``--repeat`` loads one after the other, the TTFT p50 and p99
    of all their calls together.
    One load's p99 is its fourth-slowest call of 400: on one host the same code's ratio with
    history to without was 1.02 in one run and 1.29 in the next (docs/benchmarks.md, "Issue 66
    ... seventh session"), as the sweep's loads swung before they were pooled."""
    bodies = _bodies(opts, model)
    fill_info: dict[str, Any] = {}
    with BenchStack(opts.database, opts.stack_env(engine="simulated"), opts.workdir) as stack:
        prefill = _filled(n_history, model, (29.0, 1.0), fill_info) if n_history else None
        stack.start(prefill=prefill)
        settled = _settle(stack, settle, opts)
        loads = [
            _load(stack, bodies, f"history: overhead 16 ({i + 1}/{opts.repeat})", opts)
            for i in range(opts.repeat)
        ]
        calls = [t for load in loads for t in _ttfts_ms(load.pop("spans"))]  # not reported
        result: dict[str, Any] = {
            "ttft_p50_ms": percentile(calls, 50),
            "ttft_p99_ms": percentile(calls, 99),
            "completed": sum(load["completed"] for load in loads),
            "loads": loads,
        }
        result["fill"] = fill_info
        result["settle"] = settled
        if n_history:
            result["looks"] = looks(stack)
            result["size"] = size_mb(stack.db())
    return result


def _load(
    stack: BenchStack, bodies: list[dict[str, Any]], what: str, opts: Options
) -> dict[str, Any]:
    started = time.monotonic()
    records = overhead._run(stack.url, bodies, CLIENTS, what, opts)
    measured = summarize(records)
    return {
        "ttft_p50_ms": measured["median_ttft_ms"],
        "ttft_p99_ms": measured["p99_ttft_ms"],
        "completed": measured["completed"],
        "load_s": time.monotonic() - started,
        # Each call's (sent, first token), wall clock: for the p99 of several loads' calls
        # together (``_ttfts_ms``), and which of the sweep's windows a call met (``_sweep``).
        "spans": first_token_spans(records),
    }


def _ttfts_ms(spans: list[tuple[float, float]]) -> list[float]:
    return [(first - sent) * 1000 for sent, first in spans]


def _jobs(stack: BenchStack) -> int:
    with stack.db().connect() as connection:
        return int(connection.execute(select(func.count()).select_from(Job)).scalar_one())


# The sweep in windows beside one load (``_sweep``'s windowed loads): this long sweeping, then
# as long not, in turn.
WINDOW_S = 2.0


def sweeping() -> None:
    """The sweep's process: ``retention.sweep_beat`` as the ops worker's beat runs it, one sweep
    after the other (each of its budget: the pace is kept over it, as in the ops worker; sweeps
    of a second's budget had deleted three chunks a second whatever the pace) until none is
    left or Ctrl-C (SIGINT); settings from the environment.

    With ``INFERQ_BENCH_SWEEP_WINDOWS`` (a file): sweeps of ``WINDOW_S`` (``retention.sweep``,
    at its pace) with as long between them, each window's start, then its end and the jobs it
    deleted, appended to the file as they happen (wall-clock seconds, the clients' clock)."""
    # SIGINT is how the bench stops it: acted on even where this process was started with it
    # ignored (a bench run in the background of a script hands that on).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = get_settings()
    windows = os.environ.get("INFERQ_BENCH_SWEEP_WINDOWS")
    with contextlib.suppress(KeyboardInterrupt):
        if windows is None:
            while retention.sweep_beat(settings):
                pass
            return
        while True:
            with open(windows, "a") as out:
                out.write(f"start {time.time()}\n")
            deleted = retention.sweep(settings, budget_s=WINDOW_S)
            with open(windows, "a") as out:
                out.write(f"end {time.time()} {deleted}\n")
            if not deleted:
                return
            time.sleep(WINDOW_S)


def _windows(path: Path) -> tuple[list[tuple[float, float]], float, int]:
    """The windows a ``sweeping`` process wrote to ``path``: each one's (start, end), the one it
    was stopped in ending at infinity; the seconds and the jobs deleted of those it ended."""
    spans: list[tuple[float, float]] = []
    seconds, deleted = 0.0, 0
    start: float | None = None
    for line in path.read_text().splitlines():
        kind, stamp, *count = line.split()
        if kind == "start":
            start = float(stamp)
        elif start is not None:
            spans.append((start, float(stamp)))
            seconds += float(stamp) - start
            deleted += int(count[0])
            start = None
    if start is not None:
        spans.append((start, float("inf")))
    return spans, seconds, deleted


def _sweep(opts: Options, n_history: int, model: str) -> dict[str, Any]:
    """The 16-client load on one stack whose ``n_history`` finished jobs are past their
    retention, alternately without and with retention's sweep (``retention.sweep`` as the ops
    worker runs it, in a process of its own: :func:`sweeping`) deleting them at its default pace
    (``INFERQ_RETENTION_SWEEP_JOBS_PER_S``): ``--repeat`` rounds of a load while sweeping, each
    held against the loads without on either side of it (one load's p99 is its fourth-slowest
    call of 400: a single pair swings more than the 10 % it is held to; the median round
    counts, the lower of two); then ``--repeat`` loads each beside the sweep in windows
    (``WINDOW_S`` on, as long off: the calls that met a window against those between); then one
    load while it deletes unpaced (0). The stack's own ops worker keeps every job (retention 0):
    nothing else sweeps."""
    bodies = _bodies(opts, model)
    fill_info: dict[str, Any] = {}
    env = opts.stack_env(engine="simulated", job_retention_s=0)
    with BenchStack(opts.database, env, opts.workdir) as stack:
        stack.start(prefill=_filled(n_history, model, (60.0, 31.0), fill_info))

        def sweeping_load(
            name: str, pace: dict[str, str], windows: Path | None = None
        ) -> dict[str, Any]:
            # A process of its own, as the ops worker's sweep is: in this one, its Python would
            # take turns with the load's clients for the interpreter lock and slow the clock
            # that times them. Its settings: the default retention (30 days), not the stack's 0.
            sweeper = subprocess.Popen(
                [sys.executable, "-c", "from bench.history import sweeping; sweeping()"],
                env={
                    **os.environ,
                    "INFERQ_DATABASE_URL": stack.env["INFERQ_DATABASE_URL"],
                    "INFERQ_REDIS_URL": stack.env["INFERQ_REDIS_URL"],
                    **pace,
                    **({"INFERQ_BENCH_SWEEP_WINDOWS": str(windows)} if windows else {}),
                },
            )
            try:
                time.sleep(3.0)  # started and under way
                left = _jobs(stack)
                load = _load(stack, bodies, f"history: sweeping, {name}", opts)
                # Deleted while the load ran, its own jobs (every call, its warm-up rounds too:
                # added meanwhile, none due) counted back.
                deleted = left - _jobs(stack) + len(bodies)
                # Ended before it was stopped: it failed, or nothing was left to delete (the
                # load was not beside a sweep for all of its time).
                ended = sweeper.poll()
            finally:
                sweeper.send_signal(signal.SIGINT)
                try:
                    sweeper.wait(60)
                except subprocess.TimeoutExpired:
                    sweeper.kill()
                    sweeper.wait()
            if ended is not None and (ended != 0 or not pace):
                raise RuntimeError(
                    f"the sweep ended during the {name} load (exit {ended}, {left} jobs left "
                    "when it began): give it more history (--history-jobs) or fewer rounds"
                )
            # Unpaced, a fast host's sweep may delete all that is left before its load ends
            # (on an Intel Xeon, 2026-11-29): its rate is then at least what is reported.
            return {
                **load,
                "jobs_per_s": deleted / load["load_s"],
                "left": left,
                "ran_out": ended is not None,
            }

        unswept = [_load(stack, bodies, "history: not sweeping", opts)]
        rounds = []
        for _ in range(opts.repeat):
            paced = sweeping_load("paced", {})
            unswept.append(_load(stack, bodies, "history: not sweeping", opts))
            around = (unswept[-2]["ttft_p99_ms"] + unswept[-1]["ttft_p99_ms"]) / 2
            rounds.append({**paced, "ttft_p99_ratio": paced["ttft_p99_ms"] / around})
        # Within one load: the sweep on for WINDOW_S, off as long, in turn; each call counted
        # with the windows it met (sent before one ended, its first token after one began) or
        # between them. Both halves share the load's host and moment, which the loads above
        # do not: on one host the loads without a sweep alone spread 33-121 ms in p99
        # (docs/benchmarks.md, "Issue 66 ... seventh session"). Reported beside the target.
        during: list[tuple[float, float]] = []
        between: list[tuple[float, float]] = []
        window_s, window_jobs = 0.0, 0
        for i in range(opts.repeat):
            path = opts.workdir / f"sweep-windows-{i}.txt"
            path.unlink(missing_ok=True)
            load = sweeping_load("in windows", {}, windows=path)
            spans, seconds, deleted = _windows(path)
            window_s += seconds
            window_jobs += deleted
            for sent, first in load["spans"]:
                met = any(start <= first and sent <= end for start, end in spans)
                (during if met else between).append((sent, first))
        unpaced = sweeping_load("unpaced", {"INFERQ_RETENTION_SWEEP_JOBS_PER_S": "0"})
    around = (unswept[-2]["ttft_p99_ms"] + unswept[-1]["ttft_p99_ms"]) / 2
    unpaced["ttft_p99_ratio"] = unpaced["ttft_p99_ms"] / around
    ranked = sorted(rounds, key=lambda r: float(r["ttft_p99_ratio"]))
    # The p99 of every paced load's calls together against that of every load without (400
    # calls a load), not one load's fourth-slowest: on one host the loads without a sweep alone
    # spread 112-264 ms (docs/benchmarks.md, "Issue 66 ... fifth session").
    pooled = {
        "paced_ttft_p99_ms": percentile([t for r in rounds for t in _ttfts_ms(r["spans"])], 99),
        "unswept_ttft_p99_ms": percentile([t for r in unswept for t in _ttfts_ms(r["spans"])], 99),
    }
    for load in [*unswept, *rounds, unpaced]:
        del load["spans"]  # not into the report
    in_windows = {
        "window_s": WINDOW_S,
        "calls_during": len(during),
        "calls_between": len(between),
        "during_ttft_p99_ms": percentile(_ttfts_ms(during), 99),
        "between_ttft_p99_ms": percentile(_ttfts_ms(between), 99),
        "jobs_per_s": window_jobs / window_s if window_s else None,
    }
    in_windows["ttft_p99_ratio"] = _ratio(
        in_windows["during_ttft_p99_ms"], in_windows["between_ttft_p99_ms"]
    )
    return {
        "fill": fill_info,
        "unswept": unswept,
        "paced_rounds": rounds,
        "paced": ranked[(len(ranked) - 1) // 2],  # the median round (the lower of two)
        "pooled": {
            **pooled,
            "ttft_p99_ratio": _ratio(pooled["paced_ttft_p99_ms"], pooled["unswept_ttft_p99_ms"]),
        },
        "in_windows": in_windows,
        "unpaced": unpaced,
    }


def _ratio(paced: float | None, unswept: float | None) -> float | None:
    return None if paced is None or not unswept else paced / unswept


def history(opts: Options) -> dict[str, Any]:
    model = opts.settings().model_name
    n_history = opts.history_jobs or opts.n(HISTORY)
    settle = n_history // SETTLE_PER  # on both sides
    # ``--repeat`` pairs of ceiling, alternating (its run-to-run spread on a small host is
    # wider than the 10 % the ratio is held to): the median ratio counts.
    pairs = []
    for _ in range(opts.repeat):
        pairs.append((_ceiling(opts, 0, settle, model), _ceiling(opts, n_history, settle, model)))
    ratios = [full["jobs_per_s"] / empty["jobs_per_s"] for empty, full in pairs]
    # The settling runs' own: the same jobs/s on a history just written in (``_settle``).
    cold = [f["settle"]["jobs_per_s"] / e["settle"]["jobs_per_s"] for e, f in pairs if settle]
    empty = {"ceiling": pairs[0][0], "overhead": _overhead(opts, 0, settle, model)}
    full = {"ceiling": pairs[0][1], "overhead": _overhead(opts, n_history, settle, model)}
    sweep = _sweep(opts, n_history, model)
    size = full["overhead"].get("size", {})
    per_million = {k: v * 1_000_000 / n_history for k, v in size.items()}
    seen = full["overhead"].get("looks", {})
    return {
        "status_max_ms": seen.get("status_reads_max_ms"),
        "status_command_max_ms": seen.get("status_command_max_ms"),
        # Reported, no target: the command where no API answers (it reads for itself).
        "status_command_no_api_max_ms": seen.get("status_command_no_api_max_ms"),
        "jobs_page_max_ms": seen.get("jobs_page_max_ms"),
        "console_pages_max_ms": seen.get("console", {}).get("pages_max_ms"),
        "engine": "simulated",
        "database": _dialect(opts),
        "history_jobs": n_history,
        "empty": empty,
        "history": full,
        "sweep": sweep,
        "ceiling_pairs": [[e["jobs_per_s"], f["jobs_per_s"]] for e, f in pairs],
        "jobs_per_s_ratio": percentile(ratios, 50),
        # Reported beside it: the settling runs' ratio, a history just written in.
        "settle_jobs": settle,
        "settle_jobs_per_s_ratio": percentile(cold, 50),
        "ttft_p50_ratio": full["overhead"]["ttft_p50_ms"] / empty["overhead"]["ttft_p50_ms"],
        "ttft_p99_ratio": full["overhead"]["ttft_p99_ms"] / empty["overhead"]["ttft_p99_ms"],
        "sweep_jobs_per_s": sweep["paced"]["jobs_per_s"],
        "sweep_ttft_p99_ratio": sweep["pooled"]["ttft_p99_ratio"],
        # Reported beside it: the median round's own ratio (one load against its neighbours).
        "sweep_ttft_p99_ratio_median_round": sweep["paced"]["ttft_p99_ratio"],
        # Reported beside it: the same within each load, the sweep on and off in windows.
        "sweep_windows_ttft_p99_ratio": sweep["in_windows"]["ttft_p99_ratio"],
        "sweep_windows_jobs_per_s": sweep["in_windows"]["jobs_per_s"],
        "unpaced_sweep_jobs_per_s": sweep["unpaced"]["jobs_per_s"],
        "unpaced_sweep_ttft_p99_ratio": sweep["unpaced"]["ttft_p99_ratio"],
        "size_mb_per_million": per_million,
    }
