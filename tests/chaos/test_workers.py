"""Chaos: workers killed, paused and stopped under load, and messages lost or doubled.

Real processes on loopback (API, inference workers with the SIMULATED engine, the ops worker
with its reaper every second) against PostgreSQL and a Redis database of their own. Leases are
4 s, renewed every second. Each test proves one line of the reliability contract
(docs/reliability.md):

- ``kill -9`` of a worker holding jobs: another worker finishes every one of them, once, with
  ``attempts`` = 2, within lease TTL + reaper period (+ one heartbeat of slack);
- a worker paused (SIGSTOP) past its lease, then resumed: its late results change nothing and
  no second webhook event is made;
- SIGTERM under load: the jobs it holds finish, it exits 0, nothing runs twice;
- SIGTERM with jobs longer than the grace period: they are handed back and finished elsewhere;
- a crash between a job's commit and what follows it: a job left for the dispatcher is sent
  by it; one the API meant to send itself is found by the reaper under an empty list, unsent,
  and sent by the dispatcher;
- a message taken off its lane by a worker that dies before claiming it (Redis keeps no
  redelivery of its own): the reaper unsends its job and the dispatcher sends it again;
- the same message delivered twice: the job runs once;
- a background response (the Responses API) with its worker and its API killed with -9: it
  ends once, with one webhook event;
- a 10,000-input embeddings batch whose embedding worker is killed with -9 mid-batch: another
  worker of the model finishes it, and every line is answered once;
- ``kill -9`` of a worker whose own queue (prefix affinity) holds messages: they are taken back
  into the fair order and the other worker runs every job once.

Each prints a ``RECOVERY <scenario> <seconds>`` line (``pytest -s``) for docs/reliability.md.
"""

from __future__ import annotations

import io
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from openai import OpenAI
from sqlalchemy import text

from app.core.messaging.names import OWN_QUEUES_KEY, own_queue
from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.support import TERMINAL, Receiver, Stack, queue, wait_until

pytestmark = pytest.mark.chaos

LEASE_S = 4.0
REAPER_S = 1.0
HEARTBEAT_S = 1.0


@pytest.fixture
def stack(tmp_path: Path, postgres: PostgresDatabases) -> Iterator[Stack]:
    stack = Stack(
        tmp_path,
        postgres.create(),
        fresh_redis_url(),
        lease_ttl_s=LEASE_S,
        heartbeat_s=HEARTBEAT_S,
        reaper_interval_s=REAPER_S,
        webhook_allow_private="true",
        webhook_sweep_interval_s=0.5,
        # A token every ~60 ms: a 40-token job runs for a few seconds.
        sim_time_scale=8,
        worker_concurrency=8,
    )
    try:
        stack.migrate()
        stack.start_api()
        stack.start_ops()
        yield stack
    finally:
        stack.stop()


def submit_many(stack: Stack, n: int, **extra: Any) -> list[str]:
    body = {"prompt": "tell me about queues", "params": {"max_tokens": 40}, **extra}
    return stack.submit_many([body] * n)


