"""Admission control on a real API, Redis and PostgreSQL: prompt length against the model's
context, tenant limits (per-key overrides), lane backpressure, per-lane default deadlines, and
tenant isolation on every route.

The worker here consumes only the realtime lane, so standard and bulk jobs stay queued and the
queued counts are exact; the rate windows are 2 s so that recovery can be seen.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import text

from app.core.messaging.broker import RunJobs
from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.integration.test_api import assert_error
from tests.support import Stack, queue, wait_until

WINDOW_S = 4  # long enough that a loaded machine fits its requests in one window
CONTEXT = 64  # tokens; the simulated tokenizer counts words and punctuation marks
IDEMPOTENCY_TTL_S = 2
# Realtime's default deadline here: room for a short job to be claimed and run on a loaded
# machine, far below the ~10 s the 8000-token job needs.
DEADLINE_S = 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresDatabases) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("admission")
    stack = Stack(
        tmp,
        postgres.create(),
        fresh_redis_url(),
        require_auth="true",
        limit_window_s=WINDOW_S,
        lane_max_queued=json.dumps({"realtime": 100, "standard": 100, "bulk": 6}),
        lane_default_timeout_s=json.dumps({"realtime": DEADLINE_S}),
        idempotency_ttl_s=IDEMPOTENCY_TTL_S,
        sim_time_scale=0.2,
        max_model_len=CONTEXT,
    )
    try:
        stack.migrate()
        stack.start_api()
        stack.start_worker(worker_lanes="realtime")
        yield stack
    finally:
        stack.stop()


def key(stack: Stack, tenant: str, *limits: str) -> httpx.Client:
    created = stack.cli("keys", "create", "--tenant", tenant, *limits)
    assert created.returncode == 0, created.stderr
    headers = {"Authorization": f"Bearer {created.stdout.strip()}"}
    return httpx.Client(base_url=stack.url, headers=headers, timeout=30)


def job(lane: str = "standard", prompt: str = "Say hello", max_tokens: int = 8) -> dict[str, Any]:
    return {"prompt": prompt, "lane": lane, "params": {"max_tokens": max_tokens}}


def rows(stack: Stack, tenant: str) -> int:
    return int(stack.scalar("SELECT count(*) FROM jobs WHERE tenant = :t", t=tenant))


def unknown_messages(stack: Stack) -> set[str]:
    """The job ids that messages waiting in the lanes name and no row has: what a refused
    request would leave had it sent before committing. (Not a count of messages: the
    dispatcher sends earlier jobs at any moment.)"""
    client = redis.Redis.from_url(stack.redis_url)
    named = {
        job_id
        for lane in ("realtime", "standard", "bulk")
        for raw in client.lrange(queue(lane), 0, -1)
        for job_id in RunJobs.of_stored(raw).job_ids
    }
    with stack.db().connect() as conn:
        known = {row[0] for row in conn.execute(text("SELECT id FROM jobs"))}
    return named - known


def refused(response: httpx.Response, status: int, code: str) -> int:
    """Assert the refusal and return its Retry-After."""
    assert_error(response, status, code)
    retry_after = int(response.headers["Retry-After"])
    assert retry_after >= 1
    return retry_after


def test_backpressure_sheds_bulk_first_and_recovers(stack: Stack) -> None:
    # First in this module: only these jobs are queued (the worker takes only realtime).
    with key(stack, "pressure") as c:
        mine = [c.post("/v1/jobs", json=job()).json() for _ in range(6)]
        time.sleep(1.1)  # the API reads the backlog at most once a second
        before = rows(stack, "pressure")
        response = c.post("/v1/jobs", json=job(lane="bulk"))
        refused(response, 503, "lane_overloaded")
        assert response.json()["error"]["param"] == "lane"
        mixed = {"jobs": [job(), job(lane="bulk")]}
        refused(c.post("/v1/jobs/bulk", json=mixed), 503, "lane_overloaded")
        assert (rows(stack, "pressure"), unknown_messages(stack)) == (before, set())
        # Standard and realtime still have room: bulk is shed first.
        assert c.post("/v1/jobs", json=job()).status_code == 202
        assert c.post("/v1/jobs", json=job(lane="realtime")).status_code == 202
        # The backlog shrinks (here: cancelled), and bulk is taken again.
        for queued in mine:
            assert c.post(f"/v1/jobs/{queued['id']}/cancel").json()["status"] == "cancelled"
        time.sleep(1.1)
        assert c.post("/v1/jobs", json=job(lane="bulk")).status_code == 202


def test_prompt_longer_than_the_context_is_refused_before_anything_is_written(
    stack: Stack,
) -> None:
    store = redis.Redis.from_url(stack.redis_url)
    card = json.loads(store.get("inferq:model:inferq-demo") or "{}")
    assert card == {
        "model": "inferq-demo",
        "max_model_len": CONTEXT,
        "tokenizer": "words",
        "tool_parser": None,
        "task": "generate",
        "dimensions": None,
        "matryoshka": False,
        "chat_template": None,
    }
    with key(stack, "context") as c:
        fits = c.post("/v1/jobs", json=job(lane="realtime", prompt="w " * (CONTEXT - 1)))
        assert fits.status_code == 202, fits.text
        before = rows(stack, "context")
        over = job(prompt="w " * CONTEXT)
        assert_error(c.post("/v1/jobs", json=over), 422, "context_length_exceeded", "prompt")
        bulk = {"jobs": [job(), over]}
        assert_error(
            c.post("/v1/jobs/bulk", json=bulk), 422, "context_length_exceeded", "jobs.1.prompt"
        )
        chat = {"messages": [{"role": "user", "content": "w " * CONTEXT}], "lane": "bulk"}
        assert_error(c.post("/v1/jobs", json=chat), 422, "context_length_exceeded", "messages")
        assert (rows(stack, "context"), unknown_messages(stack)) == (before, set())
        # Message contents are a lower bound (the chat template adds tokens): contents that
        # fit but a rendered prompt that does not are refused by the engine, as a failed job.
        edge = {"messages": [{"role": "user", "content": "w " * (CONTEXT - 2)}]}
        edge_job = c.post("/v1/jobs", json={**edge, "lane": "realtime", "timeout_s": 30}).json()
        ended = wait_until(
            lambda: (
                (r := c.get(f"/v1/jobs/{edge_job['id']}").json())["status"] != "queued"
                and r["status"] != "running"
                and r
            ),
            30,
            "the edge job to end",
        )
        assert ended["status"] == "failed"
        assert ended["error"]["code"] == "context_length_exceeded"


def test_idempotency_under_concurrency_and_expiry(stack: Stack) -> None:
    with key(stack, "idem") as c:
        headers = {"Idempotency-Key": "same-order"}
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda _: c.post("/v1/jobs", json=job(), headers=headers), range(8))
            )
        assert sorted(r.status_code for r in answers) == [200] * 7 + [202]
        assert len({r.json()["id"] for r in answers}) == 1
        assert rows(stack, "idem") == 1
        time.sleep(IDEMPOTENCY_TTL_S + 0.5)  # the key has expired: the same key is new again
        again = c.post("/v1/jobs", json=job(), headers=headers)
        assert again.status_code == 202 and again.json()["id"] != answers[0].json()["id"]


def test_requests_per_minute_per_key_override_and_recovery(stack: Stack) -> None:
    with key(stack, "rpm", "--rpm", "3") as c:
        # Start at the beginning of a window, so the three fit in one.
        time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)
        for _ in range(3):
            assert c.post("/v1/jobs", json=job()).status_code == 202
        before = rows(stack, "rpm")
        response = c.post("/v1/jobs", json=job())
        retry_after = refused(response, 429, "requests_per_minute_exceeded")
        assert response.headers["inferq-limit"] == "requests_per_minute"
        assert retry_after <= WINDOW_S
        assert (rows(stack, "rpm"), unknown_messages(stack)) == (before, set())  # nothing written
        bulk = c.post("/v1/jobs/bulk", json={"jobs": [job(), job()]})
        refused(bulk, 429, "requests_per_minute_exceeded")
        time.sleep(retry_after)
        assert c.post("/v1/jobs", json=job()).status_code == 202
        assert rows(stack, "rpm") == before + 1


def test_tokens_per_minute(stack: Stack) -> None:
    # A 40-letter word is 1 prompt token (the worker's card: the simulated tokenizer counts
    # words), + 50 max_tokens = 51 tokens a job.
    body = job(prompt="x" * 40, max_tokens=50)
    with key(stack, "tpm", "--tpm", "100") as c:
        time.sleep(WINDOW_S - time.time() % WINDOW_S + 0.05)
        assert c.post("/v1/jobs", json=body).status_code == 202
        retry_after = refused(c.post("/v1/jobs", json=body), 429, "tokens_per_minute_exceeded")
        assert rows(stack, "tpm") == 1
        # A refused request is refunded: a smaller job still fits in this window.
        small = job(prompt="x" * 4, max_tokens=20)
        assert c.post("/v1/jobs", json=small).status_code == 202
        time.sleep(retry_after)
        assert c.post("/v1/jobs", json=body).status_code == 202


def test_max_queued_and_recovery(stack: Stack) -> None:
    with key(stack, "queue", "--max-queued", "2") as c:
        first = c.post("/v1/jobs", json=job()).json()
        assert c.post("/v1/jobs", json=job()).status_code == 202
        refused(c.post("/v1/jobs", json=job()), 429, "max_queued_exceeded")
        refused(c.post("/v1/jobs/bulk", json={"jobs": [job()]}), 429, "max_queued_exceeded")
        assert rows(stack, "queue") == 2
        assert c.post(f"/v1/jobs/{first['id']}/cancel").json()["status"] == "cancelled"
        assert c.post("/v1/jobs", json=job()).status_code == 202


def test_realtime_default_deadline(stack: Stack) -> None:
    """No timeout_s on a realtime job: the lane's default (DEADLINE_S here) applies."""
    with key(stack, "deadline") as c:
        long = c.post("/v1/jobs", json=job(lane="realtime", max_tokens=8000)).json()
        short = c.post("/v1/jobs", json=job(lane="realtime", max_tokens=4)).json()

        def ended(job_id: str) -> dict[str, Any] | None:
            row = c.get(f"/v1/jobs/{job_id}").json()
            return row if row["finished_at"] is not None else None

        done = wait_until(lambda: ended(long["id"]), 30, "the long job to end")
        assert done["status"] == "expired" and done["error"]["code"] == "deadline_exceeded"
        assert done["result"]["usage"]["completion_tokens"] < 8000  # aborted in the engine
        assert done["finished_at"] - done["created_at"] <= DEADLINE_S + 4
        assert wait_until(lambda: ended(short["id"]), 30, "the short job")["status"] == "succeeded"


