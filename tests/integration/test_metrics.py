"""Prometheus metrics, job timings and the JSON transition log, through real processes.

One stack on SQLite: the API, an inference worker with the SIMULATED engine consuming only
``realtime`` and ``standard`` (so ``bulk`` jobs stay queued and the lane gauges have something
to show) and the ops worker (reaper every second, webhook delivery to a receiver on loopback).
Every page is parsed with prometheus-client's own parser; the tests compare values before and
after work went through, so they hold whatever ran before them.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import fresh_redis_url
from tests.support import (
    DEMO_MODEL,
    TERMINAL,
    Proc,
    Receiver,
    Samples,
    Stack,
    free_port,
    scrape,
    value,
    wait_for_job,
    wait_until,
)


def ops_metrics_url(stack: Stack, proc: Proc) -> str:
    record = stack.worker_record(proc.pid, role="ops")
    assert record is not None, proc.tail()
    return str(record["metrics_url"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("metrics")
    s = Stack(
        tmp,
        f"sqlite:///{tmp / 'inferq.db'}",
        fresh_redis_url(),
        sim_time_scale=0.2,
        reaper_interval_s=1,
        webhook_allow_private="true",
    )
    try:
        s.migrate()
        s.start_api()
        s.start_ops()
        s.start_worker(worker_lanes="realtime,standard")
        yield s
    finally:
        s.stop()


def worker_metrics_url(stack: Stack) -> str:
    worker = next(p for p in stack.procs if p.name.startswith("worker"))
    record = stack.worker_record(worker.pid)
    assert record is not None
    return str(record["metrics_url"])


def run(stack: Stack, lane: str, n: int, **extra: Any) -> list[dict[str, Any]]:
    with stack.client() as c:
        ids = [
            stack.submit(
                {
                    "prompt": f"metrics {lane} {i}",
                    "lane": lane,
                    "params": {"max_tokens": 8},
                    **extra,
                },
                client=c,
            )["id"]
            for i in range(n)
        ]
    return [stack.wait_job(job_id) for job_id in ids]


def test_counters_and_histograms_move_when_jobs_run(stack: Stack) -> None:
    api_url, worker_url = f"{stack.url}/metrics", worker_metrics_url(stack)
    api_before, worker_before = scrape(api_url), scrape(worker_url)

    done = run(stack, "realtime", 3) + run(stack, "standard", 4)
    assert {job["status"] for job in done} == {"succeeded"}
    tokens = sum(job["result"]["usage"]["completion_tokens"] for job in done)

    finished = "inferq_jobs_finished_total"
    histograms = (
        "inferq_job_queue_wait_seconds",
        "inferq_job_ttft_seconds",
        "inferq_job_e2e_latency_seconds",
    )
    ran = (("realtime", 3), ("standard", 4))

    def grew(page: Samples, name: str, **labels: str) -> float:
        return value(page, name, **labels) - value(worker_before, name, **labels)

    def observed() -> Samples | None:
        # The worker observes a job just after committing it, so a client can see the job
        # finished a moment before the worker's page counts it.
        page = scrape(worker_url)
        done = all(
            grew(page, finished, lane=lane, model=DEMO_MODEL, status="succeeded") >= n
            and all(grew(page, f"{h}_count", lane=lane) >= n for h in histograms)
            for lane, n in ran
        )
        return page if done else None

    worker = wait_until(observed, 10, "the worker to observe the jobs")
    api = scrape(api_url)
    for lane, n in ran:
        submitted = "inferq_jobs_submitted_total"
        labels = {"lane": lane, "model": DEMO_MODEL}
        assert value(api, submitted, **labels) - value(api_before, submitted, **labels) == n
        assert grew(worker, finished, lane=lane, model=DEMO_MODEL, status="succeeded") == n
        for histogram in histograms:
            count = f"{histogram}_count"
            assert grew(worker, count, lane=lane) == n
            # The observations are seconds: these short jobs all fall at or below the 60 s bucket
            # (milliseconds reported as seconds would not), and the sum is positive time.
            assert grew(worker, f"{histogram}_bucket", lane=lane, le="60.0") == n
            assert value(worker, f"{histogram}_sum", lane=lane) > value(
                worker_before, f"{histogram}_sum", lane=lane
            )
    generated = "inferq_engine_generated_tokens_total"
    assert value(worker, generated) - value(worker_before, generated) >= tokens
    steps = value(worker, "inferq_engine_batch_size_count")
    assert steps > value(worker_before, "inferq_engine_batch_size_count")
    # Each step ran at least one sequence.
    assert value(worker, "inferq_engine_batch_size_sum") >= steps
    # The engine gauges and the worker's identity are on the page.
    assert ("inferq_engine_running_sequences", ()) in worker
    assert ("inferq_engine_waiting_sequences", ()) in worker
    assert ("inferq_worker_jobs_in_flight", ()) in worker
    info = [labels for (name, labels), _ in worker.items() if name == "inferq_worker_info"]
    assert len(info) == 1 and dict(info[0])["engine"] == "simulated"


def test_lane_gauges_follow_the_queue(stack: Stack) -> None:
    """Bulk has no consumer here: its jobs wait, and the API's gauges say so; a cancel counts."""
    with stack.client() as c:
        ids = [
            stack.submit({"prompt": f"wait {i}", "lane": "bulk"}, client=c)["id"] for i in range(5)
        ]
    queued = stack.scalar("SELECT count(*) FROM jobs WHERE lane='bulk' AND status='queued'")

    def page() -> Samples | None:
        found = scrape(f"{stack.url}/metrics")
        age = value(found, "inferq_queue_oldest_age_seconds", lane="bulk", model=DEMO_MODEL)
        return found if age > 0 else None

    samples = wait_until(page, 10, "the oldest bulk job to age")
    assert value(samples, "inferq_jobs_queued", lane="bulk", model=DEMO_MODEL) == queued >= 5
    assert value(samples, "inferq_queue_messages", lane="bulk", model=DEMO_MODEL) >= 1
    assert value(samples, "inferq_jobs_queued", lane="realtime", model=DEMO_MODEL) == 0
    assert value(samples, "inferq_jobs_running", lane="bulk", model=DEMO_MODEL) == 0

    cancelled = {"lane": "bulk", "model": DEMO_MODEL, "status": "cancelled"}
    before = value(samples, "inferq_jobs_finished_total", **cancelled)
    with stack.client() as c:
        for job_id in ids:
            assert c.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    after = scrape(f"{stack.url}/metrics")
    assert value(after, "inferq_jobs_finished_total", **cancelled) == before + 5
    assert value(after, "inferq_jobs_queued", lane="bulk", model=DEMO_MODEL) == queued - 5


