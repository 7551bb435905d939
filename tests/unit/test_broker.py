"""The messages inferq pushes onto its queues' lists are Celery's own, and task-sent events go
out only while Flower says it watches (app/core/messaging/broker.py)."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest

from app.core.messaging import broker, clients
from app.core.messaging.names import RUN_JOBS_TASK
from app.core.settings import Settings
from workers import celery_app

# Fields that differ between any two messages (ids), or between two senders (the process id).
PER_MESSAGE = {"id", "root_id", "correlation_id", "delivery_tag", "reply_to"}


def _shape(value: Any, key: str = "") -> Any:
    """``value`` with every per-message id replaced by its type."""
    if key in PER_MESSAGE:
        return type(value).__name__
    if isinstance(value, dict):
        return {k: _shape(v, k) for k, v in value.items()}
    return value


def _stored(queue: str) -> list[dict[str, Any]]:
    payloads: list[bytes] = clients.redis_client().lrange(queue, 0, -1)  # type: ignore[assignment]
    return [json.loads(payload) for payload in payloads]


def test_a_run_jobs_message_is_what_celerys_send_task_writes(core: Settings) -> None:
    args = [["job_a", "job_b"], "bulk"]
    app = broker.celery_app("celery-itself", core)
    # Celery's own send, with the options inferq's producer used to give it (Flower's args).
    app.send_task(RUN_JOBS_TASK, args=args, queue="bulk", argsrepr=repr(args), kwargsrepr="{}")
    [theirs] = _stored("bulk")
    clients.redis_client().delete("bulk")
    assert broker.send_jobs([("bulk", ["job_a", "job_b"])]) == []
    [ours] = _stored("bulk")
    # send_task copies its extra options into the properties as well: nothing reads them there.
    for extra in ("argsrepr", "kwargsrepr"):
        theirs["properties"].pop(extra)
    theirs["body"] = json.loads(base64.b64decode(theirs["body"]))
    ours["body"] = json.loads(base64.b64decode(ours["body"]))
    assert _shape(ours) == _shape(theirs)
    assert (
        ours["headers"]["id"] == ours["headers"]["root_id"] == ours["properties"]["correlation_id"]
    )
    # Read back as the dispatcher reads a list entry.
    raw = clients.redis_client().lrange("bulk", 0, -1)[0]  # type: ignore[index]
    assert broker.RunJobs.of_stored(raw) == broker.RunJobs(["job_a", "job_b"], "bulk")


def test_webhook_and_batch_messages_go_to_their_queues(core: Settings) -> None:
    assert broker.send_webhooks(["evt_1", "evt_2"]) == []
    assert broker.send_start_batch("batch_1")
    hooks = _stored("webhooks")
    assert [h["headers"]["argsrepr"] for h in reversed(hooks)] == ["['evt_1']", "['evt_2']"]
    [start] = _stored("maintenance")
    assert json.loads(base64.b64decode(start["body"]))[0] == ["batch_1"]


def test_a_batch_for_several_queues_lands_in_order_on_each(core: Settings) -> None:
    batch = [("bulk", ["a"]), ("standard", ["b"]), ("bulk", ["c", "d"]), ("standard", ["e"])]
    assert broker.send_jobs(batch) == []
    # Workers take from the list's right end: the first message sent is the first taken.
    for queue, ids in (("bulk", [["a"], ["c", "d"]]), ("standard", [["b"], ["e"]])):
        taken = [json.loads(base64.b64decode(m["body"]))[0][0] for m in reversed(_stored(queue))]
        assert taken == ids


def test_a_send_that_redis_refuses_returns_every_job(core: Settings) -> None:
    clients.redis_client().set("realtime", "not a list")  # LPUSH onto it fails (WRONGTYPE)
    assert broker.send_jobs([("realtime", ["job_a"])]) == ["job_a"]
    assert broker.send_jobs([("standard", ["job_b"]), ("realtime", ["job_c"])]) == [
        "job_b",
        "job_c",
    ]


def _sent_events(pubsub: Any, wait_s: float) -> list[dict[str, Any]]:
    found = []
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        message = pubsub.get_message(timeout=0.1)
        if message and message["type"] == "pmessage":
            event = json.loads(message["data"])
            body = json.loads(base64.b64decode(event["body"]))
            if body.get("type") == "task-sent":
                found.append(body)
    return found


def test_task_sent_events_only_while_flower_watches(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(broker, "WATCH_LOOK_S", 0.0)
    pubsub = clients.redis_client().pubsub()
    pubsub.psubscribe("/*celeryev*")
    time.sleep(0.1)
    assert not broker.watched()
    assert broker.send_jobs([("realtime", ["job_a"])]) == []
    assert _sent_events(pubsub, 0.5) == []

    broker.mark_watched()
    assert broker.watched()
    assert broker.send_jobs([("realtime", ["job_b"])]) == []
    [event] = _sent_events(pubsub, 2.0)
    assert event["routing_key"] == "realtime"
    assert event["name"] == RUN_JOBS_TASK
    assert "job_b" in event["args"]
    [message] = [m for m in _stored("realtime") if "job_b" in m["headers"]["argsrepr"]]
    assert event["uuid"] == message["headers"]["id"]
    pubsub.close()


def test_only_an_inference_worker_polls_its_lanes_often(core: Settings) -> None:
    """Its intake re-opens lanes, which a waiting poll would not see for a whole poll; the
    ops worker, which re-opens nothing, waits kombu's 1 s between polls when idle."""
    options = celery_app.create("worker", core).conf.broker_transport_options
    assert options["polling_interval"] == broker.LANE_POLL_S
    for kind in ("ops", "flower"):
        assert "polling_interval" not in celery_app.create(kind, core).conf.broker_transport_options
