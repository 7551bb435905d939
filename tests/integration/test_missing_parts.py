"""Incomplete stacks, as a new user might start them, through real processes: each missing part
is said in /readyz, the API's /metrics, `inferq status` and the API's log; and the default ops
worker runs the dispatcher's loop, so with it nothing waits (docs/reliability.md, "Nothing waits
unseen").

One stack on SQLite, grown one process at a time: the API alone, then a worker, then a
dispatcher of its own, then (that dispatcher stopped) the ops worker as `inferq ops` starts it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from tests.conftest import fresh_redis_url
from tests.support import DEMO_MODEL, Receiver, Stack, scrape, value, wait_until


def missing(stack: Stack) -> list[tuple[str, int]]:
    ready = httpx.get(f"{stack.url}/readyz", timeout=10)
    assert ready.status_code == 200, ready.text
    body: dict[str, Any] = ready.json()
    assert body["status"] == ("degraded" if body["missing"] else "ready")
    return [(m["part"], m["waiting"]) for m in body["missing"]]


def test_each_missing_part_is_said_until_it_runs(tmp_path: Path, receiver: Receiver) -> None:
    stack = Stack(
        tmp_path,
        f"sqlite:///{tmp_path / 'inferq.db'}",
        fresh_redis_url(),
        sim_time_scale=0.1,
        dispatch_direct="false",  # every job waits for a dispatcher
        webhook_allow_private="true",
    )
    try:
        stack.migrate()
        api = stack.start_api(dispatcher=False)
        hook = {"webhook_url": receiver.url("/missing")}
        ids = stack.submit_many([{"prompt": f"wait {i}", "lane": "bulk", **hook} for i in range(4)])
        # The API alone: nothing sends the jobs, nothing runs them.
        assert missing(stack) == [("dispatcher", 4), ("worker", 4)]
        page = scrape(f"{stack.url}/metrics")
        assert value(page, "inferq_missing_part_waiting", part="dispatcher", model="") == 4
        assert value(page, "inferq_missing_part_waiting", part="worker", model=DEMO_MODEL) == 4
        shown = stack.cli("status")
        assert shown.returncode == 0, shown.stderr
        warnings = [line for line in shown.stdout.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 2 and "no dispatcher is alive" in warnings[0], shown.stdout
        wait_until(
            lambda: "missing dispatcher: 4 jobs wait" in api.log.read_text(), 20, "the API's log"
        )

        stack.start_worker()
        assert missing(stack) == [("dispatcher", 4)]

        # A dispatcher runs them; their webhook events then wait for an ops worker.
        dispatcher = stack.start_dispatcher()
        for job_id in ids:
            assert stack.wait_job(job_id)["status"] == "succeeded"
        assert missing(stack) == [("ops", 4)]
        wait_until(lambda: "missing ops: 4 webhook events" in api.log.read_text(), 20, "the log")

        # `inferq ops` as a user starts it: it delivers, and its loop sends the next jobs.
        dispatcher.stop()
        ops = stack.start_ops(ops_dispatch=True)
        wait_until(lambda: len(receiver.received("/missing")) >= 4, 30, "the deliveries")
        more = stack.submit_many([{"prompt": f"more {i}", "lane": "bulk"} for i in range(3)])
        for job_id in more:
            assert stack.wait_job(job_id)["status"] == "succeeded"
        wait_until(lambda: missing(stack) == [], 20, "nothing missing")
        # The one dispatcher alive is the ops worker's loop: its record carries the ops pid.
        assert stack.worker_record(ops.pid, role="dispatcher") is not None
    finally:
        stack.stop()