def test_tenant_isolation_on_every_route(stack: Stack) -> None:
    with key(stack, "alice") as alice, key(stack, "bob") as bob:
        mine = alice.post("/v1/jobs", json=job()).json()
        upload = alice.post(
            "/v1/files",
            files={"file": ("in.jsonl", io.BytesIO(b"{}\n"))},
            data={"purpose": "batch"},
        ).json()
        batch_body = {
            "input_file_id": upload["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        batch = alice.post("/v1/batches", json=batch_body).json()
        hidden = [
            ("GET", f"/v1/jobs/{mine['id']}", "job_not_found"),
            ("POST", f"/v1/jobs/{mine['id']}/cancel", "job_not_found"),
            ("GET", f"/v1/jobs/{mine['id']}/webhook-deliveries", "job_not_found"),
            ("POST", f"/v1/jobs/{mine['id']}/webhook-deliveries/redeliver", "job_not_found"),
            ("GET", f"/v1/files/{upload['id']}", "file_not_found"),
            ("GET", f"/v1/files/{upload['id']}/content", "file_not_found"),
            ("DELETE", f"/v1/files/{upload['id']}", "file_not_found"),
            ("GET", f"/v1/batches/{batch['id']}", "batch_not_found"),
            ("POST", f"/v1/batches/{batch['id']}/cancel", "batch_not_found"),
        ]
        for method, path, code in hidden:
            assert_error(bob.request(method, path), 404, code)
        assert_error(bob.post("/v1/batches", json=batch_body), 404, "file_not_found")
        for listing in ("/v1/jobs", "/v1/files", "/v1/batches"):
            assert bob.get(listing).json()["data"] == []
            assert alice.get(listing).json()["data"]
        assert alice.get(f"/v1/files/{upload['id']}/content").content == b"{}\n"
