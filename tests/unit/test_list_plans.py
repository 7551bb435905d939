"""A page of jobs, filtered by what an index holds in id order, is read from that index on
SQLite: no sort of every job that matches (issue 66, migrations/versions/0017).

SQLite keeps no statistics here, so its plan for a statement is the same on ten rows as on ten
million: the plans read on a few rows are the plans of a month of history. Before 0017 a
status filter found its rows through ``(status, lane)`` and sorted them all for each page
(``USE TEMP B-TREE FOR ORDER BY``): 1.7 s for ``/console/jobs?status=succeeded`` over a million
finished jobs (docs/benchmarks.md, "Issue 66 ... seventh session"). PostgreSQL's plans, which
follow its statistics, are read on a large table in tests/integration/test_query_plans.py
(PostgreSQL keeps its own status indexes: ``models.ONE_DATABASE``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from app.core import db
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.models import ONE_DATABASE, Base, built_here
from app.core.settings import Settings
from bench.history import TENANTS, rows
from tests.support import sqlite_plans

FILTERS: list[dict[str, Any]] = [
    {"tenant": None, "status": "succeeded"},
    {"tenant": None, "status": "failed"},
    {"tenant": TENANTS[3], "status": None},
    {"tenant": TENANTS[3], "status": "succeeded"},
    {"tenant": TENANTS[3], "status": "queued"},
]


def _plan(filters: dict[str, Any]) -> list[str]:
    """The query plan of each statement of the jobs table that ``list_page`` runs."""
    listed: list[Any] = []

    def page() -> None:
        with db.session_scope() as session:
            listed.append(jobs.list_page(session, limit=20, after=None, lane=None, **filters))

    plans = sqlite_plans(page)
    assert listed[0].rows or filters["status"] in {"failed", "queued"}
    return plans


@pytest.mark.parametrize("filters", FILTERS, ids=lambda f: f"{f['tenant']}-{f['status']}")
def test_a_page_of_jobs_is_read_in_order_from_an_index(
    core: Settings, filters: dict[str, Any]
) -> None:
    made = rows(0, 200, 200, core.model_name, ended_days_ago=(2.0, 1.0))
    with changes("ops") as tx:
        transitions.create_ended(tx, made)
    for plan in _plan(filters):
        # Searched by every filter the page names, in the index's order: a status none of
        # the tenant's jobs has reads nothing (before 0017 it walked the tenant's whole history).
        assert "TEMP B-TREE" not in plan, plan
        for column in ("tenant", "status"):
            if filters[column] is not None:
                assert f"{column}=?" in plan, plan


def test_a_migrated_sqlite_file_has_the_indexes_the_models_declare_for_it(migrated: Path) -> None:
    engine = create_engine(f"sqlite:///{migrated}")
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(
                connection, opts={"include_object": built_here("sqlite")}
            )
            assert compare_metadata(context, Base.metadata) == []
            indexes = {index["name"] for index in inspect(connection).get_indexes("jobs")}
    finally:
        engine.dispose()
    for name, (dialect, _) in ONE_DATABASE.items():
        assert (name in indexes) == (dialect == "sqlite"), (name, indexes)
