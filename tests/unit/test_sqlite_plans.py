"""On SQLite, what runs per job or per look reads what is live, not the whole history of the
jobs table (issue 66).

On SQLite every write holds the one writer's lock (``BEGIN IMMEDIATE``, app/core/db.py), so a
statement that reads the history stalls every submission and claim behind it. A worker's lease
renewal named its jobs by ``(id, lease_token) IN (...)``, which SQLite answers by reading every
row: over a million finished jobs each heartbeat held the lock 250-285 ms, and the 16 clients'
calls that met it waited as long (the TTFT p99 of the ``history`` scenario, docs/benchmarks.md,
"Issue 66 ... ninth session"). SQLite keeps no statistics here, so the plan read on a few rows
is the plan on a million; PostgreSQL's plans are read on a large table in
tests/integration/test_query_plans.py.

And every look of tests/looks.py (submission, the job lists, the refill, the reaper, the
renewal, retention, ``inferq status``, /metrics, the console's pages) is counted, not only read:
SQLite's virtual machine instructions for each statement on the jobs table (a progress handler
called every ``STEP`` of them), on two databases that differ only in their history, one ten
times the other's. A statement that reads what is live does as much work on both; one that
reads the history does ten times as much (with the renewal's ``(id, lease_token) IN`` put
back, 5,040 and 41,040). Every other look did the same work on both, to the instruction;
retention too, in chunks (``SQLITE_CHUNK``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import event

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.settings import Settings
from bench.history import rows
from tests.looks import looks
from tests.support import ON_JOBS, sqlite_plans
from tests.unit.conftest import own_database
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


HISTORY = 500  # finished jobs on the smaller database; the larger holds ten times as many
LIVE = 40  # queued jobs on both, of which RUNNING are claimed and held by a worker
RUNNING = 5
STEP = 10  # instructions between two calls of the progress handler


def test_what_runs_per_look_does_no_more_work_over_ten_times_the_history(
    tmp_path: Path, migrated: Path
) -> None:
    small = _instructions(tmp_path / "small", migrated, HISTORY)
    large = _instructions(tmp_path / "large", migrated, 10 * HISTORY)
    assert set(large) == set(small)
    assert all(small.values()), small  # each ran a statement on the jobs table
    # A page (100 rows), the live jobs and a retention chunk are the same on both: what is
    # allowed to differ is noise (ids are random: an index's pages split differently), well
    # under the tenfold of a statement that reads the history.
    grew = {
        look: (small[look], large[look]) for look in small if large[look] > 2 * small[look] + 2_000
    }
    assert not grew, grew


def _instructions(data: Path, migrated: Path, history: int) -> dict[str, int]:
    """Each look's most expensive statement on the jobs table, in SQLite's instructions, on a
    database of ``history`` finished jobs and ``LIVE`` queued ones."""
    data.mkdir()
    # The newest 100 jobs a console search reads (docs/console.md): under the history.
    with own_database(data, migrated, console_search_window="100") as settings:
        with changes("ops") as tx:
            # Ended 61 to 1 days ago: half past the 30 days retention keeps by default, more than a
            # chunk of retention on both databases (SQLITE_CHUNK, app/core/lifecycle/retention.py).
            made = rows(0, history, history, settings.model_name, ended_days_ago=(61, 1))
            transitions.create_ended(tx, made)
        body = JobCreate(prompt="live", lane="bulk", params={"max_tokens": 1})
        live = [jobs.new_job("t", body, settings.model_name) for _ in range(LIVE)]
        with changes("api") as tx:
            transitions.create(tx, live)
        executor = Worker(settings).executor
        for claim in executor.claim([job.id for job in live[:RUNNING]]):
            executor._held[claim.job_id] = claim.token
        return {name: _most(look) for name, look in looks(settings, executor).items()}


def _most(look: Callable[[], Any]) -> int:
    """The most instructions one statement on the jobs table took while ``look()`` ran, its
    rows' fetching included (SQLite steps a query as its rows are read: they are counted to
    the statement until the next one starts)."""
    engine = db.get_engine()
    counts: list[int] = []
    counting = [False]

    def tick() -> int:
        if counting[0]:
            counts[-1] += STEP
        return 0  # go on

    def started(conn: Any, _cur: Any, statement: str, *_: Any) -> None:
        conn.connection.driver_connection.set_progress_handler(tick, STEP)
        counting[0] = bool(ON_JOBS.search(statement))
        counts.append(0)

    event.listen(engine, "before_cursor_execute", started)
    try:
        look()
    finally:
        event.remove(engine, "before_cursor_execute", started)
        counting[0] = False
    return max(counts, default=0)