@contextlib.contextmanager
def tenant_client(stack: Stack, tenant: str) -> Iterator[httpx.Client]:
    """A client whose jobs are ``tenant``'s.

    This stack's API runs without keys (every job is tenant "default"): a second API process
    on the same database and Redis, with keys required, takes the tenant's key.
    """
    created = stack.cli("keys", "create", "--tenant", tenant)
    assert created.returncode == 0, created.stderr
    port = free_port()
    proc = stack.spawn(
        f"api-{tenant}", "api", env={"INFERQ_REQUIRE_AUTH": "true", "INFERQ_API_PORT": str(port)}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(f"{url}/healthz", timeout=1).status_code == 200 or not proc.alive(),
            60,
            f"the API of tenant {tenant}",
        )
        assert proc.alive(), proc.tail()
        headers = {"Authorization": f"Bearer {created.stdout.strip()}"}
        with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
            yield client
    finally:
        proc.stop()


def served(job: dict[str, Any]) -> int:
    """Prompt + completion tokens of a finished job, as its caller reads them."""
    usage = job["result"]["usage"]
    return int(usage["prompt_tokens"]) + int(usage["completion_tokens"])


def test_tenant_gauges_split_the_lanes_by_tenant(stack: Stack) -> None:
    """Two tenants' queued (bulk: no consumer here), running and served jobs, each on its own
    series; the counts are the database's rows, the tokens what each job's caller was told."""
    short = {"lane": "realtime", "params": {"max_tokens": 8}}
    with tenant_client(stack, "t2") as t2, stack.client() as default:
        clients = {"default": default, "t2": t2}
        finished: dict[str, list[dict[str, Any]]] = {}
        for tenant, n in (("default", 1), ("t2", 2)):
            client = clients[tenant]
            ids = [
                stack.submit({"prompt": f"{tenant} {i}", **short}, client=client)["id"]
                for i in range(n)
            ]
            finished[tenant] = [wait_for_job(client, i, 60, TERMINAL, stack.procs) for i in ids]
            assert {job["status"] for job in finished[tenant]} == {"succeeded"}
        waiting = [
            (client, stack.submit({"prompt": "wait", "lane": "bulk"}, client=client)["id"])
            for client in (default, default, t2, t2, t2)
        ]
        # Long enough (8000 steps) to be seen running; cancelled below.
        long = {"prompt": "go on", "lane": "realtime", "params": {"max_tokens": 8000}}
        running_id = stack.submit(long, client=t2)["id"]
        wait_for_job(t2, running_id, 30, {"running"}, stack.procs)

        def rows(tenant: str, lane: str, status: str) -> int:
            sql = "SELECT count(*) FROM jobs WHERE tenant=:t AND lane=:l AND status=:s"
            return int(stack.scalar(sql, t=tenant, l=lane, s=status))

        def page() -> Samples | None:
            found = scrape(f"{stack.url}/metrics")
            running = value(
                found, "inferq_tenant_jobs_running", lane="realtime", model=DEMO_MODEL, tenant="t2"
            )
            return found if running == 1 else None

        samples = wait_until(page, 10, "tenant t2's running job on the page")

        def gauge(name: str, lane: str, tenant: str) -> float:
            labels = {"lane": lane, "model": DEMO_MODEL, "tenant": tenant}
            return value(samples, f"inferq_tenant_{name}", **labels)

        assert gauge("jobs_queued", "bulk", "t2") == rows("t2", "bulk", "queued") == 3
        queued_default = rows("default", "bulk", "queued")
        assert gauge("jobs_queued", "bulk", "default") == queued_default >= 2
        assert gauge("jobs_running", "realtime", "t2") == rows("t2", "realtime", "running") == 1
        assert gauge("jobs_running", "realtime", "default") == 0
        assert gauge("jobs_running", "bulk", "t2") == gauge("jobs_queued", "realtime", "t2") == 0
        # Tokens of the last 60 s per second: t2's are this test's two jobs (the running one
        # counts when it ends); "default" also has what earlier tests ran.
        t2_tokens = sum(served(job) for job in finished["t2"])
        assert t2_tokens > 0
        per_s = "tokens_served_per_second"
        assert gauge(per_s, "realtime", "t2") == pytest.approx(t2_tokens / 60)
        assert gauge(per_s, "realtime", "default") >= served(finished["default"][0]) / 60 > 0
        assert gauge(per_s, "bulk", "t2") == 0

        for client, job_id in waiting:
            assert client.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"
        assert t2.post(f"/v1/jobs/{running_id}/cancel").status_code == 200
        wait_for_job(t2, running_id, 30, TERMINAL, stack.procs)
    after = scrape(f"{stack.url}/metrics")
    labels = {"lane": "bulk", "model": DEMO_MODEL, "tenant": "t2"}
    assert value(after, "inferq_tenant_jobs_queued", **labels) == 0


