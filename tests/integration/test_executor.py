"""Claims and fencing against a real database, without Celery: a result is recorded once.

The executor runs in this process against a real SQLite file or PostgreSQL database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import select, text, update

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.lifecycle.transitions import Outcome
from app.core.messaging import clients
from app.core.models import Job, JobStatus, WebhookEvent
from app.core.settings import get_settings
from app.core.webhooks.outbox import event_id_for_job
from tests.conftest import PostgresDatabases, database_url_for, fresh_redis_url
from tests.support import wait_until
from workers.engines.base import GenRequest
from workers.engines.simulated import CostModel, SimulatedEngine
from workers.inference.claims import ending_of
from workers.inference.executor import Executor
from workers.inference.heartbeat import Heartbeat
from workers.inference.main import build_executor
from workers.inference.runner import GenResult, Runner


@pytest.fixture(params=["sqlite", "postgres"])
def database(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    postgres: PostgresDatabases,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[str]:
    url = database_url_for(request.param, tmp_path, postgres)
    monkeypatch.setenv("INFERQ_DATABASE_URL", url)
    # Webhook events are announced on Redis: a database of this test's own, fresh clients.
    monkeypatch.setenv("INFERQ_REDIS_URL", fresh_redis_url())
    get_settings.cache_clear()
    clients.reset()
    db.dispose()
    db.migrate()
    yield url
    db.dispose()
    get_settings.cache_clear()
    clients.reset()


@pytest.fixture
def runner() -> Iterator[Runner]:
    runner = Runner(SimulatedEngine(CostModel.from_settings(get_settings(), base_ms=1.0)))
    runner.start()
    yield runner
    runner.shutdown()


def insert(*bodies: JobCreate) -> list[str]:
    """Jobs as the API submits them (one transaction, for the dispatcher): their ids."""
    new = [jobs.new_job("t", body, get_settings().model_name) for body in bodies]
    with changes("api") as tx:
        transitions.create(tx, new)
    return [job.id for job in new]


def new_job(prompt: str = "hello", webhook_url: str | None = None) -> str:
    [job_id] = insert(JobCreate(prompt=prompt, params={"max_tokens": 4}, webhook_url=webhook_url))
    return job_id


def executor_on(runner: Runner, worker_id: str, kind: type[Executor] = Executor) -> Executor:
    """A started executor of ``kind``, built as the worker's composition root builds one."""
    built = build_executor(runner, worker_id, get_settings())
    executor = kind(built.runner, built.recorder, built.intake, built.settings)
    executor.start()
    return executor


def row(job_id: str) -> Job:
    with db.session_scope() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def events(job_id: str) -> list[tuple[str, str]]:
    with db.session_scope() as session:
        query = select(WebhookEvent.id, WebhookEvent.type).where(WebhookEvent.job_id == job_id)
        return [(r.id, r.type) for r in session.execute(query)]


def test_a_worker_that_lost_its_lease_changes_nothing(database: str, runner: Runner) -> None:
    job_id = new_job(webhook_url="https://8.8.8.8/hook")
    a = executor_on(runner, "worker-a")
    b = executor_on(runner, "worker-b")
    [claim_a] = a.claim([job_id])
    assert claim_a.token == 1
    # Worker A stalls; its job is handed back (what the reaper does when a lease expires).
    with db.session_scope() as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=JobStatus.QUEUED))
    assert b.execute([job_id], "standard") == {"succeeded": 1}
    winner = row(job_id)
    assert winner.lease_token == 2 and winner.lease_owner == "worker-b" and winner.attempts == 2
    # A wakes up and tries to record its own result: fenced off.
    late = GenResult("a late zombie result", "length", 1, 4, None)
    assert a.recorder.write([(claim_a, ending_of(late))]) == [False]
    after = row(job_id)
    assert after.result_text == winner.result_text != "a late zombie result"
    assert after.status == JobStatus.SUCCEEDED and after.finished_at == winner.finished_at
    # One event, B's: the fenced-off write sent nothing.
    assert events(job_id) == [(event_id_for_job(job_id), "job.succeeded")]
    # Announced to the ops worker's queue (by a thread of its own: never waited for).
    broker = redis.Redis.from_url(get_settings().redis_url)
    wait_until(lambda: broker.llen("webhooks") == 1, 10, "the event's announcement")


