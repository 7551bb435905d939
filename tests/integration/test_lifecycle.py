"""A job's whole path through real processes: API -> DB -> Redis lane -> worker -> DB -> poll.

Runs on SQLite and on PostgreSQL, with the SIMULATED engine in a real `inferq worker`.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.conftest import PostgresDatabases, database_url_for
from tests.support import REPO, Stack, queue, running_stack, wait_until

LANES = ["realtime", "standard", "bulk"]


@pytest.mark.parametrize("lane", LANES)
def test_job_in_each_lane_succeeds_with_text_and_usage(backend_stack: Stack, lane: str) -> None:
    job = backend_stack.submit(
        {
            "prompt": "Write a haiku about queues",
            "lane": lane,
            "params": {"max_tokens": 12, "seed": 7},
        }
    )
    assert job["status"] == "queued"
    done = backend_stack.wait_job(job["id"])
    assert done["status"] == "succeeded", done
    result = done["result"]
    assert result["text"].strip()
    assert result["finish_reason"] == "length"
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert done["attempts"] == 1 and done["error"] is None and done["lane"] == lane
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    lease = backend_stack.scalar("SELECT lease_token FROM jobs WHERE id = :id", id=job["id"])
    assert lease == 1


def test_chat_messages_job(backend_stack: Stack) -> None:
    job = backend_stack.submit(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi there"},
            ],
            "params": {"max_tokens": 5},
        }
    )
    done = backend_stack.wait_job(job["id"])
    assert done["status"] == "succeeded"
    assert done["result"]["usage"]["completion_tokens"] == 5
    assert done["result"]["usage"]["prompt_tokens"] > 4  # the rendered chat, not just "Hi there"


def test_cancel_running_job_keeps_text_so_far(backend_stack: Stack) -> None:
    job = backend_stack.submit(
        {"prompt": "go on forever", "lane": "standard", "params": {"max_tokens": 8000}}
    )
    backend_stack.wait_job(job["id"], statuses={"running"})
    time.sleep(0.3)
    with backend_stack.client() as c:
        answer = c.post(f"/v1/jobs/{job['id']}/cancel").json()
    done = backend_stack.wait_job(job["id"], timeout=10)
    assert done["status"] == "cancelled"
    assert answer["status"] == "cancelled"  # the cancel call waited for the abort
    assert done["result"]["finish_reason"] == "cancelled"
    assert 0 < done["result"]["usage"]["completion_tokens"] < 8000
    assert done["result"]["text"]


def test_timeout_expires_a_running_job(backend_stack: Stack) -> None:
    # A deadline a loaded machine still claims the job within, so it expires while running.
    job = backend_stack.submit({"prompt": "long", "params": {"max_tokens": 8000}, "timeout_s": 3})
    done = backend_stack.wait_job(job["id"], timeout=20)
    assert done["status"] == "expired"
    assert done["error"]["code"] == "deadline_exceeded"
    assert done["finished_at"] - done["created_at"] <= 6
    assert 0 < done["result"]["usage"]["completion_tokens"] < 8000


def test_cancelled_while_queued_never_runs(
    tmp_path: Path, redis_url: str, postgres: PostgresDatabases
) -> None:
    stack = Stack(tmp_path, database_url_for("sqlite", tmp_path, postgres), redis_url)
    try:
        stack.migrate()
        stack.start_api()
        kept = stack.submit({"prompt": "keep me", "params": {"max_tokens": 3}})
        dropped = stack.submit({"prompt": "drop me", "params": {"max_tokens": 3}})
        with stack.client() as c:
            assert c.post(f"/v1/jobs/{dropped['id']}/cancel").json()["status"] == "cancelled"
        stack.start_worker()
        assert stack.wait_job(kept["id"])["status"] == "succeeded"
        import redis

        # The cancelled job's message is consumed too (the list empties) ...
        lane = redis.Redis.from_url(redis_url)
        wait_until(lambda: lane.llen(queue("standard")) == 0, 10, "the lane to be empty")
        time.sleep(0.5)
        # ... and the job never ran.
        with stack.client() as c:
            final = c.get(f"/v1/jobs/{dropped['id']}").json()
        assert final["status"] == "cancelled" and final["attempts"] == 0
        assert final["started_at"] is None and final["result"] is None
    finally:
        stack.stop()


def test_lanes_are_consumed_in_strict_priority_order(tmp_path: Path, redis_url: str) -> None:
    """A one-slot worker started on a full backlog takes realtime, then standard, then bulk."""
    stack = Stack(tmp_path, f"sqlite:///{tmp_path / 'p.db'}", redis_url, worker_concurrency=1)
    try:
        stack.migrate()
        stack.start_api()
        submitted = []
        for lane in ["bulk", "standard", "realtime"]:
            for i in range(4):
                job = stack.submit(
                    {"prompt": f"{lane} {i}", "lane": lane, "params": {"max_tokens": 2}}
                )
                submitted.append((lane, job["id"]))
        # The first bulk job went out alone while nothing else waited (the API's direct path).
        # With realtime and standard jobs waiting, and no worker holding slots for bulk, the
        # dispatcher takes its message back: the bulk list is empty and its jobs are unsent.
        broker = redis.Redis.from_url(redis_url)
        wait_until(
            lambda: (
                broker.llen(queue("bulk")) == 0
                and stack.scalar(
                    "SELECT count(*) FROM jobs WHERE lane = 'bulk' AND enqueued_at IS NULL"
                )
                == 4
            ),
            10,
            "the bulk message taken back",
        )
        stack.start_worker()
        for _, job_id in submitted:
            stack.wait_job(job_id)
        rows = []
        with stack.db().connect() as conn:
            from sqlalchemy import text

            rows = conn.execute(text("SELECT lane FROM jobs ORDER BY started_at, id")).all()
        assert [r[0] for r in rows] == ["realtime"] * 4 + ["standard"] * 4 + ["bulk"] * 4
    finally:
        stack.stop()


def test_two_workers_share_one_queue_and_record_each_result_once(
    tmp_path: Path, redis_url: str, postgres: PostgresDatabases
) -> None:
    url = database_url_for("postgres", tmp_path, postgres)
    # One message per job, all sent at once, so the engines have more than one to batch.
    with running_stack(
        tmp_path, url, redis_url, workers=2, sim_time_scale=0.5, bulk_chunk_size=1
    ) as stack:
        ids = stack.submit_many(
            [
                {"prompt": f"job {i}", "lane": "bulk", "params": {"max_tokens": 20}}
                for i in range(40)
            ]
        )
        for job_id in ids:
            assert stack.wait_job(job_id)["status"] == "succeeded"
        owners = stack.scalar("SELECT count(DISTINCT lease_owner) FROM jobs")
        assert owners == 2
        assert stack.scalar("SELECT max(attempts) FROM jobs") == 1
        # Each worker's one engine ran jobs from many task threads in the same step.
        for proc in stack.procs:
            if proc.name.startswith("worker"):
                # The presence record is rewritten every second: wait for one written after
                # the engine ran.
                record = wait_until(
                    lambda p=proc: (
                        (r := stack.worker_record(p.pid)) and r["engine_stats"]["steps"] and r
                    ),
                    10,
                    "a record of the engine's steps",
                )
                assert record["engine_stats"]["max_batch"] > 1, json.dumps(record)


def _readme_session() -> list[dict[str, Any]]:
    """The JSON samples of the README's "A session with curl", in order."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## A session with curl") :]
    section = section[: section.index("\n## ")]
    return [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]


def _shape(value: Any) -> Any:
    """The keys of every object in ``value``, nested; values only say object or not."""
    if isinstance(value, dict):
        return {key: _shape(item) for key, item in value.items()}
    return "value"


def test_the_readmes_sample_job_is_what_the_api_answers(backend_stack: Stack) -> None:
    """The README's submit and read samples have every field the API answers, and no other:
    they cannot drift from the Job object unnoticed."""
    queued_sample, finished_sample = _readme_session()
    body = {"prompt": "def fibonacci(n):", "lane": "realtime", "params": {"max_tokens": 24}}
    job = backend_stack.submit(body)
    assert _shape(job) == _shape(queued_sample)
    done = backend_stack.wait_job(job["id"])
    assert done["status"] == finished_sample["status"] == "succeeded"
    assert _shape(done) == _shape(finished_sample)
