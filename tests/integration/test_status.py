"""`inferq status` and app/core/observe/snapshot.py against a real Redis and a real SQLite database.

The command runs as a real subprocess against a real API and simulated worker; the snapshot
reads are checked against rows written here with known times.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy.orm import Session

from app.core.messaging.names import routes
from app.core.models import Job, new_id
from app.core.observe import shapes, snapshot
from app.core.processes import presence
from app.core.scheduling import backlog
from app.core.settings import LANES
from tests.conftest import fresh_redis_url
from tests.support import DEMO_MODEL, REPO, Stack, queue, running_stack, wait_until

SLOTS = 8
BULK_JOBS = 20
# Long enough that no bulk job finishes while a test looks (~8000 steps of a few ms, x3).
LONG = {"prompt": "go on", "lane": "bulk", "params": {"max_tokens": 8000}}


@pytest.fixture(scope="module")
def busy_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A stack whose worker is full of long bulk jobs, with more queued behind them, after a
    few realtime jobs finished."""
    tmp = tmp_path_factory.mktemp("status")
    with running_stack(
        tmp,
        f"sqlite:///{tmp / 'inferq.db'}",
        fresh_redis_url(),
        sim_time_scale=3,
        worker_concurrency=SLOTS,
        sim_max_num_seqs=SLOTS,
        bulk_chunk_size=2,
        shutdown_grace_s=0,
    ) as stack:
        # Realtime first: with 8 slots no lane has a reservation, so bulk could take them all.
        done = [
            stack.submit({"prompt": "hi", "lane": "realtime", "params": {"max_tokens": 8}})
            for _ in range(3)
        ]
        for job in done:
            assert stack.wait_job(job["id"])["status"] == "succeeded"
        stack.submit_many([LONG] * BULK_JOBS)
        wait_until(
            lambda: stack.scalar("SELECT count(*) FROM jobs WHERE status = 'running'") == SLOTS,
            30,
            "the worker to fill its slots",
        )
        # The presence record is rewritten once per heartbeat: wait for one that saw it full.
        worker = next(p for p in stack.procs if p.name == "worker0")
        wait_until(
            lambda: (stack.worker_record(worker.pid) or {}).get("in_flight") == SLOTS,
            10,
            "the worker to announce its full slots",
        )
        # And the dispatcher's, once a refill left jobs waiting in the bulk queue (it names
        # the queues it is filling; a look quicker than its heartbeat would see none yet).
        client = redis.Redis.from_url(stack.redis_url)

        def filling() -> list[str]:
            keys = list(client.scan_iter("inferq:dispatcher:*"))
            return json.loads(client.get(keys[0]) or "{}").get("queues", []) if keys else []

        wait_until(lambda: filling() == [queue("bulk")], 10, "the dispatcher to name its queue")
        yield stack