def test_a_job_found_overdue_at_claim_expires_with_its_event(database: str, runner: Runner) -> None:
    [late] = insert(JobCreate(prompt="late", timeout_s=0.05, webhook_url="https://8.8.8.8/hook"))
    plain = new_job()  # claimed in the same transaction; it has no webhook_url
    time.sleep(0.1)
    assert executor_on(runner, "w").execute([late, plain], "bulk") == {
        "skipped": 1,
        "succeeded": 1,
    }
    assert row(late).status == JobStatus.EXPIRED
    assert events(late) == [(event_id_for_job(late), "job.expired")]
    assert events(plain) == []


def test_duplicate_and_late_messages_claim_nothing(database: str, runner: Runner) -> None:
    job_id = new_job()
    executor = executor_on(runner, "w")
    assert executor.execute([job_id], "standard") == {"succeeded": 1}
    # The same message delivered again, and a message for a job that does not exist.
    assert executor.execute([job_id], "standard") == {"skipped": 1}
    assert executor.execute(["job_does_not_exist"], "standard") == {"skipped": 1}
    assert row(job_id).attempts == 1
    assert executor.intake.used == {"realtime": 0, "standard": 0, "bulk": 0}


def test_a_chunk_is_claimed_together_and_each_job_recorded(database: str, runner: Runner) -> None:
    ids = [new_job(f"chunk {i}") for i in range(20)]
    with db.session_scope() as session:  # one of them was cancelled while queued
        session.execute(update(Job).where(Job.id == ids[3]).values(status=JobStatus.CANCELLED))
    executor = executor_on(runner, "w")
    assert executor.execute(ids, "bulk") == {"succeeded": 19, "skipped": 1}
    with db.session_scope() as session:
        done = session.execute(
            text("SELECT count(*) FROM jobs WHERE status = 'succeeded' AND result_text <> ''")
        ).scalar()
        assert done == 19
    assert row(ids[3]).attempts == 0
    assert executor.intake.used["bulk"] == 0


def test_concurrent_claims_have_exactly_one_winner(database: str, runner: Runner) -> None:
    job_id = new_job()
    executors = [executor_on(runner, f"w{i}") for i in range(8)]
    claims: list[object] = []
    start = threading.Barrier(len(executors))

    def claim(executor: Executor) -> None:
        start.wait()
        claims.extend(executor.claim([job_id]))

    threads = [threading.Thread(target=claim, args=(e,)) for e in executors]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(claims) == 1
    with db.session_scope() as session:
        assert session.execute(text("SELECT attempts FROM jobs")).scalar() == 1


def test_engine_request_ids_are_unique_per_claim(database: str, runner: Runner) -> None:
    job_id = new_job()
    [claim] = executor_on(runner, "w").claim([job_id])
    assert isinstance(claim.request, GenRequest)
    assert claim.request.request_id == f"{job_id}.1"
    assert claim.request.priority == 1  # standard lane


def test_a_chunk_larger_than_the_worker_runs_within_its_slots(
    database: str, runner: Runner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_WORKER_CONCURRENCY", "2")
    get_settings.cache_clear()
    ids = [new_job(f"small worker {i}") for i in range(6)]
    executor = executor_on(runner, "w")
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, runner.in_flight())
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        assert executor.execute(ids, "bulk") == {"succeeded": 6}
    finally:
        stop.set()
        watcher.join()
    assert 1 <= peak <= 2


def test_nul_in_model_output_is_stored_and_a_refused_row_fails_only_its_job(
    database: str, runner: Runner
) -> None:
    ok_id, bad_id = new_job("ok"), new_job("bad")
    executor = executor_on(runner, "w")
    ok_claim, bad_claim = executor.claim([ok_id, bad_id])
    nul = GenResult("a\x00b", "length", 1, 3, None)
    # An error code longer than its column is refused by PostgreSQL (SQLite stores it).
    refused = Outcome(
        JobStatus.FAILED, error_code="x" * 200, error_message="a row the database may refuse"
    )
    written = [
        executor.recorder.put(ok_claim, ending_of(nul)),
        executor.recorder.put(bad_claim, refused),
    ]
    assert executor.recorder.stored(ok_claim, ending_of(nul), written[0]) == "succeeded"
    status = executor.recorder.stored(bad_claim, refused, written[1])
    assert row(ok_id).result_text == "a\x00b"
    after = row(bad_id)
    assert after.status == status == "failed"  # never left running
    if database.startswith("postgresql"):
        assert after.error_code == "result_not_stored"