def test_ops_metrics_count_deliveries_and_reaper_actions(stack: Stack, receiver: Receiver) -> None:
    ops = next(p for p in stack.procs if p.name == "ops")
    url = ops_metrics_url(stack, ops)
    before = scrape(url)
    # Delivered on the first attempt; one more answered 500 once, then delivered.
    run(stack, "realtime", 1, webhook_url=receiver.url("/ok"))
    run(stack, "realtime", 1, webhook_url=receiver.url("/fail/1"))
    # A bulk job (no consumer) past its deadline: the reaper expires it.
    expiring = stack.submit({"prompt": "too late", "lane": "bulk", "timeout_s": 1})
    stack.wait_job(expiring["id"], timeout=20)

    def moved() -> Samples | None:
        found = scrape(url)
        attempts = "inferq_webhook_attempts_total"
        ok = (
            value(found, attempts, outcome="delivered")
            - value(before, attempts, outcome="delivered")
            >= 2
            and value(found, attempts, outcome="retry") - value(before, attempts, outcome="retry")
            >= 1
            and value(found, "inferq_reaper_actions_total", action="expired")
            - value(before, "inferq_reaper_actions_total", action="expired")
            >= 1
        )
        return found if ok else None

    after = wait_until(moved, 30, "webhook attempts and a reaper action to be counted")
    finished = "inferq_jobs_finished_total"
    expired = {"lane": "bulk", "model": DEMO_MODEL, "status": "expired"}
    assert value(after, finished, **expired) > value(before, finished, **expired)