def table(output: str, title: str) -> str:
    """The lines of the table titled ``title``, from its title to its bottom border."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == title)
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("└"))
    return "\n".join(lines[start : end + 1])


def rows(output: str, first: str) -> list[list[str]]:
    """The cells of every table row whose first cell is ``first``."""
    found = []
    for line in output.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("│┃").split("│")]
        if cells and cells[0] == first:
            found.append(cells)
    return found


# Nothing listens on the discard port: the command reads Redis and the database itself, as
# where the API is down.
NO_API = {"INFERQ_API_URL": "http://127.0.0.1:9"}


def status(stack: Stack, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # A fixed width, whatever the terminal running the tests: rows are parsed by their cells.
    return stack.cli("status", *args, env={"COLUMNS": "200", **env})


def test_status_shows_lanes_workers_and_throughput(busy_stack: Stack) -> None:
    done = status(busy_stack)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    client = redis.Redis.from_url(busy_stack.redis_url)

    queued = busy_stack.scalar("SELECT count(*) FROM jobs WHERE status = 'queued'")
    assert queued == BULK_JOBS - SLOTS
    lanes = table(out, "Lanes")
    ((_, model, messages, bulk_queued, bulk_running, oldest),) = rows(lanes, "bulk")
    assert model == DEMO_MODEL
    assert int(bulk_queued) == queued
    assert int(bulk_running) == SLOTS
    # The dispatcher keeps the list shallow (docs/scheduling.md, "Fair share"): the rest wait
    # unsent.
    assert int(messages) == client.llen(queue("bulk")) < queued // 2  # two job ids a message
    assert oldest.endswith(" s") and float(oldest.split()[0]) > 0
    for lane in ("realtime", "standard"):
        assert rows(lanes, lane) == [[lane, DEMO_MODEL, "0", "0", "0", "-"]], out
    # The stack's dispatcher, filling the bulk queue while jobs wait for it.
    record = json.loads(client.get(next(client.scan_iter("inferq:dispatcher:*"))) or "{}")
    ((_, policy, filling, sent, seen),) = rows(table(out, "Dispatchers"), record["worker_id"])
    assert policy == "fair" and int(sent) >= 1 and seen.endswith(" ago")
    assert filling == queue("bulk")

    # Every job is tenant "default" (no keys): its bulk jobs, and the three realtime jobs served.
    served = busy_stack.scalar(
        "SELECT sum(prompt_tokens + completion_tokens) FROM jobs WHERE lane = 'realtime'"
    )
    assert served >= 3 * 8
    assert rows(table(out, "Tenants"), "realtime") == [
        ["realtime", DEMO_MODEL, "default", "0", "0", f"{served / 60:.1f}"]
    ]
    assert rows(table(out, "Tenants"), "bulk") == [
        ["bulk", DEMO_MODEL, "default", str(queued), str(SLOTS), "0.0"]
    ]

    worker = next(p for p in busy_stack.procs if p.name == "worker0")
    announced = busy_stack.worker_record(worker.pid)
    assert announced is not None
    (record,) = rows(out, announced["worker_id"])
    assert record[0].endswith(f":{worker.pid}")
    assert record[1:4] == ["simulated", announced["model"], "realtime,standard,bulk"]
    assert int(record[4]) == SLOTS  # in flight
    assert record[-1].endswith(" ago")

    ((_, jobs_per_s, tokens_per_s),) = rows(out, "succeeded 3")
    assert float(jobs_per_s) == pytest.approx(3 / 60, abs=0.01)
    assert float(tokens_per_s) == pytest.approx(3 * 8 / 60, abs=0.1)
    assert "Lanes" in out and "Workers" in out and "Throughput, last 60 s" in out
    assert "tokens/s (last 60 s)" in table(out, "Tenants")


def test_status_asks_the_api_first_and_reads_itself_where_none_answers(
    busy_stack: Stack,
) -> None:
    """Beside a running API the command draws the API's snapshot, loading none of what reading
    the database and Redis takes (its start-up, docs/benchmarks.md); with none to ask, it reads
    them itself, and both say the same."""
    seen = {}
    for name, env in (("asked", {}), ("here", NO_API)):
        done = status(busy_stack, PYTHONPROFILEIMPORTTIME="1", **env)
        assert done.returncode == 0, done.stderr
        loaded = {line.split("|")[-1].strip().split(".")[0] for line in done.stderr.splitlines()}
        seen[name] = (done.stdout, loaded)
    asked, loaded = seen["asked"]
    read = f"Redis {busy_stack.redis_url}, database sqlite:///"
    assert f": the API at http://127.0.0.1:{busy_stack.port}, which read {read}" in asked

    assert not loaded & {"sqlalchemy", "redis", "psycopg", "httpx"}, loaded
    here, loaded = seen["here"]
    assert "the API at" not in here.splitlines()[0]
    assert f": {read}" in here.splitlines()[0]
    assert loaded >= {"sqlalchemy", "redis"}
    assert _steady(table(asked, "Lanes")) == _steady(table(here, "Lanes"))
    # A tenant's tokens/s is of a sliding minute: its queued and running jobs are compared.
    for lane in LANES:
        assert [r[:5] for r in rows(table(asked, "Tenants"), lane)] == [
            r[:5] for r in rows(table(here, "Tenants"), lane)
        ]
    worker = next(p for p in busy_stack.procs if p.name == "worker0")
    announced = busy_stack.worker_record(worker.pid)
    assert announced is not None
    assert rows(asked, announced["worker_id"])[0][:5] == rows(here, announced["worker_id"])[0][:5]


def _steady(drawn: str) -> list[list[str]]:
    """A table's cells but those that move between two looks: ages."""
    return [
        [c.strip() for c in cells if not c.strip().endswith((" s", " min", " h"))]
        for cells in (line.strip("│┃ ").split("│") for line in drawn.splitlines())
    ]


