"""Chaos: the Redis master dies under load and Sentinel promotes its replica (docs/reliability.md,
"Redis in production").

A master, a replica and three sentinels of their own on loopback (tests/chaos/servers.py,
Debian's ``redis-sentinel``); inferq is given ``sentinel://.../0?master_name=inferq``. Real
processes: the API, one inference worker (SIMULATED engine), the ops worker with its dispatcher
loop, on a PostgreSQL database of their own. The load: two clients streaming realtime chat
completions one after another, a 2,000-job bulk backlog with a webhook each, a 200-line batch,
and a prober submitting one realtime job every 100 ms. Mid-load the master gets ``kill -9``.

Afterwards:
- every accepted job (bulk, batch lines, probes) succeeded, with one result; every bulk job has
  one webhook event id and the receiver got each;
- every streaming call finished, or ended with a clear retryable error (a 503 with
  ``Retry-After``, or an SSE error event), none past its deadline;
- while the master was gone the API answered 503 ``broker_unavailable`` with ``Retry-After``,
  and accepted again by itself;
- the worker, the ops worker and the API are the processes that started (no restart).

It prints ``FAILOVER`` lines (``pytest -s``): the window in which submissions were refused,
the jobs claimed more than once, and what asynchronous replication lost from Redis: messages
the reaper found missing and sent again (its ``sent`` action), the database being the truth.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import bindparam, text

from tests.chaos.servers import SentinelSet
from tests.conftest import PostgresDatabases
from tests.support import Receiver, Stack, scrape, value, wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

BULK = 2000
BATCH_LINES = 200
CALL_TIMEOUT_S = 60.0


def needs_sentinel() -> None:
    if shutil.which("redis-sentinel") is None:
        if os.environ.get("INFERQ_TEST_REQUIRE_ENGINES") == "1":
            pytest.fail("redis-sentinel is not installed (.ci/run installs Debian's)")
        pytest.skip("redis-sentinel is not installed")


class Prober(threading.Thread):
    """Submits a realtime job every 100 ms; keeps every answer's time, status and body."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.answers: list[tuple[float, int, dict[str, Any], dict[str, str]]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with self.stack.client() as c:
            i = 0
            while not self.stop.wait(0.1):
                body = {"prompt": f"probe {i}", "lane": "realtime", "params": {"max_tokens": 4}}
                try:
                    r = c.post("/v1/jobs", json=body, timeout=10)
                    self.answers.append(
                        (time.monotonic(), r.status_code, r.json(), dict(r.headers))
                    )
                except httpx.HTTPError as exc:
                    self.answers.append((time.monotonic(), 0, {"error": str(exc)}, {}))
                i += 1


class Streamer(threading.Thread):
    """Streams chat completions one after another; keeps how each call ended."""

    def __init__(self, stack: Stack, name: str) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.name = name
        self.ends: list[str] = []
        self.stop = threading.Event()

    def call(self, client: httpx.Client, i: int) -> str:
        body = {
            "model": "inferq-demo",
            "messages": [{"role": "user", "content": f"{self.name} {i}"}],
            "max_tokens": 24,
            "stream": True,
        }
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                retry = "Retry-After" in r.headers and r.status_code in (503, 504)
                return f"refused {r.status_code}" if retry else f"bad {r.status_code} {r.text}"
            data = [line for line in r.iter_lines() if line.startswith("data: ")]
        if data and data[-1] == "data: [DONE]":
            return "done"
        if any('"error"' in line for line in data):
            return "error event"
        return f"cut off: {data[-3:]}"

    def run(self) -> None:
        with httpx.Client(base_url=self.stack.url, timeout=CALL_TIMEOUT_S) as client:
            i = 0
            while not self.stop.is_set():
                try:
                    self.ends.append(self.call(client, i))
                except httpx.TimeoutException:
                    self.ends.append("timed out")
                except httpx.HTTPError as exc:
                    self.ends.append(f"transport {exc!r}")
                i += 1