def test_job_timings(stack: Stack) -> None:
    (job,) = run(stack, "realtime", 1)
    t = job["timings"]
    assert t["queued_at"] <= t["started_at"] <= t["first_token_at"] <= t["finished_at"]
    assert int(t["queued_at"]) == job["created_at"]
    assert int(t["finished_at"]) == job["finished_at"]
    assert abs(t["queue_ms"] - (t["started_at"] - t["queued_at"]) * 1000) <= 2
    assert abs(t["ttft_ms"] - (t["first_token_at"] - t["queued_at"]) * 1000) <= 2
    assert abs(t["duration_ms"] - (t["finished_at"] - t["started_at"]) * 1000) <= 2
    assert t["duration_ms"] > 0
    # A job that never ran has only its queued_at.
    queued = stack.submit({"prompt": "never", "lane": "bulk"})
    with stack.client() as c:
        cancelled = c.post(f"/v1/jobs/{queued['id']}/cancel").json()
    timings = cancelled["timings"]
    assert timings["started_at"] is None and timings["queue_ms"] is None
    assert timings["ttft_ms"] is None and timings["duration_ms"] is None
    assert timings["finished_at"] is not None


def transitions(proc: Proc, job_id: str) -> list[dict[str, Any]]:
    lines = []
    for line in proc.log.read_text(errors="replace").splitlines():
        if line.startswith("{") and job_id in line:
            lines.append(json.loads(line))
    return lines


def test_one_json_line_per_transition(stack: Stack) -> None:
    (job,) = run(stack, "standard", 1)
    api = next(p for p in stack.procs if p.name == "api")
    worker = next(p for p in stack.procs if p.name.startswith("worker"))
    record = stack.worker_record(worker.pid)
    assert record is not None

    (queued,) = transitions(api, job["id"])
    assert queued["event"] == "job.queued" and queued["from"] is None and queued["by"] == "api"
    assert queued["lane"] == "standard" and queued["tenant"]
    running, succeeded = wait_until(
        lambda: (found := transitions(worker, job["id"])) and len(found) == 2 and found,
        5,
        "the worker's two lines",
    )
    assert (running["from"], running["to"]) == ("queued", "running")
    assert (succeeded["from"], succeeded["to"]) == ("running", "succeeded")
    for line in (running, succeeded):
        assert line["worker"] == record["worker_id"] and line["by"] == "worker"
        assert line["lane"] == "standard" and line["tenant"] == queued["tenant"]
        assert line["attempt"] == 1
    assert queued["ts"] <= running["ts"] <= succeeded["ts"]