@pytest.mark.parametrize("terminal", [True, False], ids=["terminal", "pipe"])
def test_watch_redraws_until_ctrl_c(busy_stack: Stack, terminal: bool) -> None:
    argv = [sys.executable, "-m", "app.cli", "status", "--watch", "--interval", "0.3"]
    output = bytearray()
    if terminal:
        # A pseudo-terminal, so that rich's Live redraws in place as it does for a person.
        reader, writer = pty.openpty()
        fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
    else:
        reader, writer = os.pipe()
    proc = subprocess.Popen(
        argv,
        cwd=REPO,
        env={**busy_stack.env, "COLUMNS": "200"},
        stdout=writer,
        stderr=writer,
        close_fds=True,
        # Ctrl-C in a terminal: SIGINT acts, even where this run inherited it ignored (a
        # background job of a non-interactive shell), which the command would inherit too.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(writer)

    def read() -> None:
        with contextlib.suppress(OSError):  # a pty's reader ends with EIO
            while chunk := os.read(reader, 65536):
                output.extend(chunk)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    try:
        wait_until(lambda: output.count(b"inferq status at") >= 2, 30, "two frames")
        assert output.count(b"Workers") >= 2
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    thread.join(5)
    os.close(reader)
    assert b"Traceback" not in output
    if terminal:
        assert b"\x1b[" in output  # Live moved the cursor to redraw in place


def test_unreachable_redis_or_database_is_one_line_and_exit_1(
    busy_stack: Stack, tmp_path: Path
) -> None:
    # Where the API answers, it is read instead (test_status_asks_the_api_first): these are
    # the command's own reads.
    done = status(busy_stack, INFERQ_REDIS_URL="redis://127.0.0.1:1/0", **NO_API)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(
        "inferq status: cannot read Redis at redis://127.0.0.1:1/0 (INFERQ_REDIS_URL): "
    )
    assert len(done.stderr.splitlines()) == 1

    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).execute("CREATE TABLE other (x)").connection.close()
    done = status(busy_stack, INFERQ_DATABASE_URL=f"sqlite:///{empty}", **NO_API)
    assert done.returncode == 1
    assert done.stderr == (
        f"inferq status: the database at sqlite:///{empty} (INFERQ_DATABASE_URL) has no inferq "
        "tables (no such table: jobs): run `inferq migrate`, or point the setting at the "
        "stack's database\n"
    )


# --- app/core/observe/snapshot.py, with rows whose times are known ------------------------


def _job(
    lane: str,
    status: str,
    created_at: float,
    model: str = "simulated",
    tenant: str = "t",
    **values: Any,
) -> Job:
    return Job(
        id=new_id("job"),
        tenant=tenant,
        lane=lane,
        model=model,
        prompt="p",
        params={},
        meta={},
        status=status,
        attempts=0,
        lease_token=0,
        created_at=created_at,
        updated_at=created_at,
        **values,
    )


@pytest.fixture
def idle_stack(tmp_path: Path, redis_url: str) -> Stack:
    """A migrated database and an empty Redis database; nothing running."""
    stack = Stack(tmp_path, f"sqlite:///{tmp_path / 'inferq.db'}", redis_url)
    stack.migrate()
    return stack


