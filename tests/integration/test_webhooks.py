"""Webhooks end to end: real API, inference worker and ops worker (with beat), and a receiver
on loopback that verifies every request with the ``standardwebhooks`` library on its own."""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from standardwebhooks import Webhook

from app.core.settings import Settings
from tests.conftest import PostgresDatabases, backend_stack_for, fresh_redis_url
from tests.support import Receiver, Stack, running_stack, wait_until
from workers.ops import delivery


def _secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


SECRET = _secret()
OLD_SECRET = _secret()
CAP = 64


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres: PostgresDatabases,
) -> Iterator[Stack]:
    with backend_stack_for(
        request,
        tmp_path_factory,
        postgres,
        "webhooks",
        ops=True,
        sim_time_scale=0.2,
        max_model_len=2000,
        webhook_allow_private="true",
        webhook_secret=SECRET,
        webhook_secret_previous=OLD_SECRET,
        webhook_retry_schedule="0.3,0.3",
        webhook_sweep_interval_s=0.2,
        # Long enough that an attempt under way is still under way while a loaded machine
        # answers the redeliver request.
        webhook_timeout_s=5,
        webhook_response_max_bytes=CAP,
    ) as s:
        yield s


def _submit(stack: Stack, url: str, **body: Any) -> dict[str, Any]:
    return stack.submit({"prompt": "hello there", "lane": "realtime", "webhook_url": url, **body})


def _deliveries(stack: Stack, job_id: str) -> dict[str, Any]:
    with stack.client() as c:
        r = c.get(f"/v1/jobs/{job_id}/webhook-deliveries")
        assert r.status_code == 200, r.text
        return dict(r.json())


def _settled(stack: Stack, job_id: str, attempts: int, timeout: float = 30) -> dict[str, Any]:
    """The deliveries once ``attempts`` were recorded and the event is no longer pending."""

    def check() -> dict[str, Any] | None:
        found = _deliveries(stack, job_id)
        event = found["event"]
        if event and event["status"] != "pending" and len(found["data"]) >= attempts:
            return found
        return None

    return dict(wait_until(check, timeout, f"webhook deliveries of {job_id}"))


def _verify(request: dict[str, Any], secret: str) -> dict[str, Any]:
    return dict(Webhook(secret).verify(request["body"], request["headers"]))


def test_finished_job_is_delivered_signed_and_recorded(stack: Stack, receiver: Receiver) -> None:
    path = f"/ok/{secrets.token_hex(4)}"
    job = _submit(stack, receiver.url(path), metadata={"order": "42"})
    done = stack.wait_job(job["id"])
    assert done["status"] == "succeeded"
    found = _settled(stack, job["id"], 1)
    (request,) = receiver.received(path)

    payload = _verify(request, SECRET)
    assert payload["type"] == "job.succeeded"
    assert payload["data"] == done  # the Job object, as GET /v1/jobs/{id} shows it
    assert payload["timestamp"].endswith("Z")
    # Rotation: the request carries a signature by the old secret as well.
    assert _verify(request, OLD_SECRET) == payload
    assert len(request["headers"]["webhook-signature"].split(" ")) == 2
    assert request["headers"]["webhook-id"] == found["event"]["id"]
    # The connection went to the checked address; the Host header kept the URL's host.
    assert request["headers"]["host"] == f"localhost:{receiver.port}"

    event, (attempt,) = found["event"], found["data"]
    assert event["status"] == "delivered" and event["type"] == "job.succeeded"
    assert attempt["ok"] and attempt["status_code"] == 200 and attempt["kind"] == "scheduled"
    assert attempt["response_body"] == "thanks" and attempt["latency_ms"] > 0
    assert attempt["address"] in ("127.0.0.1", "::1")