def test_api_processes_share_their_counters(tmp_path: Path) -> None:
    """`inferq api --workers 2`: whichever process answers /metrics counts every submission."""
    s = Stack(tmp_path, f"sqlite:///{tmp_path / 'inferq.db'}", fresh_redis_url())
    s.migrate()
    proc = s.spawn("api", "api", "--workers", "2")
    try:
        wait_until(lambda: httpx.get(f"{s.url}/healthz", timeout=1).status_code == 200, 60, "API")

        def pids() -> set[str]:
            return {
                line.split("[")[1].split("]")[0]
                for line in proc.log.read_text().splitlines()
                if "Started server process" in line
            }

        # /healthz answers once one process is up; the other may still be importing the app.
        wait_until(lambda: len(pids()) == 2, 60, "both server processes")
        n = 20
        for i in range(n):  # a connection each, so both processes take some
            assert httpx.post(f"{s.url}/v1/jobs", json={"prompt": f"p{i}"}).status_code == 202
        assert len(pids()) == 2, proc.tail()
        for _ in range(4):
            page = scrape(f"{s.url}/metrics")
            labels = {"lane": "standard", "model": DEMO_MODEL}
            assert value(page, "inferq_jobs_submitted_total", **labels) == n
        assert (tmp_path / "data" / "prometheus" / f"api-{s.port}").is_dir()
    finally:
        s.stop()


@pytest.mark.parametrize(
    ("setting", "argv", "says"),
    [
        ("worker_metrics_port", ["worker", "--engine", "simulated"], "the worker cannot start"),
        ("ops_metrics_port", ["ops"], "the ops worker cannot start"),
    ],
    ids=["worker", "ops"],
)
def test_a_taken_metrics_port_stops_the_worker_saying_so(
    tmp_path: Path, setting: str, argv: list[str], says: str
) -> None:
    """A port set explicitly is bound exactly: taken, the process exits (status 1) before
    taking any message or announcing itself, instead of running without metrics."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = Stack(
            tmp_path, f"sqlite:///{tmp_path / 'inferq.db'}", fresh_redis_url(), **{setting: port}
        )
        s.migrate()
        proc = s.spawn(argv[0], *argv)
        try:
            wait_until(lambda: not proc.alive(), 60, f"{argv[0]} to exit")
        finally:
            proc.stop()
    assert proc.popen.returncode == 1
    log = proc.log.read_text(errors="replace")
    assert says in log and "Address already in use" in log
    assert " ready." not in log, "Celery must not start consuming"
    role = "ops" if argv[0] == "ops" else "inference"
    assert s.worker_record(proc.pid, role=role) is None


def test_a_live_worker_is_healthy_and_beats_ops_worker_exports_its_backlog(stack: Stack) -> None:
    health = httpx.get(worker_metrics_url(stack).replace("/metrics", "/healthz"), timeout=5)
    assert health.status_code == 200, health.text
    assert health.text.startswith("heartbeat")
    # The worker consumes no bulk: these wait, and the ops worker (beat's) counts them.
    for i in range(3):
        stack.submit({"prompt": f"backlog {i}", "lane": "bulk", "params": {"max_tokens": 4}})
    ops = next(p for p in stack.procs if p.name == "ops")
    url = ops_metrics_url(stack, ops)

    def counted() -> Samples | None:
        found = scrape(url)
        jobs = value(found, "inferq_backlog_jobs", model=DEMO_MODEL, lane="bulk")
        return found if jobs >= 3 else None

    found = wait_until(counted, 30, "the ops worker's backlog gauges")
    assert value(found, "inferq_autoscale_desired_workers", model=DEMO_MODEL) >= 1
    assert value(found, "inferq_autoscale_live_workers", model=DEMO_MODEL) == 1
    assert value(found, "inferq_backlog_tokens", model=DEMO_MODEL, lane="bulk") > 0
    assert value(found, "inferq_backlog_drain_seconds", model=DEMO_MODEL, lane="bulk") > 0
