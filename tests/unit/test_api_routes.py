"""The API's routes called in process (``httpx.ASGITransport``) on a SQLite file and a real Redis:
what each answers, what it wrote, and what it sent after the commit; bad input answered with the
right status and nothing written."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from sqlalchemy import text

from app.core import db
from app.core.db import session_scope
from app.core.messaging import broker, clients, names
from app.core.models import JobStatus
from app.core.scheduling import limits
from app.core.settings import Settings, get_settings
from app.core.tenants.keys import create_key
from tests.unit.inprocess import call

JOB = {"prompt": "Hello", "params": {"max_tokens": 4}}


def count(table: str = "jobs") -> int:
    with db.transaction() as connection:
        return int(connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def stored(job_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": job_id}).one()


def key(tenant: str, **limits: int) -> dict[str, str]:
    with session_scope() as session:
        _, plaintext = create_key(session, tenant, **limits)
    return {"Authorization": f"Bearer {plaintext}"}


@pytest.fixture
def keyed(core: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The same settings with keys required, as a deployment runs."""
    monkeypatch.setenv("INFERQ_REQUIRE_AUTH", "true")
    get_settings.cache_clear()
    return get_settings()


def queue(settings: Settings, lane: str = "standard") -> str:
    return names.queue_of(lane, settings.model_name)


def test_a_job_alone_is_committed_and_sent_by_the_api(core: Settings) -> None:
    answer = call("POST", "/v1/jobs", json={**JOB, "metadata": {"k": "v"}})
    assert answer.status_code == 202, answer.text
    job = answer.json()
    assert (job["status"], job["lane"], job["model"]) == ("queued", "standard", core.model_name)
    assert job["attempts"] == 0 and job["result"] is None and job["metadata"] == {"k": "v"}
    assert job["timings"]["queued_at"] == pytest.approx(stored(job["id"]).created_at, abs=1e-3)
    [payload] = clients.redis_client().lrange(queue(core), 0, -1)
    assert broker.RunJobs.of_stored(payload) == broker.RunJobs([job["id"]], "standard")
    assert stored(job["id"]).enqueued_at is not None


def test_a_job_behind_others_waits_for_the_dispatcher(core: Settings) -> None:
    clients.redis_client().lpush(queue(core, "bulk"), b"a message ahead")
    job = call("POST", "/v1/jobs", json={**JOB, "lane": "bulk"}).json()
    assert stored(job["id"]).enqueued_at is None
    assert clients.redis_client().lrange(names.WAKE_KEY, 0, -1) == [queue(core, "bulk").encode()]


def test_an_idempotency_key_replays_the_same_request_and_refuses_another(core: Settings) -> None:
    first = call("POST", "/v1/jobs", json=JOB, headers={"Idempotency-Key": "k1"})
    again = call("POST", "/v1/jobs", json=JOB, headers={"Idempotency-Key": "k1"})
    assert (first.status_code, again.status_code) == (202, 200)
    assert again.json()["id"] == first.json()["id"]
    other = call(
        "POST", "/v1/jobs", json={**JOB, "prompt": "Bye"}, headers={"Idempotency-Key": "k1"}
    )
    assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_key_reused"
    assert count() == 1


def test_a_bulk_request_commits_all_its_jobs_or_none(core: Settings) -> None:
    answer = call("POST", "/v1/jobs/bulk", json={"jobs": [JOB, {**JOB, "lane": "bulk"}]})
    assert answer.status_code == 202, answer.text
    assert [j["lane"] for j in answer.json()["data"]] == ["standard", "bulk"]
    bad = [JOB, {**JOB, "webhook_url": "http://127.0.0.1/hook"}]  # loopback is refused
    refused = call("POST", "/v1/jobs/bulk", json={"jobs": bad})
    assert refused.status_code == 422
    assert refused.json()["error"]["param"] == "jobs[1].webhook_url"
    assert count() == 2


def test_reading_listing_and_paging_a_tenants_jobs(keyed: Settings) -> None:
    mine, theirs = key("a"), key("b")
    ids = [call("POST", "/v1/jobs", json=JOB, headers=mine).json()["id"] for _ in range(3)]
    other = call("POST", "/v1/jobs", json=JOB, headers=theirs).json()["id"]
    assert call("GET", f"/v1/jobs/{ids[0]}", headers=mine).json()["id"] == ids[0]
    hidden = call("GET", f"/v1/jobs/{other}", headers=mine)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "job_not_found"
    page = call("GET", "/v1/jobs?limit=2", headers=mine).json()
    assert [j["id"] for j in page["data"]] == ids[::-1][:2] and page["has_more"]
    rest = call("GET", f"/v1/jobs?limit=2&after={ids[1]}", headers=mine).json()
    assert [j["id"] for j in rest["data"]] == [ids[0]] and not rest["has_more"]


def test_without_a_valid_key_nothing_is_served(keyed: Settings) -> None:
    assert call("POST", "/v1/jobs", json=JOB).status_code == 401
    wrong = call("GET", "/v1/jobs", headers={"Authorization": "Bearer iq_nope"})
    assert wrong.status_code == 401 and wrong.headers["WWW-Authenticate"] == "Bearer"
    assert count() == 0