def test_failed_attempts_are_retried_with_the_same_webhook_id(
    stack: Stack, receiver: Receiver
) -> None:
    path = f"/fail/2/{secrets.token_hex(4)}"
    job = _submit(stack, receiver.url(path))
    found = _settled(stack, job["id"], 3)
    assert [a["status_code"] for a in found["data"]] == [500, 500, 200]
    assert [a["ok"] for a in found["data"]] == [False, False, True]
    assert found["data"][0]["error"] == "HTTP 500"
    assert found["event"]["status"] == "delivered" and found["event"]["attempts"] == 3
    requests = receiver.received(path)
    assert len(requests) == 3
    assert len({r["headers"]["webhook-id"] for r in requests}) == 1
    assert len({r["body"] for r in requests}) == 1  # every retry sends the same bytes
    for r in requests:
        _verify(r, SECRET)


def test_last_attempt_fails_the_event_and_redeliver_sends_it_again(
    stack: Stack, receiver: Receiver
) -> None:
    path = f"/fail/3/{secrets.token_hex(4)}"
    job = _submit(stack, receiver.url(path))
    found = _settled(stack, job["id"], 3)
    assert found["event"]["status"] == "failed"  # 1 attempt + 2 retries, all refused
    assert [a["ok"] for a in found["data"]] == [False, False, False]

    with stack.client() as c:
        r = c.post(f"/v1/jobs/{job['id']}/webhook-deliveries/redeliver")
    assert r.status_code == 202, r.text
    assert r.json()["id"] == found["event"]["id"]
    again = _settled(stack, job["id"], 4)
    assert again["event"]["status"] == "delivered"
    assert again["data"][-1]["kind"] == "redelivery" and again["data"][-1]["ok"]
    ids = {req["headers"]["webhook-id"] for req in receiver.received(path)}
    assert ids == {found["event"]["id"]}


def test_redeliver_waits_for_an_attempt_under_way(stack: Stack, receiver: Receiver) -> None:
    path = f"/slow/4/{secrets.token_hex(4)}"
    job = _submit(stack, receiver.url(path))
    wait_until(lambda: receiver.received(path), 30, "the first attempt to arrive")
    with stack.client() as c:
        r = c.post(f"/v1/jobs/{job['id']}/webhook-deliveries/redeliver")
        assert r.status_code == 409 and r.json()["error"]["code"] == "delivery_in_progress"
        found = _settled(stack, job["id"], 1)
        assert found["event"]["status"] == "delivered"
        assert c.post(f"/v1/jobs/{job['id']}/webhook-deliveries/redeliver").status_code == 202
    again = _settled(stack, job["id"], 2)
    assert [a["kind"] for a in again["data"]] == ["scheduled", "redelivery"]
    assert len(receiver.received(path)) == 2


def test_redirects_slow_answers_and_large_bodies(stack: Stack, receiver: Receiver) -> None:
    tag = secrets.token_hex(4)
    redirect = _submit(stack, receiver.url(f"/redirect/{tag}"))
    slow = _submit(stack, receiver.url(f"/slow/6/{tag}"))
    big = _submit(stack, receiver.url(f"/big/{tag}"))

    found = _settled(stack, redirect["id"], 3)
    assert [a["status_code"] for a in found["data"]] == [302, 302, 302]
    assert "redirects are not followed" in found["data"][0]["error"]
    assert found["event"]["status"] == "failed"
    assert receiver.received("/ok") == []  # the Location was never requested

    found = _settled(stack, slow["id"], 3, timeout=60)
    assert {a["error"] for a in found["data"]} == {"timeout"}
    assert not any(a["ok"] for a in found["data"])

    found = _settled(stack, big["id"], 1)
    (attempt,) = found["data"]
    assert attempt["ok"] and len(attempt["response_body"]) == CAP