def test_every_choice_is_stored_alone_or_in_a_group_write(database: str, runner: Runner) -> None:
    """A job's choices and logprobs (n > 1, logprobs) reach its row through the one fenced
    write, alone and in a group commit, on both databases; a NUL in them is stored as it is."""
    logprob = {"token": "a\x00", "logprob": -0.5, "top_logprobs": [{"token": "b", "logprob": -1}]}
    choices = [
        {"index": 0, "text": "a\x00", "finish_reason": "length", "logprobs": [logprob]},
        {"index": 1, "text": "c", "finish_reason": "stop", "logprobs": []},
    ]
    echoes = {0: ("> ", None), 1: ("> ", None)}
    result = GenResult("a\x00", "length", 1, 2, None, choices=choices, echoes=echoes)
    executor = executor_on(runner, "w")
    for group in (1, 3):
        claims = executor.claim([new_job(f"choices {group} {i}") for i in range(group)])
        written = [executor.recorder.put(c, ending_of(result)) for c in claims]
        for claim, write in zip(claims, written, strict=True):
            assert executor.recorder.stored(claim, ending_of(result), write) == "succeeded"
            stored = row(claim.job_id)
            assert stored.result_text == "> a\x00"
            assert stored.choices is not None
            assert [c["text"] for c in stored.choices] == ["> a\x00", "> c"]
            assert stored.choices[0]["logprobs"][0]["token"] == "a\x00"
            assert stored.choices[1]["finish_reason"] == "stop"
    # A job stopped while running ends every choice as it ends (not the runner's "abort").
    cancelled = GenResult("a", "abort", 1, 2, None, "cancelled", choices=choices)
    ending = ending_of(cancelled)
    assert isinstance(ending, Outcome) and ending.choices is not None
    assert {c["finish_reason"] for c in ending.choices} == {"cancelled"} == {ending.finish_reason}


class RecordingExecutor(Executor):
    """An executor that records the aborts its heartbeat asks for."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.aborted: list[tuple[str, str]] = []

    def request_abort(self, job_id: str, reason: str) -> bool:
        self.aborted.append((job_id, reason))
        return True


def test_one_heartbeat_renews_every_lease_and_spots_lost_and_cancelled_jobs(
    database: str, runner: Runner
) -> None:
    ids = [new_job(f"held {i}") for i in range(3)]
    executor = executor_on(runner, "w", RecordingExecutor)
    for claim in executor.claim(ids):
        executor._held[claim.job_id] = claim.token
    before = row(ids[0]).lease_expires_at
    assert before is not None
    with db.session_scope() as session:  # ids[1] was re-claimed elsewhere; ids[2] cancelled
        session.execute(update(Job).where(Job.id == ids[1]).values(lease_token=Job.lease_token + 1))
        session.execute(update(Job).where(Job.id == ids[2]).values(cancel_requested_at=1.0))
    time.sleep(0.01)
    Heartbeat(executor, get_settings(), {}).renew()
    assert (row(ids[0]).lease_expires_at or 0) > before
    assert row(ids[1]).lease_expires_at == before  # not ours any more: untouched
    assert sorted(executor.aborted) == sorted([(ids[1], "lease_lost"), (ids[2], "cancelled")])


def test_a_job_that_left_the_engine_is_not_taken_for_a_lost_lease(
    database: str, runner: Runner
) -> None:
    """A chunk's short job ends long before its long one; heartbeats meanwhile abort nothing."""
    short, long = insert(
        JobCreate(prompt="short", params={"max_tokens": 2}),
        JobCreate(prompt="long", params={"max_tokens": 3000}),
    )
    executor = executor_on(runner, "w", RecordingExecutor)
    worker = threading.Thread(target=executor.execute, args=([short, long], "bulk"))
    worker.start()
    try:
        wait_until(lambda: row(short).status == JobStatus.SUCCEEDED, 10, "the short job")
        assert row(long).status == JobStatus.RUNNING
        assert set(executor.held()) == {long}
        Heartbeat(executor, get_settings(), {}).renew()
        assert executor.aborted == []
    finally:
        Executor.request_abort(executor, long, "cancelled")  # the real one: stop it now
        worker.join(10)
    assert row(long).status == JobStatus.CANCELLED
