"""The owners of state, called directly on a SQLite file of the test's own: what each function
writes, and what it leaves to follow the commit (its ``After``); then the construct that commits
and runs it (``changes``), observed in a real Redis.

The functions are called in a transaction of the test's own (a ``Tx`` whose ``After`` nobody
runs), so each test sees exactly the effects one function asked for.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import select, text, update

from app.batches import transitions as batches
from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.after import After, By, Tx
from app.core.lifecycle.changes import changes
from app.core.messaging import broker, clients, names
from app.core.models import Batch, BatchStatus, Job, JobStatus, WebhookEvent, now
from app.core.scheduling import fairshare
from app.core.settings import Settings

HOOK = "https://8.8.8.8/hook"  # a public address: accepted, never called here


@contextlib.contextmanager
def tx(by: By = "api") -> Iterator[Tx]:
    """A transaction whose ``After`` is the test's to read, not to run."""
    with db.transaction() as connection:
        yield Tx(connection, After(by))


def add(
    settings: Settings, n: int = 1, *, lane: str = "standard", direct: bool = False, **body: Any
) -> list[str]:
    """``n`` new jobs, committed as the API commits them."""
    made = [
        jobs.new_job("t", JobCreate(prompt=f"p{i}", lane=lane, **body), settings.model_name)
        for i in range(n)
    ]
    with tx() as t:
        transitions.create(t, made, direct=direct)
    return [job.id for job in made]


