"""`inferq status`: a terminal view of lanes, tenants, workers, ops workers and the last minute's
throughput.

The numbers are a snapshot (:mod:`app.core.observe.snapshot`, the same reads as the API's
/metrics): the API's, asked for first, or read here where no API answers; this module only
collects one and draws it with rich.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import sys
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from app.cli import where
from app.core.observe import shapes
from app.core.observe.shapes import Snapshot
from app.core.settings import get_settings

THROUGHPUT_WINDOW_S = 60.0


class Unavailable(Exception):
    """Redis or the database could not be read; the message is one line for a person."""


@dataclass(frozen=True)
class Status:
    """A snapshot and where it came from: the heading's account of what was read."""

    snapshot: Snapshot
    read: str


def collect(ask_api: bool = True) -> Status:
    """The API's snapshot where it answers (``ask_api``); else Redis and the database read
    here."""
    return (ask_api and from_api()) or read_here()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is not followed (it would carry the key elsewhere): its 3xx is an error, and
    the command reads for itself."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def from_api() -> Status | None:
    """``GET /v1/admin/status`` of the API the settings name (the one `inferq submit` talks
    to), with ``INFERQ_API_KEY``, or on a loopback address the operator's key `inferq up`
    keeps; None where it does not answer within ``INFERQ_DEPENDENCY_TIMEOUT_S``, refuses the
    key (it must be an operator's), or answers anything but a snapshot.

    Asked first because it is quicker: the API has SQLAlchemy, redis-py and the models loaded
    already, which are most of what reading here costs (docs/benchmarks.md, "Issue 66 ...
    fourth session"). The standard library's client: httpx would take back part of what this
    saves. A loopback address is asked directly, never through an ``http_proxy``.
    """
    settings = get_settings()
    parts = urllib.parse.urlsplit(settings.base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None  # urllib would also open file: and ftp: URLs
    loopback = parts.hostname in where.LOOPBACK or parts.hostname.startswith("127.")
    key = where.api_key(settings, kept=loopback)
    handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
    if loopback:
        handlers.append(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(  # noqa: S310 (the scheme is checked above)
        f"{settings.base_url.rstrip('/')}/v1/admin/status",
        headers={"Authorization": f"Bearer {key}"} if key else {},
    )
    try:
        with urllib.request.build_opener(*handlers).open(
            request, timeout=settings.dependency_timeout_s
        ) as answer:
            found = shapes.from_json(json.load(answer))
    except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError, AttributeError):
        # OSError: refused, timed out, cut off, or an HTTP error status (urllib's HTTPError);
        # HTTPException: a URL http.client refuses (a port that is not a number), or an
        # answer that is not HTTP or ends early; the rest: a body that is not a snapshot.
        return None
    return Status(found, f"the API at {settings.base_url}, which read {found.sources}")


def read_here() -> Status:
    """The snapshot read from Redis and the database by this process, as the API reads it."""
    # Imported here: where the API answers, the command loads none of them.
    import redis
    from sqlalchemy.exc import SQLAlchemyError

    from app.core.db import session_scope
    from app.core.messaging import clients
    from app.core.observe import snapshot

    if (why := where.no_database("status")) is not None:
        raise Unavailable(why)
    settings = get_settings()
    try:
        with session_scope() as session:
            taken = snapshot.take(clients.redis_client(), session, settings, THROUGHPUT_WINDOW_S)
    except redis.RedisError as exc:
        raise Unavailable(where.no_redis(exc)) from None
    except SQLAlchemyError as exc:
        raise Unavailable(where.no_reading(exc)) from None
    return Status(taken, taken.sources)


def heading(taken: Status) -> str:
    """The first line: when, and what was read (the API, or which Redis, database and file
    store), with the settings that chose it."""
    stamp = datetime.fromtimestamp(taken.snapshot.taken_at).strftime("%Y-%m-%d %H:%M:%S")
    return f"inferq status at {stamp}: {where.reading().summary(taken.read)}"


def _age(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _number(value: object, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _lanes_table(snap: Snapshot) -> Table:
    table = Table(title="Lanes", title_justify="left")
    table.add_column("lane")
    table.add_column("model", overflow="fold")
    table.add_column("messages in Redis", justify="right")
    table.add_column("queued jobs", justify="right")
    table.add_column("running jobs", justify="right")
    table.add_column("oldest queued", justify="right")
    for (lane, model), jobs in snap.lanes.items():
        table.add_row(
            lane,
            model,
            str(snap.messages.get((lane, model), 0)),
            str(jobs.queued),
            str(jobs.running),
            _age(jobs.oldest_queued_age_s) if jobs.queued else "-",
        )
    return table


def _tenants_table(snap: Snapshot) -> Table:
    table = Table(title="Tenants", title_justify="left")
    table.add_column("lane")
    table.add_column("model", overflow="fold")
    table.add_column("tenant", overflow="fold")
    table.add_column("queued", justify="right")
    table.add_column("running", justify="right")
    # Prompt + completion tokens of the tenant's jobs that finished in the window: the unit of
    # its fair share, where the Throughput table counts completion tokens only.
    table.add_column(f"tokens/s (last {THROUGHPUT_WINDOW_S:.0f} s)", justify="right")
    if not snap.tenants:
        table.add_row("no tenant has queued, running or recently finished jobs")
    for (lane, model, tenant), jobs in snap.tenants.items():
        table.add_row(
            lane, model, tenant, str(jobs.queued), str(jobs.running), f"{jobs.tokens_per_s:.1f}"
        )
    return table


def _seen(snap: Snapshot, record: dict[str, Any]) -> str:
    seen = record.get("seen_at")
    return "-" if seen is None else f"{_age(max(0.0, snap.taken_at - float(seen)))} ago"


def _workers_table(snap: Snapshot) -> Table:
    table = Table(title="Workers", title_justify="left")
    # The worker id is hostname:pid. Long names (a model's repository) wrap rather than hide.
    for name in ("worker", "engine", "model", "lanes"):
        table.add_column(name, overflow="fold")
    # "step ms": how long the engine's steps take (what INFERQ_REALTIME_STEP_MS is set against).
    # "cache hits": the engine's prefix-cache hit rate (prompt tokens); "affinity": jobs the
    # dispatchers sent to its own queue / those of its prefixes sent to the shared queue past
    # the load bound (docs/scheduling.md, "Prefix affinity").
    for name in (
        "in flight",
        "running",
        "waiting",
        "KV cache",
        "cache hits",
        "affinity",
        "tokens/s",
        "step ms",
        "last seen",
    ):
        table.add_column(name, justify="right")
    if not snap.workers:
        table.add_row("no worker is announced (start one: inferq worker)")
    for record in snap.workers:
        kv = record.get("kv_cache_usage")
        hits = shapes.prefix_hit_rate(record)
        routed = snap.affinity.get(str(record["worker_id"]))
        table.add_row(
            str(record["worker_id"]),
            _number(record.get("engine")),
            _number(record.get("model")),
            ",".join(record.get("lanes") or []) or "-",
            _number(record.get("in_flight")),
            _number(record.get("running")),
            _number(record.get("waiting")),
            "-" if kv is None else f"{float(kv) * 100:.0f}%",
            "-" if hits is None else f"{hits * 100:.0f}%",
            "-" if routed is None else f"{routed.sent} / {routed.overflow}",
            _number(record.get("tokens_per_s"), "{:.1f}"),
            _number(record.get("step_ms"), "{:.1f}"),
            _seen(snap, record),
        )
    return table


def _ops_table(snap: Snapshot) -> Table:
    # Apart from the workers: an ops worker runs no engine and takes no lane.
    table = Table(title="Ops workers", title_justify="left")
    for name in ("worker", "queues", "beat", "metrics"):
        table.add_column(name, overflow="fold")
    table.add_column("last seen", justify="right")
    if not snap.ops:
        table.add_row("no ops worker is announced (start one: inferq ops)")
    for record in snap.ops:
        beat = record.get("beat")
        table.add_row(
            str(record["worker_id"]),
            ",".join(record.get("queues") or []) or "-",
            "-" if beat is None else ("yes" if beat else "no"),
            _number(record.get("metrics_url")),
            _seen(snap, record),
        )
    return table


def _dispatchers_table(snap: Snapshot) -> Table:
    table = Table(title="Dispatchers", title_justify="left")
    for name in ("dispatcher", "policy", "sending to"):
        table.add_column(name, overflow="fold")
    table.add_column("sent", justify="right")
    table.add_column("last seen", justify="right")
    if not snap.dispatchers:
        # Without one, only the jobs the API sends itself run (docs/scheduling.md, "Fair share").
        table.add_row("no dispatcher is announced (start one: inferq dispatch)")
    for record in snap.dispatchers:
        table.add_row(
            str(record["worker_id"]),
            str(record.get("policy") or "-"),
            ",".join(record.get("queues") or []) or "-",
            _number(record.get("sent")),
            _seen(snap, record),
        )
    return table


def _throughput_table(snap: Snapshot) -> Table:
    done = snap.throughput
    table = Table(title=f"Throughput, last {done.window_s:.0f} s", title_justify="left")
    table.add_column("finished")
    table.add_column("jobs/s", justify="right")
    # Completion tokens of the jobs that finished in the window: a long job counts when it
    # ends. What engines generate right now is the workers' tokens/s.
    table.add_column("tokens/s (finished jobs)", justify="right")
    finished = ", ".join(f"{status} {n}" for status, n in sorted(done.finished.items()))
    table.add_row(finished or "none", f"{done.jobs_per_s:.2f}", f"{done.tokens_per_s:.1f}")
    return table


def render(taken: Status) -> RenderableType:
    snap = taken.snapshot
    return Group(
        Text(heading(taken), style="bold"),
        *(Text(f"warning: {line}", style="bold yellow") for line in snap.warnings),
        _lanes_table(snap),
        _tenants_table(snap),
        _workers_table(snap),
        _ops_table(snap),
        _dispatchers_table(snap),
        _throughput_table(snap),
    )


def _console() -> Console:
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console()
    # Piped output (a log, a test) is not cut to rich's default 80 columns: the workers table
    # is wider than that.
    return Console(width=200)


def run(watch: bool = False, interval: float = 2.0, ask_api: bool = True) -> int:
    """Print the status once, or keep it on screen until Ctrl-C; returns the exit code.
    ``ask_api`` False: always read Redis and the database here (``--no-api``)."""
    from rich.live import Live

    console = _console()
    try:
        try:
            first = render(collect(ask_api))
        except Unavailable as exc:
            sys.stderr.write(f"inferq status: {exc}\n")
            return 1
        if not watch:
            console.print(first, soft_wrap=True)
            return 0
        if console.is_terminal:
            with Live(first, console=console, auto_refresh=False) as live:
                while True:
                    time.sleep(interval)
                    live.update(_frame(ask_api), refresh=True)
        else:
            # Live draws only its last frame where it cannot move the cursor: print each one.
            console.print(first, soft_wrap=True)
            while True:
                time.sleep(interval)
                console.print()
                console.print(_frame(ask_api), soft_wrap=True)
    except KeyboardInterrupt:
        # Ctrl-C is how --watch ends; a one-off status cut short reports it the shell's way.
        return 0 if watch else 130


def _frame(ask_api: bool) -> RenderableType:
    """The next frame; a dependency that went away is shown, and tried again next time.

    Read on a thread of its own while this one waits: a read that blocks in the driver (on
    SQLite it waits, up to its busy timeout, for another process's write lock) would hold off
    Ctrl-C until it returns, and Ctrl-C is how --watch ends. The thread is a daemon: an
    interrupted read does not keep the process from exiting."""
    done: queue.SimpleQueue[RenderableType | BaseException] = queue.SimpleQueue()

    def read() -> None:
        try:
            done.put(render(collect(ask_api)))
        except Unavailable as exc:
            stamp = datetime.now().strftime("%H:%M:%S")
            done.put(Text(f"inferq status at {stamp}: {exc} (retrying)", style="red"))
        except BaseException as exc:
            done.put(exc)

    threading.Thread(target=read, name="status-read", daemon=True).start()
    frame = done.get()
    if isinstance(frame, BaseException):
        raise frame
    return frame
