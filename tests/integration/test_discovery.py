"""Many workers on one host, and Prometheus finding them through the API's service discovery.

Three inference workers (SIMULATED engine) and an ops worker start side by side with the
default metrics settings (every process takes a free port and announces it); the API lists them
at /metrics/targets, and a real Prometheus server, configured from the shipped
deploy/prometheus/prometheus.yml with only the API's address and the intervals changed, discovers
and scrapes every one. CI installs Prometheus (.ci/run); elsewhere a missing binary skips.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import fresh_redis_url
from tests.support import REPO, Proc, Stack, free_port, running_stack, scrape, value, wait_until

SHIPPED = REPO / "deploy" / "prometheus" / "prometheus.yml"
SHIPPED_API = "api:8000"  # the API's address in the shipped file (docker compose)
WORKERS = 3
# CI sets this: there a missing binary is a failure, not a skip.
REQUIRED = os.environ.get("INFERQ_TEST_REQUIRE_ENGINES") == "1"


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        why = f"`{name}` is not installed (Debian: apt-get install prometheus; .ci/run does)"
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)
    return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("discovery")
    with running_stack(
        tmp, f"sqlite:///{tmp / 'inferq.db'}", fresh_redis_url(), workers=WORKERS, ops=True
    ) as s:
        yield s


def targets(stack: Stack) -> list[dict[str, Any]]:
    response = httpx.get(f"{stack.url}/metrics/targets", timeout=5)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/json"
    return list(response.json())


def by_role(stack: Stack) -> dict[str, list[Proc]]:
    return {
        "inference": [p for p in stack.procs if p.name.startswith("worker")],
        "ops": [p for p in stack.procs if p.name == "ops"],
    }


def test_workers_start_side_by_side_and_are_all_listed(stack: Stack) -> None:
    # The defaults, not a test's override: no metrics port is set for these processes.
    assert not {k for k in stack.env if k.endswith("_METRICS_PORT")}
    procs = by_role(stack)
    assert len(procs["inference"]) == WORKERS and len(procs["ops"]) == 1
    assert all(p.alive() for ps in procs.values() for p in ps)

    expected: dict[str, dict[str, Any]] = {}
    for role, ps in procs.items():
        for proc in ps:
            record = stack.worker_record(proc.pid, role=role)
            assert record is not None, proc.tail()
            assert record["role"] == role
            expected[record["worker_id"]] = record
    groups = targets(stack)
    assert len(groups) == WORKERS + 1
    listed = {group["labels"]["worker"]: group for group in groups}
    assert set(listed) == set(expected)
    addresses = [address for group in groups for address in group["targets"]]
    assert len(set(addresses)) == WORKERS + 1, addresses  # one port each, none shared
    for worker_id, group in listed.items():
        record = expected[worker_id]
        (address,) = group["targets"]
        assert record["metrics_url"] == f"http://{address}/metrics"
        labels = group["labels"]
        assert labels["role"] == record["role"]
        assert labels["__metrics_path__"] == "/metrics" and labels["__scheme__"] == "http"
        page = scrape(record["metrics_url"])
        if record["role"] == "inference":
            assert labels["engine"] == "simulated" and labels["model"] == record["model"]
            info = {"worker": worker_id, "engine": "simulated", "model": record["model"]}
            assert value(page, "inferq_worker_info", **info) == 1
        else:
            assert "engine" not in labels and "model" not in labels
            assert ("inferq_worker_info", ()) not in page


def prometheus_config(stack: Stack, path: Path) -> None:
    """The shipped configuration, pointed at this stack's API, with 1 s intervals."""
    text = SHIPPED.read_text()
    assert text.count(SHIPPED_API) >= 3  # the API's scrape and each discovery URL
    config = yaml.safe_load(text.replace(SHIPPED_API, f"127.0.0.1:{stack.port}"))
    config["global"]["scrape_interval"] = "1s"
    for job in config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            sd["refresh_interval"] = "1s"
    path.write_text(yaml.safe_dump(config))


def test_prometheus_discovers_and_scrapes_every_worker(stack: Stack, tmp_path: Path) -> None:
    prometheus = binary("prometheus")
    config = tmp_path / "prometheus.yml"
    prometheus_config(stack, config)
    port = free_port()  # not 9090: a Prometheus of this machine's own may be there
    proc = Proc(
        "prometheus",
        [
            prometheus,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        dict(os.environ),
        tmp_path / "prometheus.log",
    )
    stack.procs.append(proc)  # stopped with the stack whatever happens here
    # (job, instance): the shipped file's jobs, "worker" and "ops" keeping their own role.
    jobs = {"inference": "worker", "ops": "ops"}
    want = {("api", f"127.0.0.1:{stack.port}")} | {
        (jobs[group["labels"]["role"]], group["targets"][0]) for group in targets(stack)
    }
    assert len(want) == WORKERS + 2

    def all_up() -> list[dict[str, Any]] | None:
        if not proc.alive():
            raise AssertionError(f"prometheus exited:\n{proc.tail()}")
        response = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5)
        active = response.json()["data"]["activeTargets"]
        seen = {(t["labels"]["job"], t["labels"]["instance"]) for t in active}
        ok = seen == want and all(t["health"] == "up" for t in active)
        return active if ok else None

    try:
        active = wait_until(all_up, 60, "Prometheus to scrape every target", every=0.5)
    except TimeoutError as exc:
        listing = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).text
        raise AssertionError(f"{exc}\ntargets: {listing}\n{proc.tail()}") from exc
    for target in active:
        labels = target["labels"]
        if labels["job"] == "worker":
            assert labels["role"] == "inference" and labels["engine"] == "simulated"
            assert labels["worker"] and labels["model"]
        elif labels["job"] == "ops":
            assert labels["role"] == "ops" and labels["worker"]


def test_stopped_and_dead_workers_leave_the_list(stack: Stack) -> None:
    """A clean stop withdraws the record at once; a killed process's record expires by itself
    (three heartbeats of 1 s here, at least 5 s)."""
    procs = by_role(stack)
    stopped, killed = procs["inference"][-1], procs["ops"][0]
    stopped_record = stack.worker_record(stopped.pid)
    killed_record = stack.worker_record(killed.pid, role="ops")
    assert stopped_record is not None and killed_record is not None
    stopped_id, killed_id = stopped_record["worker_id"], killed_record["worker_id"]
    stopped.stop()
    assert stopped_id not in {group["labels"]["worker"] for group in targets(stack)}
    killed.signal(signal.SIGKILL)
    wait_until(
        lambda: killed_id not in {group["labels"]["worker"] for group in targets(stack)},
        15,
        "the killed ops worker's record to expire",
        every=0.5,
    )
    assert len(targets(stack)) == WORKERS - 1


def test_promtool_accepts_the_shipped_configuration() -> None:
    done = subprocess.run(
        [binary("promtool"), "check", "config", str(SHIPPED)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout
