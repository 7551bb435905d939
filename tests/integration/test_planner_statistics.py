"""What keeps PostgreSQL's plans right while the jobs table grows fast, on a real server.

- ``models.among`` writes an id list as one array on PostgreSQL: one statement (and one
  prepared plan) for every length, the rows of an IN on SQLite;
- ``db.refresh_statistics`` analyzes the jobs table once its rows have changed by more than
  autovacuum's rule allows, and only then (docs/architecture.md, "Plans on a growing table").
"""

from __future__ import annotations

import pytest
from sqlalchemy import select, text

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.after import After, Tx
from app.core.models import Job, JobStatus, among, now
from app.core.settings import Settings


@pytest.fixture
def settings(migrated_settings: Settings) -> Settings:
    """On SQLite, then on PostgreSQL (tests/integration/conftest.py)."""
    return migrated_settings


def add(settings: Settings, n: int) -> list[str]:
    made = [
        jobs.new_job("t", JobCreate(prompt=f"p{i}", lane="bulk"), settings.model_name)
        for i in range(n)
    ]
    with db.transaction() as connection:
        transitions.create(Tx(connection, After("api")), made)
        if connection.dialect.name == "postgresql":
            # The server counts a backend's changes when it next reports them (at most every
            # second, or when idle): report them with this transaction.
            connection.execute(text("SELECT pg_stat_force_next_flush()"))
    return [job.id for job in made]


def test_an_id_list_is_one_statement_for_every_length_on_postgresql(settings: Settings) -> None:
    ids = add(settings, 6)
    with db.transaction() as connection:
        pg = connection.dialect.name == "postgresql"
        found = {
            n: set(
                connection.execute(
                    select(Job.id).where(among(Job.id, ids[:n], postgresql=pg))
                ).scalars()
            )
            for n in (1, 3, 5)
        }
        written = {
            n: str(select(Job.id).where(among(Job.id, ids[:n], postgresql=pg)).compile(connection))
            for n in (3, 5)
        }
    assert found == {n: set(ids[:n]) for n in (1, 3, 5)}
    # PostgreSQL: the same text (one prepared statement, one plan) whatever the length; SQLite
    # renders an IN of the values at execution.
    if pg:
        assert written[3] == written[5]
        assert "= ANY (" in written[3]


def test_a_claim_of_several_jobs_takes_them_on_either_database(settings: Settings) -> None:
    ids = add(settings, 5)
    with db.transaction() as connection:
        rows = transitions.claim(
            Tx(connection, After("worker")), ids[1:4], worker="w", lease_s=60, stamp=now()
        )
    assert [row.id for row in rows] == ids[1:4]
    with db.transaction() as connection:
        status = dict(connection.execute(select(Job.id, Job.status)).all())  # type: ignore[arg-type]
    assert [status[i] for i in ids] == [
        JobStatus.QUEUED,
        JobStatus.RUNNING,
        JobStatus.RUNNING,
        JobStatus.RUNNING,
        JobStatus.QUEUED,
    ]


def _analyzed_rows() -> float:
    with db.transaction() as connection:
        return float(
            connection.execute(
                text("SELECT reltuples FROM pg_class WHERE oid = to_regclass('jobs')")
            ).scalar_one()
        )


def test_the_jobs_table_is_analyzed_once_it_has_grown(settings: Settings) -> None:
    if not settings.sqlalchemy_url.startswith("postgresql"):
        assert db.refresh_statistics() == []  # SQLite: nothing to do
        return
    with db.transaction() as connection:  # autovacuum's own analyze would race with ours
        connection.execute(text("ALTER TABLE jobs SET (autovacuum_enabled = false)"))
    add(settings, 200)
    assert db.refresh_statistics() == []  # 200 changes: within the rule (1,000 + 10 %)
    assert _analyzed_rows() <= 0  # never analyzed (-1), as a new table is
    add(settings, 1200)
    assert db.refresh_statistics() == ["jobs"]
    assert _analyzed_rows() == 1400  # the planner now knows the table's size
    assert db.refresh_statistics() == []  # fresh: not analyzed again
