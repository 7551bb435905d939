"""Many models on one deployment: routing by model, /v1/models, a model with no worker.

One stack on PostgreSQL: the API, a simulated worker of ``alpha`` (the default model) and one
of ``beta``; ``gamma`` is accepted with no worker (scaled to zero) until a test starts one.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis

from tests.conftest import PostgresDatabases, database_url_for, fresh_redis_url
from tests.integration.test_api import assert_error
from tests.support import Stack, queue, wait_until

ALPHA, BETA, GAMMA, DELTA = "alpha", "beta", "gamma", "delta"
SQL, LATER = "alpha-sql", "gamma-later"  # LoRA adapters of alpha and of gamma (no worker)
CONTEXT = 3000
BULK_ROOM = 12  # INFERQ_LANE_MAX_QUEUED for bulk here


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresDatabases) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("models")
    stack = Stack(
        tmp,
        database_url_for("postgres", tmp, postgres),
        fresh_redis_url(),
        served_model_name=ALPHA,
        accepted_models=f"{GAMMA},{DELTA}",
        model_wait_s=1,
        max_model_len=CONTEXT,
        sim_time_scale=0.2,
        worker_concurrency=4,
        lane_max_queued=json.dumps({"bulk": BULK_ROOM}),
        adapters=json.dumps(
            {
                SQL: {"base": ALPHA, "path": str(tmp / "adapters" / "sql")},
                LATER: {"base": GAMMA, "path": str(tmp / "adapters" / "later")},
            }
        ),
    )
    try:
        stack.migrate()
        stack.start_api()
        stack.start_worker()
        stack.start_worker(served_model_name=BETA)
        yield stack
    finally:
        stack.stop()


def worker_of(stack: Stack, model: str) -> str:
    """The worker id of the (one) live worker of ``model``."""
    for proc in stack.procs:
        record = stack.worker_record(proc.pid) if proc.alive() else None
        if record is not None and record.get("model") == model:
            return str(record["worker_id"])
    raise AssertionError(f"no live worker of {model}")


def models(client: httpx.Client) -> dict[str, dict[str, Any]]:
    response = client.get("/v1/models")
    assert response.status_code == 200, response.text
    return {m["id"]: m for m in response.json()["data"]}


def test_models_lists_live_and_scaled_to_zero_models(stack: Stack) -> None:
    with stack.client() as client:
        wait_until(lambda: BETA in models(client), 10, "beta in the list")
        listed = models(client)
        # The accepted ones in the settings' order (the default first), then the live ones, then
        # the adapters, each with its base as parent and its base's readiness.
        assert list(listed) == [ALPHA, GAMMA, DELTA, BETA, SQL, LATER]
        assert (listed[SQL]["parent"], listed[SQL]["ready"]) == (ALPHA, True)
        assert (listed[LATER]["parent"], listed[LATER]["ready"]) == (GAMMA, False)
        assert listed[SQL]["max_model_len"] == CONTEXT
        assert listed[ALPHA]["parent"] is None
        for name in (ALPHA, BETA):
            assert listed[name]["ready"] is True
            assert listed[name]["workers"] == 1
            assert listed[name]["max_model_len"] == CONTEXT  # from the worker's model card
        assert listed[GAMMA]["ready"] is False
        assert listed[GAMMA]["workers"] == 0
        assert listed[GAMMA]["max_model_len"] is None  # no worker of it has ever run
        assert client.get(f"/v1/models/{BETA}").json() == listed[BETA]
        assert_error(client.get("/v1/models/nope"), 404, "model_not_found", "model")


def test_every_job_runs_on_a_worker_of_its_model(stack: Stack) -> None:
    workers = {ALPHA: worker_of(stack, ALPHA), BETA: worker_of(stack, BETA)}
    wanted: dict[str, str] = {}
    with stack.client() as client:
        for lane in ("realtime", "standard", "bulk"):
            for model in (ALPHA, BETA, None):
                body: dict[str, Any] = {"prompt": "hello", "lane": lane}
                if model is not None:
                    body["model"] = model
                job = stack.submit(body, client)
                wanted[job["id"]] = model or ALPHA  # no model: the default one
                assert job["model"] == wanted[job["id"]]
        chat = client.post(
            "/v1/chat/completions",
            json={"model": BETA, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == BETA
        wanted[chat.headers["inferq-job-id"]] = BETA
    for job_id, model in wanted.items():
        assert stack.wait_job(job_id)["status"] == "succeeded"
        owner = stack.scalar("SELECT lease_owner FROM jobs WHERE id = :id", id=job_id)
        assert owner == workers[model], (job_id, model)


def test_a_lora_adapter_runs_on_its_base_models_workers(stack: Stack) -> None:
    """alpha-sql is an adapter of alpha: its jobs go to alpha's queue and worker, and its text
    is not the base model's; gamma-later's base has no worker: a job waits, a call is 503."""
    body = {"prompt": "same prompt", "params": {"max_tokens": 12, "seed": 7}}
    with stack.client() as client:
        base = stack.submit(body, client)
        adapted = stack.submit({**body, "model": SQL}, client)
        done = {j["id"]: stack.wait_job(j["id"]) for j in (base, adapted)}
        assert [d["status"] for d in done.values()] == ["succeeded", "succeeded"]
        assert done[adapted["id"]]["model"] == SQL
        assert done[adapted["id"]]["result"]["text"] != done[base["id"]]["result"]["text"]
        owner = stack.scalar("SELECT lease_owner FROM jobs WHERE id = :id", id=adapted["id"])
        assert owner == worker_of(stack, ALPHA)
        # The adapter runs in its base's context: a prompt too long for alpha is too long for it.
        before = stack.scalar("SELECT count(*) FROM jobs")
        too_long = {"prompt": "word " * CONTEXT, "model": SQL}
        assert_error(client.post("/v1/jobs", json=too_long), 422, "context_length_exceeded")
        assert stack.scalar("SELECT count(*) FROM jobs") == before

        waiting = stack.submit({"prompt": "x", "model": LATER}, client)
        broker = redis.Redis.from_url(stack.redis_url)
        wait_until(lambda: broker.llen(queue("standard", GAMMA)) >= 1, 10, "gamma's queue")
        response = client.post("/v1/completions", json={"model": LATER, "prompt": "x"})
        assert_error(response, 503, "model_not_ready", "model")
        assert client.get(f"/v1/jobs/{waiting['id']}").json()["status"] == "queued"
        client.post(f"/v1/jobs/{waiting['id']}/cancel")


def test_an_unknown_model_is_404_and_writes_nothing(stack: Stack) -> None:
    before = stack.scalar("SELECT count(*) FROM jobs")
    with stack.client() as client:
        for path, body in (
            ("/v1/jobs", {"prompt": "x", "model": "gpt-unknown"}),
            ("/v1/chat/completions", {"model": "gpt-unknown", "messages": [{"role": "user"}]}),
            ("/v1/completions", {"model": "gpt-unknown", "prompt": "x"}),
            ("/v1/jobs/bulk", {"jobs": [{"prompt": "x"}, {"prompt": "y", "model": "nope"}]}),
        ):
            if path == "/v1/chat/completions":
                body["messages"][0]["content"] = "x"
            error = assert_error(client.post(path, json=body), 404, "model_not_found")
            assert error["param"].endswith("model")
    assert stack.scalar("SELECT count(*) FROM jobs") == before


def test_a_backlog_of_one_model_neither_delays_nor_refuses_another(stack: Stack) -> None:
    """alpha's bulk lane fills up (its backpressure refuses more); beta's jobs, in every lane
    including bulk, are accepted and run meanwhile."""
    long = {"prompt": "go on", "lane": "bulk", "params": {"max_tokens": 4000}}
    with stack.client() as client:
        backlog = stack.submit_many([long] * (BULK_ROOM + 12), client)

        def refused() -> httpx.Response | None:
            response = client.post("/v1/jobs", json=long)
            if response.status_code == 202:
                backlog.append(response.json()["id"])
                return None
            return response

        full = wait_until(refused, 10, "alpha's bulk lane to be full")
        assert_error(full, 503, "lane_overloaded")
        quick = [
            stack.submit({"prompt": "hi", "model": BETA, "lane": lane}, client)["id"]
            for lane in ("bulk", "standard", "realtime")
        ]
        for job_id in quick:
            assert stack.wait_job(job_id, timeout=30)["status"] == "succeeded"
        queued = stack.scalar(
            "SELECT count(*) FROM jobs WHERE model = :m AND status = 'queued'", m=ALPHA
        )
        assert queued >= BULK_ROOM  # alpha's backlog was still waiting all along
        for job_id in backlog:
            client.post(f"/v1/jobs/{job_id}/cancel")


def test_a_model_with_no_worker_takes_jobs_and_refuses_calls(stack: Stack) -> None:
    """gamma is accepted but served by nobody: a job waits in gamma's queue; an OpenAI call
    waits INFERQ_MODEL_WAIT_S, then 503 with Retry-After, writing nothing. Once a worker of
    gamma starts, the waiting job runs on it."""
    broker = redis.Redis.from_url(stack.redis_url)
    with stack.client() as client:
        sent = broker.llen(queue("standard", GAMMA))
        job = stack.submit({"prompt": "later", "model": GAMMA}, client)
        wait_until(lambda: broker.llen(queue("standard", GAMMA)) == sent + 1, 10, "its message")
        before = stack.scalar("SELECT count(*) FROM jobs")
        started = time.monotonic()
        response = client.post(
            "/v1/completions", json={"model": GAMMA, "prompt": "now"}, timeout=30
        )
        waited = time.monotonic() - started
        error = assert_error(response, 503, "model_not_ready", "model")
        assert int(response.headers["retry-after"]) > 0
        assert waited >= 1  # INFERQ_MODEL_WAIT_S: it gave a worker the chance to appear
        assert GAMMA in error["message"]
        assert stack.scalar("SELECT count(*) FROM jobs") == before
        assert client.get(f"/v1/jobs/{job['id']}").json()["status"] == "queued"

        stack.start_worker(served_model_name=GAMMA)
        assert stack.wait_job(job["id"])["status"] == "succeeded"
        owner = stack.scalar("SELECT lease_owner FROM jobs WHERE id = :id", id=job["id"])
        assert owner == worker_of(stack, GAMMA)
        wait_until(lambda: models(client)[GAMMA]["ready"], 10, "gamma to be ready")
        answer = client.post("/v1/completions", json={"model": GAMMA, "prompt": "now"})
        assert answer.status_code == 200, answer.text


def records_of(stack: Stack, model: str) -> list[dict[str, Any]]:
    broker = redis.Redis.from_url(stack.redis_url)
    found = [json.loads(broker.get(key) or "{}") for key in broker.scan_iter("inferq:worker:*")]
    return [r for r in found if r.get("model") == model]


def test_one_worker_per_gpu_each_pinned_and_kept_running(stack: Stack) -> None:
    """`inferq worker --gpus 0,1`: a worker per GPU, each seeing only its own, with its own
    metrics address; one that dies is started again; SIGTERM stops them all."""
    proc = stack.spawn(
        "gpus",
        "worker",
        "--gpus",
        "0,1",
        "--engine",
        "simulated",
        env={"INFERQ_SERVED_MODEL_NAME": "pinned"},
    )
    two = wait_until(lambda: len(r := records_of(stack, "pinned")) == 2 and r, 60, "two workers")
    assert sorted(r["devices"] for r in two) == ["0", "1"]
    assert len({r["metrics_url"] for r in two}) == 2
    assert proc.pid not in {r["pid"] for r in two}  # the supervisor runs no engine itself

    first = next(r for r in two if r["devices"] == "0")
    os.kill(first["pid"], signal.SIGKILL)

    def replaced() -> bool:
        pids = {r["devices"]: r["pid"] for r in records_of(stack, "pinned")}
        return "0" in pids and pids["0"] != first["pid"] and "1" in pids

    wait_until(replaced, 60, "the worker of GPU 0 to be started again")
    children = [r["pid"] for r in records_of(stack, "pinned")]
    proc.signal(signal.SIGTERM)
    assert proc.popen.wait(60) == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_whose_model_cannot_load_exits_before_taking_a_job(stack: Stack) -> None:
    job = stack.submit({"prompt": "for delta", "model": DELTA})
    worker = stack.spawn(
        "broken",
        "worker",
        "--engine",
        "hf",
        env={"INFERQ_MODEL": str(stack.tmp / "no-such-model"), "INFERQ_SERVED_MODEL_NAME": DELTA},
    )
    assert worker.popen.wait(120) != 0
    assert "the worker cannot start" in worker.tail(200)
    assert "no-such-model" in worker.tail(200)  # the reason, naming what did not load
    row = stack.wait_job(job["id"], timeout=1, statuses={"queued"})
    assert row["attempts"] == 0
    assert redis.Redis.from_url(stack.redis_url).llen(queue("standard", DELTA)) == 1