def test_every_terminal_status_has_its_event(stack: Stack, receiver: Receiver) -> None:
    tag = secrets.token_hex(4)
    # Contents the API lets through (1998 of the 2000 tokens) that the chat template pushes past
    # the context: the engine fails the job.
    too_long = _submit(
        stack,
        receiver.url(f"/ok/failed/{tag}"),
        prompt=None,
        messages=[{"role": "user", "content": "word " * 1998}],
    )
    overdue = _submit(
        stack,
        receiver.url(f"/ok/expired/{tag}"),
        params={"max_tokens": 8000},
        timeout_s=0.5,
    )
    assert stack.wait_job(too_long["id"])["status"] == "failed"
    assert stack.wait_job(overdue["id"])["status"] == "expired"
    for job_id, kind in ((too_long["id"], "failed"), (overdue["id"], "expired")):
        found = _settled(stack, job_id, 1)
        (request,) = receiver.received(f"/ok/{kind}/{tag}")
        payload = _verify(request, SECRET)
        assert payload["type"] == f"job.{kind}" == found["event"]["type"]
        assert payload["data"]["id"] == job_id and payload["data"]["status"] == kind


def test_no_webhook_url_means_no_event(stack: Stack) -> None:
    job = stack.submit({"prompt": "quiet", "lane": "realtime"})
    stack.wait_job(job["id"])
    assert _deliveries(stack, job["id"]) == {"object": "list", "event": None, "data": []}
    with stack.client() as c:
        r = c.post(f"/v1/jobs/{job['id']}/webhook-deliveries/redeliver")
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_webhook"


def test_cancelled_queued_job_sends_job_cancelled(tmp_path: Path, receiver: Receiver) -> None:
    # No worker consumes bulk here, so the job is still queued when it is cancelled.
    with running_stack(
        tmp_path,
        f"sqlite:///{tmp_path / 'inferq.db'}",
        fresh_redis_url(),
        workers=0,
        ops=True,
        webhook_allow_private="true",
        webhook_secret=SECRET,
        webhook_sweep_interval_s=0.2,
    ) as stack:
        path = f"/ok/cancelled/{secrets.token_hex(4)}"
        job = stack.submit(
            {"prompt": "never runs", "lane": "bulk", "webhook_url": receiver.url(path)}
        )
        with stack.client() as c:
            assert c.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
        found = _settled(stack, job["id"], 1)
        assert found["event"]["type"] == "job.cancelled"
        (request,) = receiver.received(path)
        assert _verify(request, SECRET)["data"]["status"] == "cancelled"


PRIVATE_URLS = [
    "http://127.0.0.1:9/hook",
    "http://localhost:9/hook",
    "http://10.1.2.3/hook",
    "http://169.254.169.254/latest/meta-data",
    "http://100.64.0.1/hook",
    "http://[::1]:9/hook",
    "http://[fd00:ec2::254]/hook",
    "http://[::ffff:127.0.0.1]/hook",
    "ftp://example.com/hook",
]


def test_private_targets_are_refused_at_submit(tmp_path: Path) -> None:
    with running_stack(
        tmp_path, f"sqlite:///{tmp_path / 'inferq.db'}", fresh_redis_url(), workers=0
    ) as stack:
        with stack.client() as c:
            for url in PRIVATE_URLS:
                r = c.post("/v1/jobs", json={"prompt": "x", "webhook_url": url})
                assert r.status_code == 422, (url, r.text)
                assert r.json()["error"]["param"] == "webhook_url", url
            bodies = [{"prompt": "a"}, {"prompt": "b", "webhook_url": PRIVATE_URLS[3]}]
            r = c.post("/v1/jobs/bulk", json={"jobs": bodies})
            assert r.status_code == 422 and r.json()["error"]["param"] == "jobs[1].webhook_url"
        assert stack.scalar("SELECT count(*) FROM jobs") == 0


def test_delivery_checks_the_address_again(receiver: Receiver, tmp_path: Path) -> None:
    """A URL accepted earlier (setting on at submit) is refused when the ops worker's is off."""
    settings = Settings(data_dir=tmp_path, webhook_secret=SECRET, webhook_allow_private=False)
    path = f"/ok/refused/{secrets.token_hex(4)}"
    body = json.dumps({"x": 1})
    sent = delivery.send(receiver.url(path), "msg_test", body, settings, [SECRET])
    assert not sent.ok and sent.error is not None and sent.error.startswith("refused:")
    assert receiver.received(path) == []