def upload_batch(stack: Stack) -> str:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "inferq-demo",
                "messages": [{"role": "user", "content": f"batch {i}"}],
                "max_tokens": 8,
            },
        }
        for i in range(BATCH_LINES)
    ]
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    with stack.client() as c:
        uploaded = c.post(
            "/v1/files", files={"file": ("in.jsonl", io.BytesIO(data))}, data={"purpose": "batch"}
        )
        assert uploaded.status_code == 200, uploaded.text
        body = {
            "input_file_id": uploaded.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        created = c.post("/v1/batches", json=body)
        assert created.status_code == 200, created.text
        return str(created.json()["id"])


ROWS = text(
    "SELECT id, status, attempts, result_text, lane, batch_id FROM jobs WHERE id IN :ids"
).bindparams(bindparam("ids", expanding=True))


def test_master_killed_under_load_fails_over_and_nothing_is_lost(
    tmp_path: Path, postgres: PostgresDatabases
) -> None:
    needs_sentinel()
    redis_set = SentinelSet(tmp_path / "redis")
    receiver = Receiver()
    stack = Stack(
        tmp_path,
        postgres.create(),
        redis_set.url,
        sim_time_scale=0.5,
        reaper_interval_s=1,
        webhook_allow_private="true",
    )
    try:
        redis_set.start()
        stack.migrate()
        api = stack.start_api(dispatcher=False)
        ops = stack.start_ops(ops_dispatch=True)
        worker = stack.start_worker(worker_concurrency=64)
        hook = receiver.url("/hooks")
        bulk = stack.submit_many(
            [
                {
                    "prompt": f"bulk {i}",
                    "lane": "bulk",
                    "webhook_url": hook,
                    "params": {"max_tokens": 8},
                }
                for i in range(BULK)
            ]
        )
        batch_id = upload_batch(stack)
        prober, streamers = Prober(stack), [Streamer(stack, f"s{i}") for i in range(2)]
        for thread in (prober, *streamers):
            thread.start()
        wait_until(
            lambda: stack.scalar("SELECT count(*) FROM jobs WHERE status = 'succeeded'") >= 400,
            60,
            "the first 400 jobs",
        )
        old_master = redis_set.master.port
        killed_at = time.monotonic()
        redis_set.master.kill()
        wait_until(lambda: redis_set.master_port() != old_master, 30, "the sentinels' failover")
        promoted_at = time.monotonic()
        # Submissions are accepted again by themselves.
        wait_until(
            lambda: any(t > promoted_at and code == 202 for t, code, _, _ in prober.answers),
            30,
            "a submission accepted after the failover",
        )
        time.sleep(3)  # a little more load on the new master
        prober.stop.set()
        for s in streamers:
            s.stop.set()
        for thread in (prober, *streamers):
            thread.join(CALL_TIMEOUT_S + 10)
            assert not thread.is_alive(), "a client hangs"

        # During the switch: 503 broker_unavailable with Retry-After, nothing else.
        refused = [(t, body, headers) for t, code, body, headers in prober.answers if code == 503]
        assert refused, "no submission was refused: the master's death went unseen"
        for _, body, headers in refused:
            assert body["error"]["code"] == "broker_unavailable", body
            assert int(headers["retry-after"]) >= 1, headers
        others = Counter(code for _, code, _, _ in prober.answers if code not in (202, 503))
        assert not others, f"answers other than 202 and 503: {others}"
        window = max(t for t, _, _ in refused) - min(t for t, _, _ in refused)

        # Every accepted job succeeds, once.
        probes = [body["id"] for _, code, body, _ in prober.answers if code == 202]
        with stack.client() as c:
            batch = wait_until(
                lambda: (
                    (b := c.get(f"/v1/batches/{batch_id}").json())["status"]
                    in ("completed", "failed")
                    and b
                ),
                120,
                "the batch",
            )
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {
            "total": BATCH_LINES,
            "completed": BATCH_LINES,
            "failed": 0,
        }
        ids = bulk + probes

        def all_done() -> list[Any] | None:
            with stack.db().connect() as conn:
                found = list(conn.execute(ROWS, {"ids": ids}))
            return found if all(r.status == "succeeded" for r in found) else None

        found = wait_until(all_done, 120, "every accepted job to succeed")
        assert len(found) == len(ids)
        assert all(r.result_text for r in found)
        with stack.db().connect() as conn:
            lines = list(
                conn.execute(
                    text("SELECT status, attempts FROM jobs WHERE batch_id = :b"), {"b": batch_id}
                )
            )
        assert Counter(r.status for r in lines) == {"succeeded": BATCH_LINES}
        rerun = sum(1 for r in [*found, *lines] if r.attempts > 1)

        # One webhook event per bulk job, each delivered.
        with stack.db().connect() as conn:
            events = dict(
                conn.execute(
                    text(
                        "SELECT job_id, count(*) FROM webhook_events"
                        " WHERE job_id IN :ids GROUP BY job_id"
                    ).bindparams(bindparam("ids", expanding=True)),
                    {"ids": bulk},
                ).all()
            )
        assert set(events) == set(bulk) and set(events.values()) == {1}
        wait_until(
            lambda: len({r["headers"]["webhook-id"] for r in receiver.received("/hooks")}) >= BULK,
            120,
            "every webhook delivered",
        )

        # Streaming calls: finished, or a clear retryable error; none hung.
        ends = Counter(end for s in streamers for end in s.ends)
        assert ends["done"] > 0, ends
        unclear = {
            e: n
            for e, n in ends.items()
            if e not in ("done", "error event") and not e.startswith("refused")
        }
        assert not unclear, ends

        # No process was restarted.
        for proc in (api, ops, worker):
            assert proc.alive(), proc.tail()
        resent = value(
            scrape(ops_metrics(stack, ops.pid)), "inferq_reaper_actions_total", action="sent"
        )
        figures = [
            f"sentinels promoted the replica {promoted_at - killed_at:.2f} s after the kill",
            f"submissions refused for {window:.2f} s "
            f"({len(refused)} of {len(prober.answers)} probes)",
            f"jobs claimed more than once: {rerun} of {len(ids) + BATCH_LINES}",
            f"messages lost with the master, sent again by the reaper: {resent:.0f}",
            f"streaming calls: {dict(ends)}",
        ]
        print("".join(f"\nFAILOVER {line}" for line in figures), flush=True)
    finally:
        stack.stop()
        receiver.close()
        redis_set.close()


def ops_metrics(stack: Stack, pid: int) -> str:
    record = stack.worker_record(pid, role="ops")
    assert record is not None
    return str(record["metrics_url"])