def test_snapshot_reads_lanes_workers_and_throughput(idle_stack: Stack) -> None:
    now = time.time()
    with Session(idle_stack.db()) as session, session.begin():
        session.add_all(
            [
                _job("realtime", "queued", now - 5),
                _job("realtime", "queued", now - 2),
                _job("bulk", "queued", now - 30),
                _job("bulk", "running", now - 40),
                _job("bulk", "running", now - 50),
                _job("bulk", "queued", now - 8, model="other"),  # a model nobody named
                # Finished in the last minute: only succeeded jobs' tokens count.
                _job("standard", "succeeded", now - 20, finished_at=now - 10, completion_tokens=10),
                _job("bulk", "succeeded", now - 20, finished_at=now - 5, completion_tokens=20),
                _job("standard", "failed", now - 30, finished_at=now - 20, completion_tokens=5),
                _job("realtime", "cancelled", now - 3, finished_at=now - 1, completion_tokens=7),
                # Finished before the window.
                _job("bulk", "succeeded", now - 200, finished_at=now - 61, completion_tokens=99),
            ]
        )

    with idle_stack.db().connect() as connection:
        lanes = snapshot.lane_jobs(connection, now, ["simulated", "idle"])
        queued = backlog.queued_jobs(connection)
    # Every lane of the models named, in that order, then those of models found in the rows.
    assert list(lanes) == [
        (lane, model) for model in ("simulated", "idle", "other") for lane in LANES
    ]
    sim = "simulated"
    assert lanes["realtime", sim] == shapes.LaneJobs(queued=2, running=0, oldest_queued_age_s=5.0)
    assert lanes["standard", sim] == shapes.LaneJobs(queued=0, running=0, oldest_queued_age_s=0.0)
    assert lanes["bulk", sim] == shapes.LaneJobs(queued=1, running=2, oldest_queued_age_s=30.0)
    assert lanes["bulk", "other"] == shapes.LaneJobs(queued=1, oldest_queued_age_s=8.0)
    assert lanes["bulk", "idle"] == shapes.LaneJobs()
    # Admission's count, per lane of each model.
    assert queued == {("realtime", sim): 2, ("bulk", sim): 1, ("bulk", "other"): 1}

    with Session(idle_stack.db()) as session:
        done = snapshot.throughput(session, now)
    assert done.finished == {"succeeded": 2, "failed": 1, "cancelled": 1}
    assert done.completion_tokens == 30
    assert done.jobs_per_s == pytest.approx(4 / 60)
    assert done.tokens_per_s == pytest.approx(30 / 60)

    client = redis.Redis.from_url(idle_stack.redis_url)
    client.lpush(queue("bulk", "a"), "m1", "m2", "m3")
    client.lpush(queue("realtime", "a"), "m4")
    client.lpush(queue("bulk", "b"), "m5")
    assert snapshot.queue_messages(client, routes(["a", "b"])) == {
        ("realtime", "a"): 1,
        ("standard", "a"): 0,
        ("bulk", "a"): 3,
        ("realtime", "b"): 0,
        ("standard", "b"): 0,
        ("bulk", "b"): 1,
    }

    client.set("inferq:worker:host:2", json.dumps({"worker_id": "host:2", "engine": "vllm"}))
    client.set("inferq:worker:host:1", json.dumps({"worker_id": "host:1", "engine": "hf"}))
    client.set("inferq:worker:host:3", json.dumps({"worker_id": "host:3"}), px=1)
    client.set("inferq:ops:host:4", json.dumps({"worker_id": "host:4", "role": "ops"}))
    time.sleep(0.05)
    assert presence.workers(client) == [
        {"worker_id": "host:1", "engine": "hf"},
        {"worker_id": "host:2", "engine": "vllm"},
    ]
    assert presence.ops_workers(client) == [{"worker_id": "host:4", "role": "ops"}]


def _two_tenants(stack: Stack, now: float, model: str = "simulated") -> None:
    """Rows of tenants "acme" and "bee" with known times and tokens."""

    def job(lane: str, status: str, tenant: str, **values: Any) -> Job:
        return _job(lane, status, now - 30, model=model, tenant=tenant, **values)

    with Session(stack.db()) as session, session.begin():
        session.add_all(
            [
                job("bulk", "queued", "acme"),
                job("bulk", "queued", "acme"),
                job("bulk", "running", "acme"),
                job("bulk", "queued", "bee"),
                job("realtime", "running", "bee"),
                job("realtime", "running", "bee"),
                # Served in the last minute, whatever the end: prompt + completion tokens.
                job(
                    "realtime",
                    "succeeded",
                    "acme",
                    finished_at=now - 10,
                    prompt_tokens=30,
                    completion_tokens=60,
                ),
                job(
                    "realtime",
                    "failed",
                    "acme",
                    finished_at=now - 5,
                    prompt_tokens=3,
                    completion_tokens=None,
                ),
                job(
                    "bulk",
                    "succeeded",
                    "bee",
                    finished_at=now - 1,
                    prompt_tokens=100,
                    completion_tokens=20,
                ),
                # Cancelled before it ran: no tokens, yet a row: its tenant had a job end here.
                job("standard", "cancelled", "cid", finished_at=now - 2),
                # Before the window.
                job(
                    "standard",
                    "succeeded",
                    "acme",
                    finished_at=now - 61,
                    prompt_tokens=9,
                    completion_tokens=9,
                ),
            ]
        )


def test_snapshot_reads_each_tenants_jobs_and_tokens(idle_stack: Stack) -> None:
    now = time.time()
    _two_tenants(idle_stack, now)
    with idle_stack.db().connect() as connection:
        tenants = snapshot.tenant_jobs(connection, now)
    sim = "simulated"
    # Lane priority first, then tenant.
    assert tenants == {
        ("realtime", sim, "acme"): shapes.TenantJobs(60.0, tokens_served=93, completion_tokens=60),
        ("realtime", sim, "bee"): shapes.TenantJobs(60.0, running=2),
        ("standard", sim, "cid"): shapes.TenantJobs(60.0),
        ("bulk", sim, "acme"): shapes.TenantJobs(60.0, queued=2, running=1),
        ("bulk", sim, "bee"): shapes.TenantJobs(
            60.0, queued=1, tokens_served=120, completion_tokens=20
        ),
    }
    assert list(tenants) == sorted(tenants, key=lambda k: (LANES.index(k[0]), k[2]))
    assert tenants["realtime", sim, "acme"].tokens_per_s == pytest.approx(93 / 60)
    # A shorter window leaves the job that finished 10 s ago out.
    with idle_stack.db().connect() as connection:
        recent = snapshot.tenant_jobs(connection, now, window_s=6)
    assert recent["realtime", sim, "acme"] == shapes.TenantJobs(6, tokens_served=3)
    assert recent["bulk", sim, "bee"].tokens_per_s == pytest.approx(120 / 6)


