"""What a worker runs on a timer, on SQLite, finds its rows by an index: not a scan of the jobs
table, which is the whole history (issue 66).

On SQLite every write holds the one writer's lock (``BEGIN IMMEDIATE``, app/core/db.py), so a
statement that reads the history stalls every submission and claim behind it. A worker's lease
renewal named its jobs by ``(id, lease_token) IN (...)``, which SQLite answers by reading every
row: over a million finished jobs each heartbeat held the lock 250-285 ms, and the 16 clients'
calls that met it waited as long (the TTFT p99 of the ``history`` scenario, docs/benchmarks.md,
"Issue 66 ... ninth session"). SQLite keeps no statistics here, so the plan read on a few rows
is the plan on a million; PostgreSQL's plans are read on a large table in
tests/integration/test_query_plans.py.
"""

from __future__ import annotations

from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.settings import Settings
from bench.history import rows
from tests.support import sqlite_plans
from tests.unit.inprocess import Worker
from workers.inference.heartbeat import Heartbeat


def test_a_lease_renewal_finds_its_jobs_by_the_primary_key(core: Settings) -> None:
    with changes("ops") as tx:
        transitions.create_ended(tx, rows(0, 200, 200, core.model_name, ended_days_ago=(2, 1)))
    body = JobCreate(prompt="held", lane="bulk", params={"max_tokens": 1})
    made = [jobs.new_job("t", body, core.model_name) for _ in range(3)]
    with changes("api") as tx:
        transitions.create(tx, made)
    executor = Worker(core).executor
    claims = executor.claim([job.id for job in made])
    assert len(claims) == 3
    for claim in claims:
        executor._held[claim.job_id] = claim.token
    before = executor.held()

    plans = sqlite_plans(Heartbeat(executor, core, {}).renew)

    for plan in plans:
        # SEARCH by the primary key's index, as many lookups as leases; a SCAN of jobs
        # reads every finished job the database holds.
        assert "SCAN jobs" not in plan, plan
        assert "SEARCH jobs USING INDEX sqlite_autoindex_jobs_1 (id=?)" in plan, plan
    assert executor.held() == before  # every lease renewed: none taken for lost