def row(job_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(select(Job.__table__).where(Job.id == job_id)).one()


def force(job_id: str, **values: Any) -> None:
    """Put a job in a state for the test (what other owners' calls would have written)."""
    with db.transaction() as connection:
        connection.execute(update(Job).where(Job.id == job_id).values(**values))


def events(job_id: str) -> list[str]:
    with db.transaction() as connection:
        query = select(WebhookEvent.type).where(WebhookEvent.job_id == job_id)
        return list(connection.execute(query).scalars())


def claimed(job_ids: list[str], worker: str = "w", lease_s: float = 60.0) -> list[Any]:
    with tx("worker") as t:
        return transitions.claim(t, job_ids, worker=worker, lease_s=lease_s, stamp=now())


def queue(settings: Settings, lane: str = "standard") -> str:
    return names.queue_of(lane, settings.model_name)


# --- created -----------------------------------------------------------------------------------


def test_created_jobs_wait_unsent_and_wake_their_dispatcher(core: Settings) -> None:
    made = [jobs.new_job("t", JobCreate(prompt="a"), core.model_name) for _ in range(2)]
    with tx() as t:
        transitions.create(t, made)
    for job in made:
        stored = row(job.id)
        assert (stored.status, stored.attempts, stored.lease_token) == ("queued", 0, 0)
        assert stored.enqueued_at is None and stored.updated_at == job.created_at
    assert t.after.wake == {queue(core)} and t.after.send == []
    assert [(m.job_id, m.source, m.to) for m in t.after.moved] == [
        (job.id, None, "queued") for job in made
    ]


def test_a_job_the_api_sends_itself_is_stamped_sent_in_its_insert(core: Settings) -> None:
    job = jobs.new_job("t", JobCreate(prompt="a"), core.model_name)
    with tx() as t:
        transitions.create(t, [job], direct=True)
    assert row(job.id).enqueued_at == job.created_at
    assert t.after.send == [(job.id, queue(core))] and t.after.wake == set()


# --- queued: cancelled, expired ---------------------------------------------------------------


def test_cancel_ends_a_queued_job_marks_a_running_one_and_leaves_a_finished_one(
    core: Settings,
) -> None:
    waiting, running, done = add(core, 3, webhook_url=HOOK)
    force(waiting, charged=40)
    claimed([running])
    force(done, status="succeeded", finished_at=1.0)
    for job_id in (waiting, running, done):
        with tx() as t:
            transitions.cancel(t, job_id, now())
        if job_id == waiting:
            assert row(job_id).status == "cancelled"
            assert [(m.source, m.to) for m in t.after.moved] == [("queued", "cancelled")]
            assert events(job_id) == ["job.cancelled"] and len(t.after.events) == 1
            assert t.after.usage == [fairshare.Usage("standard", core.model_name, "t", 40, 0)]
        elif job_id == running:
            assert row(job_id).status == "running" and row(job_id).cancel_requested_at
            assert t.after.abort == [running] and t.after.moved == []
        else:
            assert row(job_id).status == "succeeded"
            assert t.after == After("api")


def test_only_jobs_past_their_deadline_expire_unstarted(core: Settings) -> None:
    late, early = add(core, 2, webhook_url=HOOK)
    stamp = now()
    force(late, deadline_at=stamp - 1)
    force(early, deadline_at=stamp + 60)
    with tx("reaper") as t:
        assert transitions.expire_queued(t, [late, early], stamp) == 1
    assert (row(late).status, row(late).error_code) == ("expired", "deadline_exceeded")
    assert row(early).status == "queued"
    assert events(late) == ["job.expired"] and t.after.count("expired") == 1


# --- queued: sent and unsent ------------------------------------------------------------------


def test_mark_sent_stamps_and_charges_only_unsent_jobs(core: Settings) -> None:
    fresh, sent = add(core, 2)
    force(sent, enqueued_at=1.0)
    stamp = now()
    with tx("dispatcher") as t:
        rows = transitions.mark_sent(
            t, select(Job.id).where(Job.id.in_([fresh, sent])), stamp, (Job.id, Job.cost)
        )
    assert [r.id for r in rows] == [fresh]
    assert row(fresh).enqueued_at == stamp and row(fresh).charged == rows[0].cost > 0
    assert row(sent).enqueued_at == 1.0 and row(sent).charged == 0


def test_a_failed_send_leaves_its_jobs_unsent_and_uncharged(core: Settings) -> None:
    (job_id,) = add(core)
    force(job_id, enqueued_at=1.0, charged=30)
    with tx("dispatcher") as t:
        transitions.send_failed(t, [job_id])
    assert (row(job_id).enqueued_at, row(job_id).charged) == (None, 0)
    assert t.after.wake == {queue(core)}


def test_taken_back_jobs_are_unsent_and_refunded_unless_claimed_meanwhile(core: Settings) -> None:
    back, taken = add(core, 2)
    for job_id in (back, taken):
        force(job_id, enqueued_at=1.0, charged=25)
    claimed([taken])  # a worker took its second message first
    with tx("dispatcher") as t:
        transitions.take_back(t, [back, taken])
    assert (row(back).enqueued_at, row(back).charged) == (None, 0)
    assert row(taken).status == "running" and row(taken).charged == 25
    assert t.after.usage == [fairshare.Usage("standard", core.model_name, "t", 25, 0)]


def test_lost_messages_are_forgotten_for_the_dispatcher(core: Settings) -> None:
    lost, recent, mine = add(core, 3)
    stamp = now()
    force(lost, enqueued_at=stamp - 60)
    force(recent, enqueued_at=stamp + 1)  # sent after the reaper looked: on its way
    force(mine, enqueued_at=stamp - 60, lane="bulk")
    with tx("reaper") as t:
        which = Job.lane == "standard"
        assert transitions.forget_lost(t, stamp, which, [queue(core)]) == 1
    assert row(lost).enqueued_at is None
    assert row(recent).enqueued_at == stamp + 1 and row(mine).enqueued_at == stamp - 60
    assert t.after.wake == {queue(core)}
    with tx("reaper") as t:  # after a wipe: every queued job, whatever its queue
        assert transitions.forget_lost(t, stamp, None) == 1
    assert row(mine).enqueued_at is None


# --- running: claimed, recorded, handed back, reclaimed --------------------------------------


def test_a_claim_takes_queued_jobs_in_order_and_expires_the_overdue(core: Settings) -> None:
    second, first, overdue, gone = add(core, 4, webhook_url=HOOK)
    force(overdue, deadline_at=now() - 1)
    force(gone, status="cancelled")
    with tx("worker") as t:
        rows = transitions.claim(
            t, [first, second, overdue, gone], worker="w1", lease_s=30, stamp=now()
        )
    assert [r.id for r in rows] == [first, second]
    for job_id in (first, second):
        stored = row(job_id)
        assert (stored.status, stored.attempts, stored.lease_token) == ("running", 1, 1)
        assert stored.lease_owner == "w1" and stored.lease_expires_at > now()
    assert row(overdue).status == "expired" and events(overdue) == ["job.expired"]
    assert sorted((m.job_id, m.to) for m in t.after.moved) == sorted(
        [(first, "running"), (second, "running"), (overdue, "expired")]
    )


def test_outcomes_are_written_under_their_own_lease_only(core: Settings) -> None:
    ids = add(core, 3, webhook_url=HOOK)
    leases = [transitions.lease_of(r) for r in claimed(ids)]
    force(ids[1], lease_token=2)  # reclaimed and claimed again elsewhere: this lease is lost
    outcome = transitions.Outcome(
        JobStatus.SUCCEEDED, text="x", finish_reason="stop", prompt_tokens=3, completion_tokens=4
    )
    with tx("worker") as t:
        written = transitions.record(t, [(lease, outcome) for lease in leases], stamp=now())
    assert written == [True, False, True]
    assert [row(i).status for i in ids] == ["succeeded", "running", "succeeded"]
    assert events(ids[0]) == ["job.succeeded"] and events(ids[1]) == []
    assert [u.used for u in t.after.usage] == [7, 7]
    with tx("worker") as t:  # one outcome alone: the realtime path's single statement
        assert transitions.record(t, [(leases[1], outcome)], stamp=now()) == [False]
    assert t.after.moved == []


def test_a_handed_back_job_waits_again_and_its_charge_is_refunded(core: Settings) -> None:
    (job_id,) = add(core)
    force(job_id, enqueued_at=1.0, charged=50)
    lease = transitions.lease_of(claimed([job_id])[0])
    with tx("worker") as t:
        transitions.hand_back(t, lease, now())
    stored = row(job_id)
    assert (stored.status, stored.enqueued_at, stored.lease_owner) == ("queued", None, None)
    assert t.after.wake == {queue(core)}
    assert t.after.usage == [lease.usage(0)] and lease.charged == 50
    with tx("worker") as t:  # a second hand-back of the same lease changes nothing
        transitions.hand_back(t, lease, now())
    assert t.after.moved == [] and t.after.wake == set()


def test_lost_leases_are_queued_again_failed_or_expired(core: Settings) -> None:
    again, tired, late, alive = add(core, 4, webhook_url=HOOK)
    claimed([again, tired, late, alive], lease_s=-1)
    force(alive, lease_expires_at=now() + 60)
    force(tired, attempts=3)
    force(late, deadline_at=now() - 1)
    rows = [row(i) for i in (again, tired, late, alive)]
    with tx("reaper") as t:
        transitions.reclaim(t, rows, now(), max_attempts=3)
    assert [row(i).status for i in (again, tired, late, alive)] == [
        "queued",
        "failed",
        "expired",
        "running",
    ]
    assert row(tired).error_code == "worker_lost" and row(again).enqueued_at is None
    assert events(tired) == ["job.failed"] and events(late) == ["job.expired"]
    assert events(again) == [] and t.after.wake == {queue(core)}


def test_stopping_a_batch_ends_its_queued_lines_and_aborts_the_running(core: Settings) -> None:
    queued, running, other = add(core, 3, lane="bulk")
    force(queued, batch_id="batch_1")
    force(running, batch_id="batch_1")
    claimed([running])
    with tx("ops") as t:
        transitions.stop_batch(t, "batch_1", now(), to=JobStatus.EXPIRED, code="batch_expired")
    assert (row(queued).status, row(queued).error_code) == ("expired", "batch_expired")
    assert row(running).status == "running" and row(other).status == "queued"
    assert t.after.abort == [running] and t.after.events == []


def test_a_move_the_status_machine_forbids_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot go from queued to succeeded"):
        transitions.compare_and_set("job_x", expect="queued", to="succeeded")


# --- batches ------------------------------------------------------------------------------------


def new_batch(settings: Settings, **values: Any) -> str:
    batch_id = f"batch_{time.monotonic_ns()}"
    with db.session_scope() as session:  # the API creates a batch in its request's session
        t = Tx(session.connection(), After("api"), session)
        batches.create(
            t,
            batch_id,
            now(),
            tenant="t",
            endpoint="/v1/chat/completions",
            input_file_id="file_1",
            completion_window="24h",
            meta={},
            expires_at=now() + 60,
            **values,
        )
    assert t.after.start == [batch_id]
    return batch_id


def batch(batch_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(select(Batch.__table__).where(Batch.id == batch_id)).one()


def test_a_batch_goes_from_validating_to_completed_under_its_lease(core: Settings) -> None:
    batch_id = new_batch(core, webhook_url=HOOK)
    assert batch(batch_id).status == "validating"
    held = now()
    with tx("ops") as t:
        assert batches.take(t, batch_id, BatchStatus.VALIDATING, held)
        assert not batches.take(t, batch_id, BatchStatus.VALIDATING, held + 1)  # held
        assert not batches.start(t, batch_id, held + 1, now(), total=3)  # not our lease
        assert batches.start(t, batch_id, held, now(), total=3)
    stored = batch(batch_id)
    assert (stored.status, stored.request_total, stored.claimed_at) == ("in_progress", 3, None)
    with tx("ops") as t:
        assert batches.take(t, batch_id, "in_progress", held, to=BatchStatus.FINALIZING)
    assert batch(batch_id).status == "finalizing" and batch(batch_id).finalizing_at == held
    with tx("ops") as t:
        done = batches.finish(
            t, batch_id, "finalizing", "completed", held, now(), ended_at=5.0, request_completed=3
        )
    assert done and batch(batch_id).status == "completed" and batch(batch_id).completed_at == 5
    assert len(t.after.events) == 1  # batch.completed, for its webhook_url


def test_a_batch_fails_validation_or_is_cancelled_only_from_where_it_may(core: Settings) -> None:
    failed, cancelled = new_batch(core), new_batch(core)
    held = now()
    with tx("ops") as t:
        batches.take(t, failed, BatchStatus.VALIDATING, held)
        assert batches.fail(t, failed, held, now(), [{"code": "empty_file"}])
    assert batch(failed).status == "failed" and batch(failed).errors == [{"code": "empty_file"}]
    with tx("api") as t:
        assert batches.cancel(t, cancelled, "validating", now())
        assert not batches.cancel(t, cancelled, "validating", now())  # it moved on
    assert batch(cancelled).status == "cancelling"
    with pytest.raises(ValueError, match="cannot go from failed to cancelling"), tx() as t:
        batches.cancel(t, failed, "failed", now())


def test_an_overdue_batch_is_marked_once(core: Settings) -> None:
    batch_id = new_batch(core)
    held = now()
    with tx("ops") as t:
        batches.take(t, batch_id, BatchStatus.VALIDATING, held)
        batches.start(t, batch_id, held, now(), total=1)
        assert batches.mark_expired(t, batch_id, 7.0)
        assert not batches.mark_expired(t, batch_id, 8.0)
    assert (batch(batch_id).status, batch(batch_id).expired_at) == ("in_progress", 7.0)


# --- the construct: commit, then what follows --------------------------------------------------


def test_what_follows_runs_after_the_commit_and_only_then(core: Settings) -> None:
    client = clients.redis_client()
    listener = client.pubsub(ignore_subscribe_messages=True)
    listener.subscribe(names.CONTROL_CHANNEL)
    waiting, running, hooked = add(core, 3, webhook_url=HOOK)
    client.delete(names.WAKE_KEY)
    claimed([running])
    with changes("api") as t:
        transitions.cancel(t, running, now())
        transitions.cancel(t, hooked, now())
        transitions.create(t, [jobs.new_job("t", JobCreate(prompt="x"), core.model_name)])
        # Inside the transaction nothing has followed yet.
        assert client.llen(names.WAKE_KEY) == 0 and client.llen(names.WEBHOOK_QUEUE) == 0
    # The dispatcher is woken, the event announced (and stamped), the worker told to abort.
    assert client.lrange(names.WAKE_KEY, 0, -1) == [queue(core).encode()]
    assert client.llen(names.WEBHOOK_QUEUE) == 1
    with db.transaction() as connection:
        stamped = connection.execute(text("SELECT dispatched_at FROM webhook_events")).scalar()
    assert stamped is not None
    deadline, message = time.monotonic() + 5, None
    while message is None and time.monotonic() < deadline:  # past the subscription's reply
        message = listener.get_message(timeout=0.5)
    assert message is not None and json.loads(message["data"]) == {
        "action": "cancel",
        "job_id": running,
    }
    assert row(waiting).status == "queued"


def test_a_change_that_rolls_back_is_followed_by_nothing(core: Settings) -> None:
    client = clients.redis_client()
    client.delete(names.WAKE_KEY)
    job = jobs.new_job("t", JobCreate(prompt="x"), core.model_name)
    with pytest.raises(RuntimeError), changes("api") as t:
        transitions.create(t, [job])
        raise RuntimeError("the caller failed before the commit")
    with db.transaction() as connection:
        assert connection.execute(text("SELECT count(*) FROM jobs")).scalar() == 0
    assert client.llen(names.WAKE_KEY) == 0


def test_the_api_sends_a_direct_job_after_its_commit(core: Settings) -> None:
    job = jobs.new_job("t", JobCreate(prompt="x"), core.model_name)
    with changes("api") as t:
        transitions.create(t, [job], direct=True)
    [payload] = clients.redis_client().lrange(queue(core), 0, -1)
    message = broker.RunJobs.of_stored(payload)
    assert message == broker.RunJobs([job.id], "standard")


def test_a_direct_send_that_fails_leaves_the_job_for_the_dispatcher(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = jobs.new_job("t", JobCreate(prompt="x"), core.model_name)
    monkeypatch.setenv("INFERQ_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens
    monkeypatch.setenv("INFERQ_DEPENDENCY_TIMEOUT_S", "0.2")
    from app.core.settings import get_settings

    get_settings.cache_clear()
    clients.reset()
    with changes("api") as t:
        transitions.create(t, [job], direct=True)
    assert row(job.id).enqueued_at is None  # unsent: the dispatcher sends it
