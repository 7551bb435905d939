"""Missing parts (app/core/observe/missing.py) on a real SQLite file and a real Redis: each rule
with the work that waits and the presence record that clears it, and the same answer in /readyz, the
API's /metrics and `inferq status`."""

from __future__ import annotations

import json

from rich.console import Console

from app.cli import status
from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import clients
from app.core.messaging.names import DISPATCHER_KEY_PREFIX, OPS_KEY_PREFIX, WORKERS_KEY_PREFIX
from app.core.models import JobStatus, now
from app.core.observe import missing
from app.core.settings import Settings
from tests.unit.conftest import environment
from tests.unit.inprocess import call

HOOK = "https://8.8.8.8/hook"  # a public address: accepted, never called here


def submit(model: str, n: int = 1, **body: object) -> list[str]:
    made = [jobs.new_job("t", JobCreate(prompt="x", lane="bulk", **body), model) for _ in range(n)]
    with changes("api") as tx:
        transitions.create(tx, made)
    return [job.id for job in made]


def announce(prefix: str, name: str, **record: object) -> None:
    clients.redis_client().set(prefix + name, json.dumps(record), ex=60)


def found() -> list[missing.Missing]:
    with db.session_scope() as session:
        return missing.find(session, clients.redis_client(), Settings())


def test_waiting_jobs_with_no_dispatcher_and_no_worker_are_both_missing(core: Settings) -> None:
    submit(core.model_name, 3)
    assert [(m.part, m.waiting, m.model) for m in found()] == [
        ("dispatcher", 3, None),
        ("worker", 3, core.model_name),
    ]
    announce(DISPATCHER_KEY_PREFIX, "d1", role="dispatcher")
    announce(WORKERS_KEY_PREFIX, "w1", model=core.model_name)
    assert found() == []


def test_an_adapters_jobs_wait_for_its_base_models_worker(core: Settings) -> None:
    adapters = json.dumps({"m-lora": {"base": "m", "path": "/nowhere"}})
    with environment(adapters=adapters, model="m"):
        announce(DISPATCHER_KEY_PREFIX, "d1", role="dispatcher")
        submit("m-lora", 2)
        assert [(m.part, m.waiting, m.model) for m in found()] == [("worker", 2, "m")]
        announce(WORKERS_KEY_PREFIX, "w1", model="m")
        assert found() == []


def test_a_due_webhook_with_no_ops_worker_is_missing_ops(core: Settings) -> None:
    announce(DISPATCHER_KEY_PREFIX, "d1", role="dispatcher")
    announce(WORKERS_KEY_PREFIX, "w1", model=core.model_name)
    ids = submit(core.model_name, 1, webhook_url=HOOK)
    with changes("worker", worker="w1") as tx:
        rows = transitions.claim(tx, ids, worker="w1", lease_s=60, stamp=now())
    done = transitions.Outcome(JobStatus.SUCCEEDED, text="ok")
    with changes("worker", worker="w1") as tx:
        transitions.record(tx, [(transitions.lease_of(rows[0]), done)], stamp=now())
    assert [(m.part, m.waiting, m.what) for m in found()] == [("ops", 1, "webhook events")]
    announce(OPS_KEY_PREFIX, "o1", role="ops")
    assert found() == []


def test_readyz_metrics_and_status_say_the_same(core: Settings) -> None:
    submit(core.model_name, 2)
    ready = call("GET", "/readyz")
    assert ready.status_code == 200  # degraded, not failing: the API itself can serve
    body = ready.json()
    assert body["status"] == "degraded"
    assert [(m["part"], m["waiting"]) for m in body["missing"]] == [
        ("dispatcher", 2),
        ("worker", 2),
    ]
    assert "no dispatcher is alive" in body["missing"][0]["message"]
    page = call("GET", "/metrics").text
    assert 'inferq_missing_part_waiting{model="",part="dispatcher"} 2.0' in page
    assert 'inferq_missing_part_waiting{model="",part="ops"} 0.0' in page
    assert f'inferq_missing_part_waiting{{model="{core.model_name}",part="worker"}} 2.0' in page
    console = Console(width=200, record=True)
    console.print(status.render(status.read_here()))
    lines = [line for line in console.export_text().splitlines() if line.startswith("warning:")]
    assert lines == [f"warning: {m['message']}" for m in body["missing"]]
    said = call("GET", "/v1/admin/status").json()["warnings"]  # what the command asks the API
    assert said == [m["message"] for m in body["missing"]]
    announce(DISPATCHER_KEY_PREFIX, "d1", role="dispatcher")
    announce(WORKERS_KEY_PREFIX, "w1", model=core.model_name)
    assert call("GET", "/readyz").json() == {
        "status": "ready",
        "database": "ok",
        "redis": "ok",
        "missing": [],
    }
