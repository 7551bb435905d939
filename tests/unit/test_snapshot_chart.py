"""The console's chart of finished jobs (snapshot.finished_per_minute) counts every job of a
minute, on SQLite and on PostgreSQL: a minute is the integer part of finished_at / 60, and a
minute's jobs of one lane add up (it once grouped by fractional minutes and kept only the
last group's count: 21 shown of 25 finished)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core import db
from app.core.db import session_scope
from app.core.models import Job, new_id
from app.core.observe import snapshot
from tests.conftest import PostgresDatabases, database_url_for
from tests.unit.conftest import environment

NOW = 1_795_000_000.0 - 1_795_000_000.0 % 60 + 30  # half past a minute


def finished(lane: str, at: float, tenant: str = "t") -> Job:
    return Job(
        id=new_id("job"),
        tenant=tenant,
        lane=lane,
        model="m",
        params={},
        meta={},
        status="succeeded",
        created_at=at - 1,
        updated_at=at,
        finished_at=at,
    )


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_every_finished_job_counts_in_its_minute(
    backend: str, tmp_path: Path, postgres: PostgresDatabases, redis_url: str
) -> None:
    this, last = NOW - 30, NOW - 90  # the current minute's start, the previous one's
    jobs = [finished("realtime", this + s) for s in (0.2, 7.5, 13.9, 29.0, 29.9)]
    jobs += [finished("bulk", this + s) for s in (1.0, 2.5)]
    # Whole seconds at a minute's edges: a double's CAST rounds on PostgreSQL and truncates on
    # SQLite (snapshot.py says so), so 59.9 s would be a second apart there.
    jobs += [finished("realtime", last + s) for s in (0.0, 59.0)]
    jobs += [finished("realtime", this + 3, tenant="other")]
    with environment(
        data_dir=str(tmp_path),
        database_url=database_url_for(backend, tmp_path, postgres),
        redis_url=redis_url,
    ):
        db.migrate()
        with session_scope() as session:
            session.add_all(jobs)
            session.commit()
            series = dict(snapshot.finished_per_minute(session, NOW, minutes=15))
            mine = dict(snapshot.finished_per_minute(session, NOW, minutes=15, tenant="t"))
    assert len(series) == 16
    assert series[this] == {"realtime": 6, "bulk": 2}
    assert series[last] == {"realtime": 2}
    assert mine[this] == {"realtime": 5, "bulk": 2}
    assert sum(sum(lanes.values()) for lanes in series.values()) == len(jobs)
