"""Chaos: the dependencies fail under load - Redis restarted, Redis wiped, PostgreSQL restarted.

Real processes on loopback: the API, one inference worker with the SIMULATED engine and the ops
worker (reaper every second), each test against a redis-server of its OWN (tests/chaos/servers.py)
so that stopping or wiping it touches nothing else. Leases are 10 s, renewed every second.

- ``test_redis_restart_mid_load``: redis-server (append-only file, ``appendfsync everysec``) gets
  SIGTERM while 60 jobs are queued or running, and comes back on the same port and directory.
  While it is down, ``POST /v1/jobs`` answers 503 ``broker_unavailable`` with ``Retry-After``
  and leaves no row behind, reads (``GET /v1/jobs/{id}``) still answer from the database, and the
  jobs the worker holds are still recorded. Once it is back every job ends ``succeeded`` with its
  result, claimed once (``attempts`` = 1: a Redis outage never makes a job run twice), and the
  rows do not change afterwards (no late second outcome); a job submitted after the restart runs.
- ``test_redis_flushall_mid_load``: FLUSHALL while most of 60 jobs still wait in Redis (a slow
  worker with 2 slots) destroys their messages; the reaper sees its marker ``inferq:epoch`` gone
  and sends every queued job again: all 60 end ``succeeded`` once (``attempts`` = 1), a job
  submitted right after the wipe is accepted and runs, the marker is set again and the worker
  announces itself again. Recovery is bounded by the reaper's grace for young jobs
  (``REAPER_GRACE_S``, 10 s) + its interval + the time to run the backlog.
- ``test_postgres_restart_mid_load[within-lease|past-lease]``: a PostgreSQL cluster of its own
  is stopped (``-m fast``) while 40 jobs run and wait: for 2 s with 10 s leases, or for 7.5 s
  with 4 s leases (long enough that the reaper, sweeping every second, usually reclaims the
  expired leases before the worker's backed-off retry writes its results, which the fence then
  discards). While it is down the API answers 503 ``database_unavailable`` with ``Retry-After``
  to reads and submissions, and the worker stays up, retrying. Once it is back every job ends
  ``succeeded`` with one result; within the lease each was claimed once (``attempts`` = 1), past
  it a job may have been claimed again (``attempts`` > 1 allowed, and printed). The rows do not
  change afterwards and a job submitted after the restart runs.
- ``test_a_waiting_caller_outlasts_a_database_outage``: an OpenAI call waits on its running job
  while PostgreSQL is stopped past the call's periodic row check: the call keeps waiting (its
  job is not cancelled) and answers 200 with the result once the outcome is committed.

Every wait is bounded (``wait_until``); servers and the stack are torn down in ``finally``. Each
test prints ``RECOVERY <scenario> <seconds>`` (``pytest -s``): the time from the fault's end
(the server answering again, or the wipe) until every job is terminal.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import bindparam, text

from app.core.messaging.names import EPOCH_KEY
from tests.chaos.servers import PostgresServer, RedisServer
from tests.conftest import PostgresDatabases
from tests.support import TERMINAL, Stack, queue, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(180)]

REAPER_S = 1.0
SETTINGS: dict[str, Any] = {
    "reaper_interval_s": REAPER_S,
    "heartbeat_s": 1,
    "lease_ttl_s": 10,
}
REDIS_OUTAGE_S = 3.0  # longer than Celery's first reconnect delay (2 s)


# --- helpers ---------------------------------------------------------------------------------


def report(scenario: str, seconds: float) -> None:
    print(f"\nRECOVERY {scenario} {seconds:.2f}", flush=True)


def body(i: int, max_tokens: int) -> dict[str, Any]:
    return {"prompt": f"chaos job {i}", "lane": "standard", "params": {"max_tokens": max_tokens}}


def submit_many(stack: Stack, n: int, max_tokens: int) -> list[str]:
    # At once, so work is still waiting when the fault comes. Standard-lane jobs still get a
    # message each.
    return stack.submit_many([body(i, max_tokens) for i in range(n)])


ROW_SQL = text(
    "SELECT id, status, attempts, lease_token, finished_at, result_text, finish_reason, "
    "completion_tokens, error_code FROM jobs WHERE id IN :ids"
).bindparams(bindparam("ids", expanding=True))


def rows(stack: Stack, ids: list[str]) -> dict[str, dict[str, Any]]:
    with stack.db().connect() as conn:
        return {r["id"]: dict(r) for r in conn.execute(ROW_SQL, {"ids": ids}).mappings()}


def counts(stack: Stack, ids: list[str]) -> Counter[str]:
    return Counter(r["status"] for r in rows(stack, ids).values())


def logs(stack: Stack, n: int = 25) -> str:
    return "\n".join(f"--- {p.name} (alive={p.alive()})\n{p.tail(n)}" for p in stack.procs)


def wait_all_terminal(stack: Stack, ids: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    def done() -> dict[str, dict[str, Any]] | None:
        found = rows(stack, ids)
        assert len(found) == len(ids), f"{len(ids) - len(found)} job row(s) missing"
        return found if all(r["status"] in TERMINAL for r in found.values()) else None

    try:
        return dict(wait_until(done, timeout, f"all {len(ids)} jobs to end"))
    except TimeoutError as exc:
        with contextlib.suppress(Exception):
            exc.add_note(f"statuses: {dict(counts(stack, ids))}")
        raise AssertionError(f"{exc}\n{logs(stack)}") from exc


def assert_succeeded_once(
    found: dict[str, dict[str, Any]], max_tokens: int, *, attempts_one: bool
) -> None:
    """Every job succeeded with its one result; ``attempts_one``: claimed exactly once."""
    statuses = Counter(r["status"] for r in found.values())
    assert statuses == {"succeeded": len(found)}, dict(statuses)
    for job_id, r in found.items():
        assert r["result_text"], (job_id, r)
        assert r["completion_tokens"] == max_tokens, (job_id, r)
        assert r["finished_at"] is not None and r["error_code"] is None, (job_id, r)
        assert r["attempts"] >= 1, (job_id, r)
    if attempts_one:
        twice = {k: r["attempts"] for k, r in found.items() if r["attempts"] != 1}
        assert not twice, f"job(s) claimed more than once after a Redis fault: {twice}"


def reaper_runs(stack: Stack) -> int:
    ops = next(p for p in stack.procs if p.name == "ops")
    text_ = ops.log.read_text(errors="replace")
    return len(re.findall(r"inferq\.reap\[[^\]]+\] succeeded", text_))


def assert_rows_settled(stack: Stack, ids: list[str], before: dict[str, dict[str, Any]]) -> None:
    """After two more reaper sweeps the finished rows are unchanged: no late second outcome."""
    start = reaper_runs(stack)
    assert start, "no reaper sweep found in the ops worker's log"
    wait_until(lambda: reaper_runs(stack) >= start + 2, 20, "two more reaper sweeps")
    assert rows(stack, ids) == before


def submit_until_accepted(stack: Stack, what: str, timeout: float = 15) -> tuple[str, int]:
    """Submit one job, retrying a 503 (a dependency just came back); returns (id, 503s seen)."""
    refused = 0

    def accepted() -> str | None:
        nonlocal refused
        with stack.client() as c:
            answer = c.post("/v1/jobs", json=body(-1, 8))
        if answer.status_code == 503:
            refused += 1
            return None
        assert answer.status_code == 202, answer.text
        return str(answer.json()["id"])

    return wait_until(accepted, timeout, what, every=0.2), refused


def assert_503(answer: httpx.Response, code: str) -> None:
    assert answer.status_code == 503, (answer.status_code, answer.text)
    assert answer.json()["error"]["code"] == code, answer.text
    assert int(answer.headers["Retry-After"]) >= 1, answer.headers


def job_count(stack: Stack) -> int:
    return int(stack.scalar("SELECT count(*) FROM jobs"))


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def pg_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


@contextlib.contextmanager
def started(stack: Stack, **worker: Any) -> Iterator[Stack]:
    try:
        stack.migrate()
        stack.start_api()
        stack.start_ops()
        stack.start_worker(**worker)
        yield stack
    finally:
        stack.stop()


# --- scenarios -------------------------------------------------------------------------------


def test_redis_restart_mid_load(
    tmp_path: Path, postgres: PostgresDatabases, redis_server: RedisServer
) -> None:
    n, max_tokens = 60, 16
    # 8 slots, a token every ~30 ms: each job ~0.5 s, the 60 take ~4 s.
    stack = Stack(tmp_path, postgres.create(), redis_server.url(0), sim_time_scale=4, **SETTINGS)
    with started(stack, worker_concurrency=8):
        worker = next(p for p in stack.procs if p.name.startswith("worker"))
        ids = submit_many(stack, n, max_tokens)
        wait_until(lambda: counts(stack, ids)["succeeded"] >= 8, 30, "the first jobs to succeed")
        probe = redis_server.client()
        marker = wait_until(lambda: probe.get(EPOCH_KEY), 10, "the reaper's marker")
        redis_server.stop()
        stopped_at = time.monotonic()
        left = n - counts(stack, ids)["succeeded"]
        assert left > 0, "every job finished before Redis stopped: the test proved nothing"
        try:
            # Submissions are refused up front and leave nothing behind; reads still work.
            rows_before = job_count(stack)
            with stack.client() as c:
                assert_503(c.post("/v1/jobs", json=body(-1, 8)), "broker_unavailable")
                assert c.get(f"/v1/jobs/{ids[-1]}").status_code == 200
                assert c.get("/readyz").status_code == 503
            assert job_count(stack) == rows_before
            # The jobs the worker holds are recorded while the broker is away.
            wait_until(
                lambda: counts(stack, ids)["running"] == 0,
                20,
                "the running jobs to be recorded while Redis is down",
            )
            wait_until(
                lambda: "Connection to broker lost" in worker.log.read_text(errors="replace"),
                15,
                "the worker to see the broker gone",
            )
            time.sleep(max(0.0, REDIS_OUTAGE_S - (time.monotonic() - stopped_at)))
            assert all(p.alive() for p in stack.procs), logs(stack)
        finally:
            redis_server.start()
        back_at = time.monotonic()
        waiting = probe.llen(queue("standard"))
        # The premise: the append-only file kept Redis's data (the reaper's marker survived).
        assert probe.get(EPOCH_KEY) == marker
        found = wait_all_terminal(stack, ids, 45)
        report("redis-restart", time.monotonic() - back_at)
        print(
            f"CHAOS redis-restart outage={back_at - stopped_at:.1f}s jobs_left_at_stop={left} "
            f"messages_waiting_at_restart={waiting}",
            flush=True,
        )
        assert_succeeded_once(found, max_tokens, attempts_one=True)

        after, refused = submit_until_accepted(stack, "a submission after the restart")
        assert stack.wait_job(after, 30)["status"] == "succeeded"
        print(f"CHAOS redis-restart 503s_after_restart={refused}", flush=True)
        assert_rows_settled(stack, ids, found)
        assert all(p.alive() for p in stack.procs), logs(stack)
        probe.close()


def test_redis_flushall_mid_load(
    tmp_path: Path, postgres: PostgresDatabases, redis_server: RedisServer
) -> None:
    n, max_tokens = 60, 20
    stack = Stack(tmp_path, postgres.create(), redis_server.url(0), sim_time_scale=1, **SETTINGS)
    with started(stack, worker_concurrency=2):
        ids = submit_many(stack, n, max_tokens)
        wait_until(lambda: counts(stack, ids)["succeeded"] >= 2, 30, "the first jobs to succeed")
        client = redis_server.client()
        # The reaper's first sweep (beat, every second after the ops worker is ready) sets the
        # marker whose absence later tells it that Redis was wiped.
        wait_until(lambda: client.exists(EPOCH_KEY), 10, "the reaper's marker")
        pipe = client.pipeline(transaction=True)
        pipe.llen(queue("standard"))
        pipe.exists(EPOCH_KEY)
        pipe.flushall()
        lost, had_epoch, _ = pipe.execute()
        wiped_at = time.monotonic()
        assert lost > 0, "no message was waiting in Redis: the wipe proved nothing"
        assert had_epoch, "the reaper had not set its marker before the wipe"

        # Submissions go on right away (and their messages are not lost).
        after, refused = submit_until_accepted(stack, "a submission after the wipe")
        found = wait_all_terminal(stack, ids, 45)
        report("redis-flushall", time.monotonic() - wiped_at)
        print(f"CHAOS redis-flushall messages_destroyed={lost}", flush=True)
        assert_succeeded_once(found, max_tokens, attempts_one=True)
        assert stack.wait_job(after, 30)["status"] == "succeeded"
        assert refused == 0, f"{refused} submission(s) refused right after FLUSHALL"
        assert client.exists(EPOCH_KEY), "the reaper did not set its marker again"
        worker = next(p for p in stack.procs if p.name.startswith("worker"))
        wait_until(lambda: stack.worker_record(worker.pid), 10, "the worker to announce again")
        assert_rows_settled(stack, ids, found)
        assert all(p.alive() for p in stack.procs), logs(stack)
        client.close()


@pytest.mark.parametrize(
    ("outage_s", "lease_s"),
    [pytest.param(2.0, 10, id="within-lease"), pytest.param(7.5, 4, id="past-lease")],
)
def test_postgres_restart_mid_load(
    tmp_path: Path,
    pg_server: PostgresServer,
    redis_server: RedisServer,
    outage_s: float,
    lease_s: int,
) -> None:
    n, max_tokens = 40, 16
    # 4 slots, a token every ~30 ms: each job ~0.5 s, the 40 take ~5 s.
    stack = Stack(
        tmp_path,
        pg_server.create_database("inferq"),
        redis_server.url(0),
        sim_time_scale=4,
        **{**SETTINGS, "lease_ttl_s": lease_s},
    )
    scenario = f"postgres-restart-{'within' if outage_s < lease_s else 'past'}-lease"
    with started(stack, worker_concurrency=4):
        worker = next(p for p in stack.procs if p.name.startswith("worker"))
        ids = submit_many(stack, n, max_tokens)
        wait_until(lambda: counts(stack, ids)["succeeded"] >= 4, 30, "the first jobs to succeed")
        held = counts(stack, ids)["running"]
        pg_server.stop("fast")
        stopped_at = time.monotonic()
        try:
            with stack.client() as c:
                assert_503(c.get(f"/v1/jobs/{ids[-1]}"), "database_unavailable")
                assert_503(c.post("/v1/jobs", json=body(-1, 8)), "database_unavailable")
                assert c.get("/readyz").status_code == 503
            # The worker notices and waits for the database instead of failing or exiting.
            wait_until(
                lambda: "database unavailable" in worker.log.read_text(errors="replace"),
                15,
                "the worker to retry the database",
            )
            time.sleep(max(0.0, outage_s - (time.monotonic() - stopped_at)))  # the fault's length
            assert all(p.alive() for p in stack.procs), logs(stack)
        finally:
            pg_server.start()
        back_at = time.monotonic()
        stack.db().dispose()  # the test's own pooled connections died with the server
        found = wait_all_terminal(stack, ids, 45)
        report(scenario, time.monotonic() - back_at)
        attempts = Counter(r["attempts"] for r in found.values())
        print(
            f"CHAOS {scenario} outage={back_at - stopped_at:.1f}s lease={lease_s}s "
            f"running_at_stop={held} attempts={dict(sorted(attempts.items()))}",
            flush=True,
        )
        # Within the lease nothing runs twice; past it a job may be claimed again, but it still
        # ends once, with one result.
        assert_succeeded_once(found, max_tokens, attempts_one=outage_s < lease_s)

        after, refused = submit_until_accepted(stack, "a submission after the restart")
        assert stack.wait_job(after, 30)["status"] == "succeeded"
        print(f"CHAOS {scenario} 503s_after_restart={refused}", flush=True)
        assert_rows_settled(stack, ids, found)
        assert all(p.alive() for p in stack.procs), logs(stack)


def test_a_waiting_caller_outlasts_a_database_outage(
    tmp_path: Path, pg_server: PostgresServer, redis_server: RedisServer
) -> None:
    # One job of 16 tokens, a token every ~100 ms: it ends during the outage, and its outcome
    # is committed once the database is back. The caller reads the job's row every 5 s while
    # the relay is quiet; that read comes while the database is down.
    stack = Stack(
        tmp_path,
        pg_server.create_database("inferq"),
        redis_server.url(0),
        sim_time_scale=16,
        **SETTINGS,
    )
    with started(stack):
        with stack.client() as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
        answer: dict[str, Any] = {}

        def call() -> None:
            with stack.client() as c:
                messages = [{"role": "user", "content": "hold on"}]
                r = c.post(
                    "/v1/chat/completions",
                    json={"model": model, "messages": messages, "max_tokens": 16},
                )
                answer.update(status=r.status_code, body=r.json())

        caller = threading.Thread(target=call, name="caller")
        caller.start()
        running = "SELECT count(*) FROM jobs WHERE status = 'running'"
        wait_until(lambda: stack.scalar(running), 15, "the call's job to run")
        pg_server.stop("fast")
        try:
            time.sleep(7.0)  # past the caller's row check and the job's last token
        finally:
            pg_server.start()
        stack.db().dispose()  # the test's own pooled connections died with the server
        caller.join(60)
        assert answer.get("status") == 200, f"{answer}\n{logs(stack)}"
        assert answer["body"]["choices"][0]["finish_reason"] == "length"
        assert answer["body"]["usage"]["completion_tokens"] == 16