def test_a_queued_job_cancelled_never_runs_and_a_finished_one_stays(core: Settings) -> None:
    job_id = call("POST", "/v1/jobs", json=JOB).json()["id"]
    cancelled = call("POST", f"/v1/jobs/{job_id}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert stored(job_id).status == JobStatus.CANCELLED
    again = call("POST", f"/v1/jobs/{job_id}/cancel")
    assert again.json()["status"] == "cancelled" and again.json()["finished_at"]
    redeliver = call("POST", f"/v1/jobs/{job_id}/webhook-deliveries/redeliver")
    assert redeliver.status_code == 409 and redeliver.json()["error"]["code"] == "no_webhook"


def test_a_tenant_over_its_rate_is_refused_with_when_to_retry(keyed: Settings) -> None:
    headers = key("a", requests_per_minute=2)
    answers = [call("POST", "/v1/jobs", json=JOB, headers=headers) for _ in range(3)]
    assert [a.status_code for a in answers] == [202, 202, 429]
    refused = answers[-1]
    assert refused.json()["error"]["code"] == "requests_per_minute_exceeded"
    assert refused.headers["inferq-limit"] == "requests_per_minute"
    assert int(refused.headers["Retry-After"]) >= 1
    assert count() == 2


def test_a_full_lane_sheds_new_jobs(core: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERQ_LANE_MAX_QUEUED", '{"bulk": 2}')
    get_settings.cache_clear()
    clients.reset()
    answers = [call("POST", "/v1/jobs", json={**JOB, "lane": "bulk"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [202, 202]
    time.sleep(limits.BACKLOG_CACHE_S)  # the lanes' depths are read again
    full = call("POST", "/v1/jobs", json={**JOB, "lane": "bulk"})
    assert full.status_code == 503 and full.json()["error"]["code"] == "lane_overloaded"
    assert count() == 2


def test_redis_down_refuses_before_anything_is_written(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_REDIS_URL", "redis://127.0.0.1:1/0")  # nothing listens there
    monkeypatch.setenv("INFERQ_DEPENDENCY_TIMEOUT_S", "0.2")
    get_settings.cache_clear()
    clients.reset()
    answer = call("POST", "/v1/jobs", json=JOB)
    assert answer.status_code == 503 and "Retry-After" in answer.headers
    assert count() == 0
    ready = call("GET", "/readyz")
    assert ready.status_code == 503 and ready.json()["error"]["code"] == "not_ready"
    assert "redis" in ready.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({**JOB, "max_token": 3}, 422, "extra_forbidden", "max_token"),
        ({"params": {"max_tokens": 4}}, 422, None, None),  # neither prompt nor messages
        ({**JOB, "lane": "fast"}, 422, None, "lane"),
        ({**JOB, "model": "nobody-serves-this"}, 404, "model_not_found", "model"),
        ({**JOB, "params": {"max_tokens": 10**9}}, 422, None, "params.max_tokens"),
    ],
)
def test_bad_input_is_answered_and_nothing_written(
    core: Settings, body: dict[str, Any], status: int, code: str | None, param: str | None
) -> None:
    answer = call("POST", "/v1/jobs", json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    assert count() == 0


def test_a_malformed_or_oversized_body_is_refused_before_parsing(core: Settings) -> None:
    broken = call(
        "POST", "/v1/jobs", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"
    huge = {**JOB, "prompt": "x" * (core.max_body_bytes + 1)}
    too_large = call("POST", "/v1/jobs", content=json.dumps(huge).encode())
    assert too_large.status_code == 413
    assert count() == 0


def new_batch(file_id: str, window: str) -> Any:
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    return call("POST", "/v1/batches", json={**body, "completion_window": window})


def test_a_batch_is_created_validating_and_its_start_is_sent(core: Settings) -> None:
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": core.model_name, "messages": [{"role": "user", "content": "hi"}]},
    }
    upload = call(
        "POST",
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")},
    )
    assert upload.status_code == 200, upload.text
    created = new_batch(upload.json()["id"], "24h")
    assert created.status_code == 200, created.text
    batch = created.json()
    assert batch["status"] == "validating"
    [message] = clients.redis_client().lrange(names.MAINTENANCE_QUEUE, 0, -1)
    envelope = json.loads(message)
    assert envelope["headers"]["task"] == names.START_BATCH_TASK
    assert batch["id"] in envelope["headers"]["argsrepr"]
    cancelled = call("POST", f"/v1/batches/{batch['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelling"
    again = call("POST", f"/v1/batches/{batch['id']}/cancel")
    assert again.json()["status"] == "cancelling"
    bad_window = new_batch(upload.json()["id"], "forever")
    assert bad_window.status_code == 422
    assert count("batches") == 1


def test_health_and_readiness(core: Settings) -> None:
    assert call("GET", "/healthz").status_code == 200
    ready = call("GET", "/readyz")
    assert ready.status_code == 200 and ready.json()["redis"] == "ok"


def test_files_and_batches_can_be_turned_off(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    upload = {"files": {"file": ("in.jsonl", b"{}\n")}, "data": {"purpose": "batch"}}
    assert call("POST", "/v1/files", **upload).status_code == 200
    monkeypatch.setenv("INFERQ_BATCHES_ENABLED", "false")
    get_settings.cache_clear()
    for path, body in (
        ("/v1/files", upload),
        ("/v1/batches", {"json": {"input_file_id": "file_x"}}),
    ):
        off = call("POST", path, **body)
        assert off.status_code == 404 and off.json()["error"]["code"] == "batches_disabled"


def test_head_is_answered_as_get_without_a_body(core: Settings) -> None:
    for path in ("/healthz", "/readyz", "/console", "/console/login", "/docs"):
        got, head = call("GET", path), call("HEAD", path)
        assert head.status_code == got.status_code != 405, path
        assert head.content == b"" and head.headers.get("content-type") == got.headers.get(
            "content-type"
        )
    # A file's bytes are not read from the store only to be dropped.
    assert call("HEAD", "/v1/files/file_x/content").status_code == 405
