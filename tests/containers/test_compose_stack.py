"""docker-compose.yml run for real, in containers: the images the Dockerfile builds, the API, the
ops worker (with the dispatcher's loop) and a CPU worker with vLLM's CPU engine, started by
docker-compose against podman (tests/containers/podman.py says how and why).

One stack for the module, in the order a user meets it: `up` with the default profile, a
realtime job and a 10-line batch, Prometheus finding the worker by its container hostname, a
second worker from `--scale worker=2` serving alone, then `down` and a second `up` that finds
the first one's jobs in PostgreSQL's volume.
"""

from __future__ import annotations

import io
import json
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.containers.conftest import PROJECT, TIMINGS
from tests.containers.podman import Compose, Podman
from tests.support import wait_until

API = "http://127.0.0.1:8000"
PROMETHEUS = "http://127.0.0.1:9090"
# The ports docker-compose.yml publishes on loopback for the services this test starts.
PUBLISHED = (8000, 9090, 5555)
# Named volumes `down` must leave (the ones the default profile's services mount).
VOLUMES = ("pg-data", "redis-data", "ops-data", "files", "model-cache", "prometheus-data")
ENGINE_READY = re.compile(r"inferq\.worker: engine (\S+) ready")
# The first test's setup builds every image where podman's cache has none of them (about five
# minutes on a CI machine); pyproject's 300 s per test is for tests that do not.
pytestmark = pytest.mark.timeout(1200)


@dataclass
class Stack:
    compose: Compose
    podman: Podman
    key: str = ""
    jobs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=API, headers={"Authorization": f"Bearer {self.key}"}, timeout=30
        )

    def logs(self, *services: str) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", "40", *services, timeout=60)
        except AssertionError as exc:
            return str(exc)

    def wait(self, check: Any, timeout: float, what: str, *services: str) -> Any:
        """wait_until, with the services' logs in the failure."""
        try:
            return wait_until(check, timeout, what, every=0.5)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{self.logs(*services)}") from exc

    def ready(self) -> None:
        def answers() -> bool:
            return bool(httpx.get(f"{API}/readyz", timeout=5).json().get("status") == "ready")

        self.wait(answers, 120, "the API's /readyz", "api", "migrate")

    def engine_ready(self, container: str) -> str:
        """The engine a worker container's log says it started, once it says so."""

        def said() -> str | None:
            done = self.podman.run("logs", container, check=False)
            found = ENGINE_READY.search(done.stdout + done.stderr)
            return found.group(1) if found else None

        return str(self.wait(said, 420, f"{container}'s engine", "worker"))

    def run_job(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        with self.client() as client:
            created = client.post(
                "/v1/jobs",
                json={"prompt": prompt, "lane": "realtime", "params": {"max_tokens": max_tokens}},
            )
            assert created.status_code in (200, 201, 202), created.text

            def finished() -> dict[str, Any] | None:
                job = client.get(f"/v1/jobs/{created.json()['id']}").json()
                return job if job["status"] in ("succeeded", "failed", "cancelled") else None

            job: dict[str, Any] = self.wait(finished, 120, "a realtime job", "worker", "ops")
        assert job["status"] == "succeeded", job
        assert job["result"]["usage"]["completion_tokens"] == max_tokens
        assert job["result"]["text"]
        return job


def port_taken(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def stack(docker_host: str, images: Podman) -> Iterator[Stack]:
    compose = Compose(docker_host, PROJECT)
    compose("down", "--volumes", "--remove-orphans")  # what an interrupted run left
    taken = [port for port in PUBLISHED if port_taken(port)]
    assert not taken, f"docker-compose.yml publishes ports already in use here: {taken}"
    stack = Stack(compose, images)
    try:
        with TIMINGS.step("compose up (containers started)"):
            compose("up", "--detach")
        with TIMINGS.step("API ready after up"):
            stack.ready()
        stack.key = compose("exec", "-T", "api", "inferq", "keys", "create", "--tenant", "ct")
        stack.key = stack.key.strip()
        yield stack
    finally:
        compose("down", "--volumes", "--remove-orphans", timeout=300)


def test_a_realtime_job_and_a_batch_run_in_the_worker_container(stack: Stack) -> None:
    with TIMINGS.step("worker's engine ready after up"):
        engine = stack.engine_ready(stack.compose.container("worker"))
    assert engine == "vllm", f"the CPU worker image started the {engine} engine, not vLLM's"
    with TIMINGS.step("realtime job"):
        stack.jobs["realtime"] = stack.run_job("Write a haiku about queues", 12)

    client = OpenAI(base_url=f"{API}/v1", api_key=stack.key)
    lines: list[dict[str, Any]] = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "inferq-demo",
                "max_tokens": 3 + i % 4,
                "messages": [{"role": "user", "content": f"Summarise document {i}."}],
            },
        }
        for i in range(10)
    ]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    uploaded = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    def done() -> Any:
        found = client.batches.retrieve(batch.id)
        return found if found.status in ("completed", "failed", "cancelled", "expired") else None

    with TIMINGS.step("10-line batch, created to completed"):
        finished = stack.wait(done, 180, f"batch {batch.id}", "ops", "worker")
    assert finished.status == "completed", finished.errors
    assert finished.request_counts.completed == 10 and finished.request_counts.failed == 0
    assert finished.output_file_id is not None
    results = [
        json.loads(x) for x in client.files.content(finished.output_file_id).text.splitlines()
    ]
    by_id = {r["custom_id"]: r for r in results}
    assert set(by_id) == {line["custom_id"] for line in lines}
    for line in lines:
        response = by_id[line["custom_id"]]["response"]
        assert response["status_code"] == 200
        usage = response["body"]["usage"]
        assert usage["completion_tokens"] == line["body"]["max_tokens"]


