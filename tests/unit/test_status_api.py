"""``GET /v1/admin/status``: what `inferq status` shows, as JSON, for an operator's key only; the
same snapshot the command reads itself where no API answers (app/core/observe/shapes.py)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.cli import status, where
from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import clients
from app.core.messaging.names import AFFINITY_SENT_KEY, WORKERS_KEY_PREFIX
from app.core.models import now
from app.core.observe import shapes, snapshot
from app.core.settings import Settings
from app.core.tenants.keys import create_key
from tests.unit.conftest import environment
from tests.unit.inprocess import call


def test_an_operator_reads_the_snapshot_that_status_reads_itself(core: Settings) -> None:
    with environment(require_auth="true"), db.session_scope() as session:
        _, acme = create_key(session, "acme")
        _, ops = create_key(session, "ops", operator=True)
    made = [jobs.new_job("acme", JobCreate(prompt=p, lane="bulk"), core.model_name) for p in "xy"]
    with changes("api") as tx:
        transitions.create(tx, made)
    client = clients.redis_client()
    record = {"worker_id": "gpu1:7", "model": core.model_name, "in_flight": 3, "seen_at": now()}
    client.set(WORKERS_KEY_PREFIX + "gpu1:7", json.dumps(record), ex=60)
    client.hset(AFFINITY_SENT_KEY, "gpu1:7", 5)

    with environment(require_auth="true"):
        assert call("GET", "/v1/admin/status").status_code == 401
        refused = call("GET", "/v1/admin/status", headers={"Authorization": f"Bearer {acme}"})
        answer = call("GET", "/v1/admin/status", headers={"Authorization": f"Bearer {ops}"})
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "operator_key_required"
    assert answer.status_code == 200, answer.text
    body = answer.json()

    bulk = {"lane": "bulk", "model": core.model_name}
    counts = {"queued": 2, "running": 0, "tokens_served": 0, "completion_tokens": 0}
    assert {**bulk, "tenant": "acme", "window_s": 60.0, **counts} in body["tenants"]
    (lane,) = [row for row in body["lanes"] if row["lane"] == "bulk"]
    assert (lane["queued"], lane["running"]) == (2, 0) and lane["oldest_queued_age_s"] >= 0
    assert body["workers"] == [record]
    assert body["affinity"] == {"gpu1:7": {"sent": 5, "overflow": 0}}

    # The JSON form loses nothing, and says what reading here says.
    taken = shapes.from_json(body)
    assert shapes.to_json(taken) == body
    with db.session_scope() as session:
        here = snapshot.take(client, session, core)
    for part in ("messages", "tenants", "workers", "ops", "dispatchers", "affinity", "warnings"):
        assert getattr(taken, part) == getattr(here, part), part
    assert taken.throughput == here.throughput
    assert {r: (j.queued, j.running) for r, j in taken.lanes.items()} == {
        r: (j.queued, j.running) for r, j in here.lanes.items()
    }


def _answering(reply: bytes) -> Iterator[str]:
    """A loopback server that answers every connection with ``reply`` and hangs up; its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(10)

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    conn.sendall(reply)

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()


@pytest.mark.parametrize(
    "reply",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 500\r\n\r\n{"taken_at": 1',  # cut off
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]",  # not a snapshot
        b'HTTP/1.1 200 OK\r\nContent-Length: 13\r\n\r\n{"affinity":1',  # not JSON
        b"SSH-2.0-OpenSSH_9.2\r\n",  # not HTTP
        b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://127.0.0.1:9/\r\n\r\n",
    ],
    ids=["cut-off", "not-a-snapshot", "not-json", "not-http", "redirect"],
)
def test_an_answer_that_is_not_a_snapshot_leaves_the_command_to_read_itself(
    core: Settings, reply: bytes
) -> None:
    for url in _answering(reply):
        with environment(api_url=url):
            assert status.from_api() is None
    with environment(api_url="http://127.0.0.1:80x0"):  # a port http.client refuses
        assert status.from_api() is None


def test_the_kept_operator_key_goes_to_a_loopback_api_only(core: Settings, tmp_path: Path) -> None:
    (tmp_path / where.DEV_KEY_FILE).write_text("iq_kept\n")
    with environment(data_dir=str(tmp_path)) as settings:
        assert where.api_key(settings, kept=True) == "iq_kept"
        assert where.api_key(settings, kept=False) is None
    with environment(data_dir=str(tmp_path), api_key="iq_given") as settings:
        assert where.api_key(settings, kept=False) == "iq_given"
