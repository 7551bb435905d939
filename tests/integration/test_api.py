"""The HTTP contract on a real uvicorn server and SQLite: validation, errors, auth, paging.

No worker runs here, so every accepted job stays queued and the counts below are exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from app.core.settings import Settings
from tests.conftest import fresh_redis_url
from tests.support import DEMO_MODEL, Stack, queue


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("api")
    stack = Stack(
        tmp,
        f"sqlite:///{tmp / 'inferq.db'}",
        fresh_redis_url(),
        require_auth="true",
        max_body_bytes=65536,
    )
    stack.migrate()
    created = stack.cli("keys", "create", "--tenant", "acme")
    assert created.returncode == 0, created.stderr
    stack.api_key = created.stdout.strip()
    stack.start_api()
    yield stack
    stack.stop()


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with stack.client() as c:
        yield c


def jobs_in_db(stack: Stack) -> int:
    return int(stack.scalar("SELECT count(*) FROM jobs"))


def assert_error(
    response: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"type", "code", "message", "param"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


GOOD = {"prompt": "Say hello", "lane": "realtime", "params": {"max_tokens": 8}}

BAD_BODIES = [
    # Neither, or both: the error names the two fields the caller may have meant.
    ({"lane": "realtime"}, "prompt|messages"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "prompt|messages"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "lane": "urgent"}, "lane"),
    ({"prompt": "x", "params": {"temperature": 2.5}}, "params.temperature"),
    ({"prompt": "x", "params": {"temperature": -0.1}}, "params.temperature"),
    ({"prompt": "x", "params": {"top_p": 0}}, "params.top_p"),
    ({"prompt": "x", "params": {"max_tokens": 0}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"max_tokens": 10**9}}, "params.max_tokens"),
    ({"prompt": "x", "params": {"seed": -1}}, "params.seed"),
    ({"prompt": "x", "params": {"stop": ["a", "b", "c", "d", "e"]}}, "params.stop"),
    ({"prompt": "x", "params": {"max_token": 5}}, "params.max_token"),
    ({"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"prompt": "x", "metadata": {"k": "v" * 513}}, "metadata"),
    ({"prompt": "x", "metadata": {"k": 5}}, "metadata.k"),
    ({"prompt": "x", "timeout_s": 0}, "timeout_s"),
    ({"prompt": "x", "webhook_url": "ftp://example.com/hook"}, "webhook_url"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "url": "x"}]}]},
        "messages[0].content",
    ),
    ({"prompt": "x", "surprise": True}, "surprise"),
    # NUL is text like any other (tests/integration/test_any_text.py); a lone surrogate is not.
    ({"prompt": "lone \ud800 surrogate"}, "prompt"),
    ({"messages": [{"role": "user", "content": "a\udfff"}]}, "messages[0].content"),
    ({"prompt": "x", "metadata": {"k": "v\ud800"}}, "metadata"),
]


@pytest.mark.parametrize(("body", "param"), BAD_BODIES)
def test_out_of_bounds_input_is_422_naming_the_field_and_leaves_no_row(
    stack: Stack, client: httpx.Client, body: dict, param: str
) -> None:
    before = jobs_in_db(stack)
    # json.dumps escapes everything to ASCII, so a lone surrogate travels as "\ud800".
    raw = json.dumps(body).encode()
    response = client.post("/v1/jobs", content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 422, param=param)
    assert error["type"] == "invalid_request_error"
    assert param.split(".")[0].split("[")[0] in error["message"]
    assert jobs_in_db(stack) == before


def test_malformed_json_is_400(stack: Stack, client: httpx.Client) -> None:
    before = jobs_in_db(stack)
    response = client.post(
        "/v1/jobs", content=b'{"prompt": "x",', headers={"Content-Type": "application/json"}
    )
    assert_error(response, 400, "invalid_json")
    assert_error(
        client.post("/v1/jobs", content=b"[1, 2]", headers={"Content-Type": "application/json"}),
        422,
    )
    assert jobs_in_db(stack) == before


def test_body_over_the_limit_is_413_before_parsing(stack: Stack, client: httpx.Client) -> None:
    before = jobs_in_db(stack)
    huge = b'{"prompt": "' + b"x" * 70_000 + b'"}'
    assert_error(
        client.post("/v1/jobs", content=huge, headers={"Content-Type": "application/json"}),
        413,
        "request_too_large",
    )

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while streaming
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 8000
        yield b'"}'

    assert_error(
        client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"}), 413
    )
    assert jobs_in_db(stack) == before


def test_accepted_job_is_committed_and_queued(stack: Stack, client: httpx.Client) -> None:
    response = client.post(
        "/v1/jobs", json={**GOOD, "metadata": {"team": "search"}, "timeout_s": 600}
    )
    assert response.status_code == 202
    job = response.json()
    assert job["id"].startswith("job_") and job["object"] == "job"
    assert job["status"] == "queued" and job["lane"] == "realtime"
    assert job["model"] == "inferq-demo" and job["metadata"] == {"team": "search"}
    assert job["result"] is None and job["error"] is None and job["attempts"] == 0
    assert job["kind"] == "generate"
    assert set(job) == {
        "id",
        "object",
        "kind",
        "status",
        "lane",
        "model",
        "created_at",
        "started_at",
        "finished_at",
        "result",
        "error",
        "attempts",
        "metadata",
        "user",
        "webhook_url",
        "batch_id",
        "timings",
    }
    assert job["timings"]["queued_at"] >= job["created_at"]
    assert {k for k, v in job["timings"].items() if v is not None} == {"queued_at"}
    row_status = stack.scalar("SELECT status FROM jobs WHERE id = :id", id=job["id"])
    assert row_status == "queued"
    # ... and its message is on the realtime lane in Redis.
    assert redis.Redis.from_url(stack.redis_url).llen(queue("realtime")) >= 1
    assert client.get(f"/v1/jobs/{job['id']}").json() == job


def test_auth_missing_wrong_and_revoked_keys(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url) as anonymous:
        error = assert_error(anonymous.post("/v1/jobs", json=GOOD), 401, "missing_api_key")
        assert error["type"] == "authentication_error"
        assert anonymous.get("/healthz").status_code == 200
        assert anonymous.get("/readyz").status_code == 200
        wrong = {"Authorization": "Bearer iq_not-a-real-key"}
        assert_error(anonymous.get("/v1/jobs", headers=wrong), 401, "invalid_api_key")
    created = stack.cli("keys", "create", "--tenant", "temp")
    key, key_id = created.stdout.strip(), created.stderr.split()[1]
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}) as c:
        assert c.get("/v1/jobs").status_code == 200
        assert stack.cli("keys", "revoke", key_id).returncode == 0
        assert_error(c.get("/v1/jobs"), 401, "invalid_api_key")


def test_tenants_do_not_see_each_other(stack: Stack, client: httpx.Client) -> None:
    job = client.post("/v1/jobs", json=GOOD).json()
    other_key = stack.cli("keys", "create", "--tenant", "globex").stdout.strip()
    with httpx.Client(
        base_url=stack.url, headers={"Authorization": f"Bearer {other_key}"}
    ) as other:
        assert_error(other.get(f"/v1/jobs/{job['id']}"), 404, "job_not_found")
        assert_error(other.post(f"/v1/jobs/{job['id']}/cancel"), 404)
        assert other.get("/v1/jobs").json()["data"] == []


def test_unknown_job_and_route(client: httpx.Client) -> None:
    assert_error(client.get("/v1/jobs/job_nope"), 404, "job_not_found")
    assert_error(client.get("/v1/nothing-here"), 404, "not_found")
    assert_error(client.delete("/v1/jobs"), 405)


def test_list_filters_and_cursor_pagination(stack: Stack) -> None:
    key = stack.cli("keys", "create", "--tenant", "pager").stdout.strip()
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}) as c:
        ids = [
            c.post("/v1/jobs", json={"prompt": f"p{i}", "lane": lane}).json()["id"]
            for i, lane in enumerate(["bulk", "standard", "bulk", "realtime", "bulk"])
        ]
        seen: list[str] = []
        after = None
        while True:
            params = {"limit": 2, **({"after": after} if after else {})}
            page = c.get("/v1/jobs", params=params).json()
            seen += [j["id"] for j in page["data"]]
            if not page["has_more"]:
                break
            after = page["data"][-1]["id"]
        assert seen == list(reversed(ids))  # newest first, each exactly once
        bulk = c.get("/v1/jobs", params={"lane": "bulk"}).json()["data"]
        assert [j["id"] for j in bulk] == [ids[4], ids[2], ids[0]]
        assert len(c.get("/v1/jobs", params={"status": "queued"}).json()["data"]) == 5
        assert c.get("/v1/jobs", params={"status": "succeeded"}).json()["data"] == []
        assert_error(c.get("/v1/jobs", params={"status": "done"}), 422, param="status")
        assert_error(c.get("/v1/jobs", params={"limit": 1000}), 422, param="limit")


def test_idempotency_key(stack: Stack, client: httpx.Client) -> None:
    headers = {"Idempotency-Key": "order-42"}
    first = client.post("/v1/jobs", json=GOOD, headers=headers)
    again = client.post("/v1/jobs", json=GOOD, headers=headers)
    assert first.status_code == 202 and again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    before = jobs_in_db(stack)
    different = client.post("/v1/jobs", json={**GOOD, "prompt": "other"}, headers=headers)
    assert_error(different, 422, "idempotency_key_reused", "Idempotency-Key")
    assert_error(
        client.post("/v1/jobs", json=GOOD, headers={"Idempotency-Key": "k" * 256}),
        422,
        param="Idempotency-Key",
    )
    assert jobs_in_db(stack) == before


def test_cancel_a_queued_job(stack: Stack, client: httpx.Client) -> None:
    job = client.post("/v1/jobs", json=GOOD).json()
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200
    body = cancelled.json()
    assert body["status"] == "cancelled" and body["finished_at"] is not None
    assert body["attempts"] == 0 and body["result"] is None
    # Cancelling again returns the terminal job unchanged.
    assert client.post(f"/v1/jobs/{job['id']}/cancel").json() == body


def test_bulk_submit_is_all_or_nothing(stack: Stack, client: httpx.Client) -> None:
    before = jobs_in_db(stack)
    bodies = [{"prompt": f"p{i}", "lane": "bulk"} for i in range(300)]
    bad = [*bodies[:7], {"prompt": "x", "params": {"max_tokens": 0}}, *bodies[7:]]
    assert_error(
        client.post("/v1/jobs/bulk", json={"jobs": bad}), 422, param="jobs[7].params.max_tokens"
    )
    wrong_model = [*bodies[:3], {"prompt": "x", "model": "nope"}]
    assert_error(client.post("/v1/jobs/bulk", json={"jobs": wrong_model}), 404, "model_not_found")
    assert_error(client.post("/v1/jobs/bulk", json={"jobs": []}), 422, param="jobs")
    assert jobs_in_db(stack) == before  # nothing was half-written

    broker = redis.Redis.from_url(stack.redis_url)
    mixed = [*bodies, {"prompt": "now", "lane": "realtime"}]
    response = client.post("/v1/jobs/bulk", json={"jobs": mixed})
    assert response.status_code == 202, response.text
    data = response.json()["data"]
    assert len(data) == 301 and len({j["id"] for j in data}) == 301
    assert all(j["status"] == "queued" for j in data)
    assert [j["lane"] for j in data] == ["bulk"] * 300 + ["realtime"]
    assert jobs_in_db(stack) == before + 301
    # A bulk request's jobs wait in the database for the dispatcher (docs/scheduling.md, "Fair
    # share"),
    # which keeps each queue only as deep as its workers need: with no worker here, the bulk
    # list holds at most one message (none while a lane above has jobs waiting).
    time.sleep(0.5)
    assert broker.llen(queue("bulk")) <= 1
    ids = [j["id"] for j in data[:300]]
    unsent = stack.scalar(
        "SELECT count(*) FROM jobs WHERE enqueued_at IS NULL AND lane = 'bulk' AND id IN ("
        + ",".join(f"'{i}'" for i in ids)
        + ")"
    )
    assert unsent >= 300 - Settings.model_fields["bulk_chunk_size"].default


def test_openai_call_with_a_key_is_admitted_on_sqlite(stack: Stack, client: httpx.Client) -> None:
    """The key lookup must not leave a transaction open: on SQLite it would hold the write
    lock for the whole call and the job could not be inserted (a 503 after 30 s)."""
    before = jobs_in_db(stack)
    # A worker of the model is live as far as the API can see (its presence record), but none
    # consumes here: the call is admitted and its job waits.
    broker = redis.Redis.from_url(stack.redis_url)
    broker.set("inferq:worker:elsewhere:1", json.dumps({"model": DEMO_MODEL}), ex=30)
    body = {"model": DEMO_MODEL, "prompt": "x", "max_tokens": 2}
    try:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=body, timeout=8)
    finally:
        broker.delete("inferq:worker:elsewhere:1")
    assert jobs_in_db(stack) == before + 1