def test_prometheus_discovers_the_worker_by_its_container_hostname(stack: Stack) -> None:
    worker = stack.podman.inspect(stack.compose.container("worker"))
    hostname = str(worker["Config"]["Hostname"])

    def scraped() -> dict[str, Any] | None:
        targets = httpx.get(f"{PROMETHEUS}/api/v1/targets", timeout=5).json()["data"]
        for target in targets["activeTargets"]:
            address = target["discoveredLabels"]["__address__"]
            worker = target["labels"].get("job") == "worker" and target["health"] == "up"
            if worker and address.startswith(f"{hostname}:"):
                return dict(target)
        return None

    # http_sd refreshes every 15 s and scrapes every 5 s (deploy/prometheus/prometheus.yml).
    with TIMINGS.step("Prometheus scrapes the worker"):
        target = stack.wait(scraped, 90, f"Prometheus to scrape {hostname}", "prometheus", "api")
    assert target["labels"]["role"] == "inference"


def test_a_second_worker_from_scale_starts_and_serves(stack: Stack) -> None:
    first, second = stack.compose.container("worker", 1), stack.compose.container("worker", 2)
    with TIMINGS.step("second worker's engine ready (--scale worker=2)"):
        stack.compose("up", "--detach", "--no-recreate", "--scale", "worker=2")
        assert stack.engine_ready(second) == "vllm"
    # With the first one stopped, the second is the only worker left to run the job.
    with TIMINGS.step("first worker stopped"):
        stack.podman.run("stop", "--time", "90", first, timeout=120)
    stack.jobs["second worker"] = stack.run_job("Name three queues you have waited in", 8)
    assert stack.podman.inspect(second)["State"]["Running"]


def test_down_keeps_the_volumes_and_the_next_up_finds_the_jobs(stack: Stack) -> None:
    with TIMINGS.step("compose down"):
        stack.compose("down", timeout=300)
    project = f"label=com.docker.compose.project={PROJECT}"
    assert stack.podman.run("ps", "--all", "--quiet", "--filter", project).stdout.split() == []
    listed = stack.podman.run("volume", "ls", "--format", "{{.Name}}").stdout.split()
    assert {f"{PROJECT}_{v}" for v in VOLUMES} <= set(listed), listed

    with TIMINGS.step("second compose up, API ready"):
        stack.compose("up", "--detach")
        stack.ready()
    with stack.client() as client:  # the key, too, is in PostgreSQL's volume
        for name, job in stack.jobs.items():
            again = client.get(f"/v1/jobs/{job['id']}")
            assert again.status_code == 200, (name, again.text)
            assert again.json()["status"] == "succeeded"
            assert again.json()["result"] == job["result"], name

    # Stopped while its engine is still starting (before Celery has its signal handlers), the
    # worker exits on SIGTERM, which the image's init (tini) hands on, rather than being killed
    # at the end of its grace period (exit code 137): as PID 1 it would not even see it.
    worker = stack.compose.container("worker")
    started = stack.podman.run("logs", worker, check=False)
    assert not ENGINE_READY.search(started.stdout + started.stderr), "the engine was up already"
    with TIMINGS.step("worker stopped while its engine starts"):
        stack.podman.run("stop", "--time", "90", worker, timeout=120)
    state = stack.podman.inspect(worker)["State"]
    assert state["ExitCode"] != 137 and not state["OOMKilled"], state
