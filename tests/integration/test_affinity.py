"""Prefix affinity across workers (docs/scheduling.md, "Prefix affinity"), with a real API and
dispatcher, two real simulated workers with a prefix cache each, Redis and PostgreSQL.

- Jobs of one prompt prefix run on the worker the rendezvous hash names for it, the worker's
  engine finds the prefix in its cache, and the dispatcher's counts say so.
- Realtime jobs keep the shared queue.

A worker killed while its own queue holds jobs is the chaos suite's (tests/chaos/test_workers.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from app.core.messaging.names import (
    AFFINITY_OVERFLOW_KEY,
    AFFINITY_SENT_KEY,
)
from app.dispatcher.affinity import home
from bench.prefix import prefix_counters
from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.support import Stack, running_stack, wait_until

MODEL = "simulated"
PREFIXES = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresDatabases) -> Iterator[Any]:
    with running_stack(
        tmp_path_factory.mktemp("affinity"),
        postgres.create(),
        fresh_redis_url(),
        workers=2,
        ops=True,
        sim_prefix_cache=PREFIXES,
        sim_time_scale=0.5,
        heartbeat_s=1,
        lease_ttl_s=4,
        reaper_interval_s=1,
    ) as s:
        yield s, [p for p in s.procs if p.name.startswith("worker")]


def counted(s: Stack, n: int) -> dict[str, int] | None:
    """The jobs the dispatchers counted as sent by affinity, by worker, once they are ``n``."""
    sent = {k.decode(): int(v) for k, v in s.redis().hgetall(AFFINITY_SENT_KEY).items()}
    return sent if sum(sent.values()) == n else None


def system(i: int) -> str:
    return f"Policy {i}. " + "answer briefly and cite the manual " * 40


def chat(i: int, question: str, lane: str = "standard") -> dict[str, Any]:
    return {
        "messages": [
            {"role": "system", "content": system(i)},
            {"role": "user", "content": question},
        ],
        "params": {"max_tokens": 4},
        "lane": lane,
    }


def ran_on(stack: Stack, ids: list[str]) -> dict[str, dict[str, Any]]:
    with stack.db().connect() as conn:
        found = conn.execute(
            text(
                "SELECT id, status, attempts, lease_owner, prefix, prompt_tokens FROM jobs "
                "WHERE id = ANY(:ids)"
            ),
            {"ids": ids},
        ).mappings()
        return {row["id"]: dict(row) for row in found}


def test_a_prefix_runs_on_its_home_worker_and_hits_its_cache(stack: Any) -> None:
    s, workers = stack
    records = [s.worker_record(w.pid) for w in workers]
    ids_of = [str(r["worker_id"]) for r in records if r]
    assert len(ids_of) == 2 and all(r and r["own_lanes"] == ["standard", "bulk"] for r in records)
    ids: list[str] = []
    # One at a time, each waited for: no worker is ever loaded, so every job goes by affinity.
    with s.client() as c:
        for round_ in range(2):
            for i in range(PREFIXES):
                made = s.submit(chat(i, f"round {round_}: what next?"), c)
                s.wait_job(made["id"], 30)
                ids.append(made["id"])
    found = ran_on(s, ids)
    assert {r["status"] for r in found.values()} == {"succeeded"}
    homes = {r["prefix"]: home(r["prefix"], ids_of) for r in found.values()}
    assert all(r["lease_owner"] == homes[r["prefix"]] for r in found.values()), (homes, found)
    assert len(set(homes.values())) == 2, "twelve prefixes, all on one of two workers"
    # The dispatcher counts what it sent after its refill has committed (app/dispatcher/loop.py,
    # ``_count_affinity``): a worker can run the last job and end it before that.
    sent = wait_until(lambda: counted(s, len(ids)), 10, "every job sent counted")
    assert set(sent) == set(ids_of), sent
    assert not s.redis().hgetall(AFFINITY_OVERFLOW_KEY)
    # The second round found each prefix in its worker's cache: the engine's own count.
    for record in records:
        assert record is not None
        assert prefix_counters(record["metrics_url"])[1] > 0, record
    # Seen: the API's /metrics counts each worker's jobs by affinity and by overflow, and
    # `inferq status` shows them with each worker's hit rate (from its presence record).
    with s.client() as c:
        page = c.get("/metrics").text
    for worker, n in sent.items():
        assert f'inferq_affinity_jobs_total{{routed="affinity",worker="{worker}"}} {n}.0' in page
        assert f'inferq_affinity_jobs_total{{routed="overflow",worker="{worker}"}} 0.0' in page
    # A terminal wide enough that rich folds no worker id (a CI host's name can be long).
    shown = s.cli("status", env={"COLUMNS": "400"})
    assert shown.returncode == 0, shown.stderr
    lines = {w: next(line for line in shown.stdout.splitlines() if w in line) for w in ids_of}
    for worker, line in lines.items():
        assert f"{sent[worker]} / 0" in line and "%" in line, shown.stdout


def test_realtime_keeps_the_shared_queue(stack: Any) -> None:
    s, _ = stack
    sent = s.redis().hgetall(AFFINITY_SENT_KEY)
    with s.client() as c:
        for i in range(4):
            made = s.submit(chat(i, "right now?", lane="realtime"), c)
            assert s.wait_job(made["id"], 30)["status"] == "succeeded"
    assert s.redis().hgetall(AFFINITY_SENT_KEY) == sent