def rows(stack: Stack, ids: list[str]) -> dict[str, dict[str, Any]]:
    with stack.db().connect() as conn:
        found = conn.execute(
            text(
                "SELECT id, status, attempts, lease_owner, finished_at, result_text, "
                "completion_tokens, started_at FROM jobs WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).mappings()
        return {row["id"]: dict(row) for row in found}


def all_terminal(stack: Stack, ids: list[str]) -> dict[str, dict[str, Any]] | None:
    found = rows(stack, ids)
    return found if all(r["status"] in TERMINAL for r in found.values()) else None


def running_on(stack: Stack, ids: list[str], owner_pid: int) -> list[str]:
    return [
        job_id
        for job_id, r in rows(stack, ids).items()
        if r["status"] == "running" and str(r["lease_owner"]).endswith(f":{owner_pid}")
    ]


def report(scenario: str, seconds: float) -> None:
    print(f"RECOVERY {scenario} {seconds:.1f}")


def test_kill_9_a_worker_with_jobs_in_flight(stack: Stack) -> None:
    first = stack.start_worker()
    stack.start_worker()  # the survivor, up and idle before the crash
    ids = submit_many(stack, 12)
    held = wait_until(lambda: running_on(stack, ids, first.pid), 30, "jobs running on worker 0")
    first.signal(signal.SIGKILL)
    killed_at = time.time()
    first.popen.wait(10)
    wait_until(lambda: not running_on(stack, held, first.pid), 30, "the reaper", every=0.05)
    recovered = time.time() - killed_at
    done = wait_until(lambda: all_terminal(stack, ids), 90, "every job to end")
    report("kill-9-worker (kill -> jobs taken back from the dead worker)", recovered)
    report("kill-9-worker (kill -> every job succeeded)", time.time() - killed_at)
    assert {r["status"] for r in done.values()} == {"succeeded"}
    assert all(r["result_text"] and r["completion_tokens"] == 40 for r in done.values())
    for job_id in held:
        assert done[job_id]["attempts"] == 2, done[job_id]
    # The lease had up to LEASE_S left at the kill; the reaper looks every REAPER_S (+ slack
    # for a beat that fires late and the sweep's own time).
    assert recovered <= LEASE_S + REAPER_S + 5, recovered


def test_paused_worker_writes_nothing_after_its_lease_expired(
    stack: Stack, receiver: Receiver
) -> None:
    first = stack.start_worker()
    ids = submit_many(stack, 6, webhook_url=receiver.url("/ok"))
    held = wait_until(lambda: running_on(stack, ids, first.pid), 30, "jobs running on worker 0")
    first.signal(signal.SIGSTOP)
    try:
        stopped_at = time.time()
        stack.start_worker()
        done = wait_until(lambda: all_terminal(stack, ids), 90, "another worker to finish")
        report("sigstop-worker (pause -> every job done elsewhere)", time.time() - stopped_at)
        assert {r["status"] for r in done.values()} == {"succeeded"}
        wait_until(lambda: len(receiver.received("/ok")) >= len(ids), 30, "the webhooks")
    finally:
        first.signal(signal.SIGCONT)
    # The resumed worker finds its leases gone: it stops its copies and writes nothing.
    wait_until(
        lambda: (record := stack.worker_record(first.pid)) and record["in_flight"] == 0,
        30,
        "the resumed worker to drop its jobs",
    )
    time.sleep(2 * HEARTBEAT_S)  # anything it would still write has had time to arrive
    assert rows(stack, ids) == done
    for job_id in held:
        assert done[job_id]["attempts"] == 2
    events = stack.scalar("SELECT count(*) FROM webhook_events WHERE job_id = ANY(:ids)", ids=ids)
    assert events == len(ids)
    delivered = [json.loads(r["body"])["data"]["id"] for r in receiver.received("/ok")]
    ids_sent = {r["headers"]["webhook-id"] for r in receiver.received("/ok")}
    assert sorted(set(delivered)) == sorted(ids) and len(ids_sent) == len(ids)
    assert "result discarded" in first.log.read_text() or "lease on" in first.log.read_text()


def test_sigterm_finishes_held_jobs_and_exits_0(stack: Stack) -> None:
    first = stack.start_worker()
    ids = submit_many(stack, 20)
    held = wait_until(lambda: running_on(stack, ids, first.pid), 30, "jobs running on worker 0")
    first.signal(signal.SIGTERM)
    assert first.popen.wait(60) == 0, first.tail()
    after = rows(stack, held)
    assert {r["status"] for r in after.values()} == {"succeeded"}, after
    stack.start_worker()
    done = wait_until(lambda: all_terminal(stack, ids), 90, "the rest to finish")
    assert {r["status"] for r in done.values()} == {"succeeded"}
    assert {r["attempts"] for r in done.values()} == {1}  # nothing ran twice


def test_sigterm_hands_back_what_outlasts_the_grace(stack: Stack) -> None:
    first = stack.start_worker(shutdown_grace_s=1)
    ids = submit_many(stack, 4, params={"max_tokens": 2000})
    held = wait_until(lambda: running_on(stack, ids, first.pid), 30, "jobs running on worker 0")
    first.signal(signal.SIGTERM)
    began = time.time()
    assert first.popen.wait(30) == 0, first.tail()
    assert time.time() - began < 15
    back = rows(stack, held)
    assert {r["status"] for r in back.values()} == {"queued"}, back
    stack.start_worker(sim_time_scale=0.05)
    done = wait_until(lambda: all_terminal(stack, ids), 90, "the handed-back jobs to finish")
    assert {r["status"] for r in done.values()} == {"succeeded"}
    assert all(done[job_id]["attempts"] == 2 for job_id in held)


SUBMIT = """
import os
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import changes, jobs, transitions
from app.core.scheduling import catalog
body = JobCreate(prompt="hi", params={{"max_tokens": 4}})
job = jobs.new_job("default", body, catalog.resolve(None))
print(job.id, flush=True)
{before}
with changes.changes("api") as tx:  # the transaction jobs.submit commits
    transitions.create(tx, [job], direct={direct})
    {inside}
"""
# The process dies once the transaction has committed, before anything that follows it ran.
DIE_AFTER_COMMIT = "changes._run = lambda after, announce: os._exit(1)"


@pytest.mark.parametrize("direct", [False, True], ids=["for-the-dispatcher", "sent-by-the-api"])
def test_crash_between_commit_and_enqueue(stack: Stack, direct: bool) -> None:
    """The API's own submit transaction, in a process that dies right after the commit: a job
    left for the dispatcher is sent by it; a job the API meant to send itself (stamped sent in
    its insert, docs/scheduling.md, "Fair share") has no message, and the reaper finds its queue
    empty and
    marks it unsent, for the dispatcher."""
    stack.start_worker()
    crashed = stack.python(SUBMIT.format(direct=direct, before=DIE_AFTER_COMMIT, inside="pass"))
    assert crashed.returncode == 1, crashed.stderr
    job_id = crashed.stdout.strip()
    assert stack.scalar("SELECT status FROM jobs WHERE id = :i", i=job_id) in ("queued", "running")
    began = time.time()
    done = stack.wait_job(job_id, timeout=60)
    report(
        f"commit-enqueue-gap, {'direct' if direct else 'dispatcher'} (commit -> succeeded)",
        time.time() - began,
    )
    assert done["status"] == "succeeded" and done["attempts"] == 1


def test_duplicate_delivery_runs_once(stack: Stack) -> None:
    worker = stack.start_worker()
    # Two messages for one job, sent at once.
    sent = stack.python(SUBMIT.format(direct=True, before="", inside="tx.after.send *= 2"))
    assert sent.returncode == 0, sent.stderr
    job_id = sent.stdout.strip()
    done = stack.wait_job(job_id, timeout=60)
    assert done["status"] == "succeeded" and done["attempts"] == 1
    # The second message found the job taken: it claimed nothing (one claim, one token).
    wait_until(
        lambda: "1 of 1 job(s) no longer queued, skipped" in worker.log.read_text(),
        30,
        "the duplicate's skip",
    )
    assert stack.scalar("SELECT lease_token FROM jobs WHERE id = :i", i=job_id) == 1


def test_a_message_fetched_and_never_claimed_is_sent_again(stack: Stack) -> None:
    # No inference worker yet: the job's message waits on its lane's list.
    job_id = stack.submit({"prompt": "hello", "lane": "standard"})["id"]
    lane = redis.Redis.from_url(stack.redis_url)
    wait_until(lambda: lane.llen(queue("standard")) == 1, 10, "the job's message on its lane")
    # A consumer takes it and dies before its claim: nothing of the message is left in Redis.
    assert lane.rpop(queue("standard")) is not None
    assert lane.llen(queue("standard")) == 0
    stack.start_worker()
    began = time.time()
    done = stack.wait_job(job_id, timeout=60)
    report("fetched-never-claimed (worker up -> succeeded)", time.time() - began)
    assert done["status"] == "succeeded" and done["attempts"] == 1


def test_a_background_response_outlives_its_worker_and_its_api_killed(stack: Stack) -> None:
    """A background response (OpenAI's Responses API) is a job: with the worker running it and
    the API that accepted it both killed with -9, it is run again elsewhere, ends once, and
    its endpoint gets one response.* event, which the official SDK verifies."""
    receiver = Receiver()
    try:
        with stack.client() as c:
            endpoint = c.post(
                "/v1/webhook_endpoints",
                json={
                    "name": "responses",
                    "url": receiver.url("/ok/responses"),
                    "event_types": ["response.completed", "response.incomplete"],
                },
            ).json()
            made = c.post(
                "/v1/responses",
                json={
                    "model": "inferq-demo",
                    "input": "tell me about queues",
                    "max_output_tokens": 40,
                    "background": True,
                },
            ).json()
        assert made["status"] == "queued", made
        job_id = "job_" + made["id"].removeprefix("resp_")
        first = stack.start_worker()
        wait_until(lambda: running_on(stack, [job_id], first.pid), 30, "the response to run")
        [api] = [p for p in stack.procs if p.name == "api" and p.alive()]
        first.signal(signal.SIGKILL)
        api.signal(signal.SIGKILL)
        first.popen.wait(10)
        api.popen.wait(10)

        stack.start_worker()
        stack.start_api(dispatcher=False)  # the dispatcher lived on
        with stack.client() as c:

            def ended() -> dict[str, Any] | None:
                found = c.get(f"/v1/responses/{made['id']}").json()
                return found if found["status"] not in ("queued", "in_progress") else None

            done = wait_until(ended, 90, "the response to end")
        assert done["status"] == "incomplete" and done["output"][0]["content"][0]["text"]
        assert rows(stack, [job_id])[job_id]["attempts"] == 2
        wait_until(lambda: receiver.received("/ok/responses"), 30, "the response's event")
        time.sleep(2 * HEARTBEAT_S)  # a second event, if one were made, has had time
        [delivery] = receiver.received("/ok/responses")
        event = OpenAI(api_key="unused").webhooks.unwrap(
            delivery["body"], delivery["headers"], secret=endpoint["signing_secret"]
        )
        assert event.type == "response.incomplete" and event.data.id == made["id"]
    finally:
        receiver.close()


def test_kill_9_an_embedding_worker_mid_batch_answers_every_line_once(stack: Stack) -> None:
    """Ten thousand one-input lines, grouped into jobs of 256 inputs (docs/openai.md,
    "Batches of embeddings"), on a slowed simulated embedding model: the worker holding the
    first groups dies; its jobs run again on the other, and the output has each line once."""
    model = "emb"
    slow = {"served_model_name": model, "model_task": "embed", "sim_time_scale": 150}
    workers = [stack.start_worker(**slow), stack.start_worker(**slow)]
    lines = 10_000
    data = "".join(
        json.dumps(
            {
                "custom_id": f"doc-{i}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": model, "input": f"document {i} of the corpus"},
            }
        )
        + "\n"
        for i in range(lines)
    ).encode()
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)
    source = client.files.create(file=("corpus.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=source.id, endpoint="/v1/embeddings", completion_window="1h"
    )

    def holding() -> Any:
        # Whichever worker took the first groups (under a loaded machine the one started
        # second may be consuming first): it is the one killed. A batch that ended instead
        # says why in the timeout's message.
        got = client.batches.retrieve(batch.id)
        if got.status in ("failed", "expired", "cancelled", "completed"):
            raise AssertionError(f"the batch ended before a worker was killed: {got}")
        owner = stack.scalar(
            "SELECT lease_owner FROM jobs WHERE batch_id = :b AND status = 'running' LIMIT 1",
            b=batch.id,
        )
        return next((w for w in workers if owner and owner.endswith(f":{w.pid}")), None)

    holder = wait_until(holding, 60, "jobs of the batch running on a worker")
    holder.signal(signal.SIGKILL)
    killed_at = time.time()
    holder.popen.wait(10)

    def ended() -> Any:
        got = client.batches.retrieve(batch.id)
        return got if got.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_until(ended, 180, "the batch to end", every=0.5)
    report("kill-9-embedding-worker (kill -> batch completed)", time.time() - killed_at)
    assert done.status == "completed", done
    assert (done.request_counts.completed, done.request_counts.failed) == (lines, 0)
    answered = [
        json.loads(line)["custom_id"]
        for line in client.files.content(done.output_file_id).text.splitlines()
    ]
    assert sorted(answered) == sorted(f"doc-{i}" for i in range(lines))  # each once
    again = stack.scalar(
        "SELECT count(*) FROM jobs WHERE batch_id = :b AND attempts = 2", b=batch.id
    )
    assert again >= 1  # the dead worker's jobs ran again


def test_kill_9_a_worker_whose_own_queue_holds_jobs_runs_each_job_once(stack: Stack) -> None:
    """Prefix affinity (docs/scheduling.md): a worker killed while its own queue holds messages
    leaves them there; once its presence record lapses the dispatcher takes them back into the
    fair order and the other worker runs them, each job once."""
    cached = {"sim_prefix_cache": 8}
    first, _second = stack.start_worker(**cached), stack.start_worker(**cached)
    record = stack.worker_record(first.pid)
    assert record is not None and record["own_lanes"], record
    mine = own_queue("standard", str(record["model"]), str(record["worker_id"]))
    prompt = "Policy {}. " + "answer briefly and cite the manual " * 40
    bodies = [
        {
            "messages": [
                {"role": "system", "content": prompt.format(i % 16)},
                {"role": "user", "content": f"question {i}"},
            ],
            "params": {"max_tokens": 40},
        }
        for i in range(160)
    ]
    ids = stack.submit_many(bodies)
    client = stack.redis()
    wait_until(lambda: client.llen(mine), 30, "messages in worker 0's own queue")
    first.signal(signal.SIGKILL)
    killed_at = time.time()
    first.popen.wait(10)
    wait_until(lambda: not client.sismember(OWN_QUEUES_KEY, mine), 60, "its queue taken back")
    report(
        "kill-9-worker-with-own-queue (kill -> its own queue taken back)", time.time() - killed_at
    )
    done = wait_until(lambda: all_terminal(stack, ids), 180, "every job to end", every=0.5)
    report("kill-9-worker-with-own-queue (kill -> every job succeeded)", time.time() - killed_at)
    assert client.llen(mine) == 0
    assert {r["status"] for r in done.values()} == {"succeeded"}
    assert all(r["completion_tokens"] == 40 for r in done.values())
    # Once: a job claimed by the dead worker ran again (attempts 2); one taken back from its
    # queue was never claimed there (attempts 1); none ran a third time.
    assert all(r["attempts"] in (1, 2) for r in done.values())
    ran_again = [r for r in done.values() if r["attempts"] == 2]
    assert all(not str(r["lease_owner"]).endswith(f":{first.pid}") for r in ran_again)