def test_status_shows_each_tenants_jobs_and_tokens(idle_stack: Stack) -> None:
    _two_tenants(idle_stack, time.time(), model=DEMO_MODEL)
    done = status(idle_stack)
    assert done.returncode == 0, done.stderr
    tenants = table(done.stdout, "Tenants")
    found = [row for lane in LANES for row in rows(tenants, lane)]
    assert found == [
        ["realtime", DEMO_MODEL, "acme", "0", "0", f"{93 / 60:.1f}"],
        ["realtime", DEMO_MODEL, "bee", "0", "2", "0.0"],
        ["standard", DEMO_MODEL, "cid", "0", "0", "0.0"],
        ["bulk", DEMO_MODEL, "acme", "2", "1", "0.0"],
        ["bulk", DEMO_MODEL, "bee", "1", "0", f"{120 / 60:.1f}"],
    ]
    # The Lanes table still sums them.
    assert rows(table(done.stdout, "Lanes"), "bulk")[0][3:5] == ["3", "1"]


def test_metrics_targets_list_every_announced_metrics_address(idle_stack: Stack) -> None:
    """Prometheus's HTTP service discovery format, one group per process that announced a
    metrics URL (a worker still starting has none yet)."""
    client = redis.Redis.from_url(idle_stack.redis_url)
    worker = {"engine": "vllm", "model": "org/m", "metrics_url": "http://gpu1:40001/metrics"}
    client.set("inferq:worker:gpu1:7", json.dumps({"worker_id": "gpu1:7", **worker}))
    client.set("inferq:worker:gpu1:8", json.dumps({"worker_id": "gpu1:8", "engine": "vllm"}))
    ops = {"worker_id": "cpu:9", "metrics_url": "http://[::1]:40002/metrics"}
    client.set("inferq:ops:cpu:9", json.dumps(ops))
    assert presence.metrics_targets(client) == [
        {
            "targets": ["gpu1:40001"],
            "labels": {
                "role": "inference",
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "worker": "gpu1:7",
                "engine": "vllm",
                "model": "org/m",
            },
        },
        {
            "targets": ["[::1]:40002"],
            "labels": {
                "role": "ops",
                "__scheme__": "http",
                "__metrics_path__": "/metrics",
                "worker": "cpu:9",
            },
        },
    ]


def test_status_shows_an_ops_worker_apart_from_the_workers(idle_stack: Stack) -> None:
    client = redis.Redis.from_url(idle_stack.redis_url)
    record = {
        "worker_id": "cpu:9",
        "role": "ops",
        "queues": ["maintenance", "webhooks"],
        "beat": True,
        "metrics_url": "http://127.0.0.1:40002/metrics",
        "seen_at": time.time(),
    }
    client.set("inferq:ops:cpu:9", json.dumps(record))
    done = status(idle_stack)
    assert done.returncode == 0, done.stderr
    assert "no worker is announced" in done.stdout  # an ops worker is not an inference worker
    ((_, queues, beat, url, seen),) = rows(done.stdout, "cpu:9")
    assert (queues, beat, url) == ("maintenance,webhooks", "yes", record["metrics_url"])
    assert seen.endswith(" ago")


def test_status_of_an_idle_system_says_no_worker(idle_stack: Stack) -> None:
    done = status(idle_stack)
    assert done.returncode == 0, done.stderr
    for lane in ("realtime", "standard", "bulk"):
        assert rows(done.stdout, lane) == [[lane, DEMO_MODEL, "0", "0", "0", "-"]]
    assert "no tenant has queued, running or recently finished jobs" in done.stdout
    assert "no worker is announced" in done.stdout
    assert "no ops worker is announced" in done.stdout
    assert "no dispatcher is announced" in done.stdout
    assert rows(done.stdout, "none") == [["none", "0.00", "0.0"]]
