"""`inferq flower`: a real Flower process on a real stack sees the worker and the tasks that ran.

Flower is queried through its HTTP API with basic auth, as an operator's browser would be.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from app.core.settings import LANES
from tests.support import (
    DEMO_MODEL,
    Proc,
    Stack,
    free_port,
    queue,
    run_cli,
    running_stack,
    wait_until,
)

AUTH = ("user", "pw")


def start_flower(stack: Stack, port: int) -> Proc:
    env = {"INFERQ_FLOWER_PORT": str(port), "INFERQ_FLOWER_BASIC_AUTH": "user:pw"}
    # Stopped with the stack, whatever happens.
    return stack.spawn("flower", "flower", "--address", "127.0.0.1", env=env)


def test_flower_sees_the_worker_and_every_task_with_its_lane(
    tmp_path: Path, redis_url: str
) -> None:
    db = f"sqlite:///{tmp_path / 'inferq.db'}"
    with running_stack(
        tmp_path, db, redis_url, sim_time_scale=0.2, accepted_models="later"
    ) as stack:
        port = free_port()
        flower = start_flower(stack, port)
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, auth=AUTH, timeout=10) as api:

            def get(path: str) -> Any:
                assert flower.alive(), flower.tail()
                response = api.get(path)
                response.raise_for_status()
                return response.json()

            def waited(check: Callable[[], Any], timeout: float, what: str) -> Any:
                try:
                    return wait_until(check, timeout, what, every=0.5)
                except TimeoutError as exc:
                    logs = "\n".join(f"--- {p.name}\n{p.tail(30)}" for p in stack.procs)
                    raise AssertionError(f"{exc}\n{logs}") from exc

            worker_pid = next(p.pid for p in stack.procs if p.name == "worker0")

            def ours(names: Any) -> list[str]:
                return [name for name in names if f"-{worker_pid}@" in name]

            # Heard through the worker's events (heartbeats): Flower's event receiver listens.
            alive = waited(
                lambda: [n for n, up in get("/api/workers?status=1").items() if up and ours([n])],
                60,
                "Flower to receive the worker's events",
            )
            # And answered Flower's inspect (the Workers tab: queues, pool, registered tasks).
            workers = waited(lambda: ours(get("/api/workers?refresh=1")), 60, "the inspect")
            assert workers == alive

            # Flower records only the events it receives: submit once it listens.
            jobs = {}
            for lane in ("realtime", "bulk"):
                for i in range(2):
                    job = stack.submit({"prompt": f"{lane} {i}", "lane": lane})
                    jobs[job["id"]] = lane
            for job_id in jobs:
                assert stack.wait_job(job_id)["status"] == "succeeded"

            def finished() -> dict[str, dict[str, Any]] | None:
                tasks: dict[str, dict[str, Any]] = get("/api/tasks?taskname=inferq.run_jobs")
                done = {
                    job_id: task
                    for task in tasks.values()
                    if task["state"] == "SUCCESS"
                    for job_id in jobs
                    if job_id in (task["args"] or "")
                }
                return done if set(done) == set(jobs) else None

            ran = waited(finished, 30, "Flower to list every task as succeeded")
            for job_id, task in ran.items():
                lane = jobs[job_id]
                assert task["routing_key"] == queue(lane), task  # lane and model
                assert repr(lane) in task["args"], task
                assert task["worker"] == workers[0], task

            # The Broker tab's source lists every inferq queue, consumed or not: the lanes of
            # every known model (here the served one and one accepted with no worker).
            queues = {q["name"]: q["messages"] for q in get("/api/queues/length")["active_queues"]}
            lanes = {queue(lane, model) for lane in LANES for model in (DEMO_MODEL, "later")}
            assert lanes | {"webhooks", "maintenance"} <= set(queues)
            assert queues[queue("realtime")] == queues[queue("bulk")] == 0

            assert httpx.get(f"{base}/api/workers", timeout=10).status_code == 401
            assert (
                httpx.get(f"{base}/api/tasks", auth=("user", "nope"), timeout=10).status_code == 401
            )
            assert flower.alive(), flower.tail()


def test_flower_refuses_every_interface_without_basic_auth(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")},
        "INFERQ_DATA_DIR": str(tmp_path / "data"),
        "INFERQ_FLOWER_PORT": str(port),
    }
    done = run_cli("flower", "--address", "0.0.0.0", env=env, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "without basic auth" in done.stderr
    assert "INFERQ_FLOWER_BASIC_AUTH" in done.stderr
    # Nothing was started: the port is still free.
    socket.create_server(("127.0.0.1", port)).close()


def test_flower_api_needs_basic_auth_or_flowers_own_switch(tmp_path: Path, redis_url: str) -> None:
    """Flower's HTTP API answers 401 without credentials, even on loopback, unless Flower's own
    FLOWER_UNAUTHENTICATED_API is set: the two commands for it in docs/observability.md,
    "Flower"."""
    for unauthenticated, expected in ((None, 401), ("true", 200)):
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("INFERQ_", "FLOWER_"))},
            "INFERQ_DATA_DIR": str(tmp_path / "data"),
            "INFERQ_REDIS_URL": redis_url,
            "INFERQ_FLOWER_PORT": str(port),
            **({"FLOWER_UNAUTHENTICATED_API": unauthenticated} if unauthenticated else {}),
        }
        argv = [sys.executable, "-m", "app.cli", "flower"]
        flower = Proc("flower", argv, env, tmp_path / f"flower-{port}.log")
        try:
            url = f"http://127.0.0.1:{port}/api/workers"
            status = wait_until(lambda u=url: httpx.get(u, timeout=5).status_code, 60, "Flower")
            assert status == expected, (unauthenticated, status, flower.tail())
        finally:
            flower.stop()
