"""The statements that name their jobs by id take the primary key on PostgreSQL, whatever its
statistics say (``models.status_is``; issue 66, docs/benchmarks.md).

A database with a history of finished jobs, analyzed, then a burst of queued jobs the
statistics do not know yet (autovacuum analyzes after a tenth of the table has changed): the
planner estimated one row for ``status = 'queued'`` and answered a claim from
``ix_jobs_status_lane``, walking the whole backlog for each message a worker took, and an
outcome write walked every running job. Each statement is run as the worker runs it, under
``EXPLAIN ANALYZE`` and rolled back.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, text

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.settings import Settings
from bench.history import rows
from tests.conftest import PostgresDatabases
from tests.unit.conftest import environment

HISTORY = 20_000  # finished jobs, analyzed
BACKLOG = 3_000  # queued jobs after the ANALYZE
RUNNING = 500  # of them claimed
CLAIM = 256  # ids a claim names (CEILING_CHUNK's size of message)
OUTCOME_NULLS = [
    "b_error_code",
    "b_error_message",
    "b_result_text",
    "b_finish_reason",
    "b_choices",
    "b_prompt_tokens",
    "b_completion_tokens",
    "b_first_token_at",
    "b_pooled",
    "b_pooled_width",
    "b_line_results",
]


@pytest.fixture
def history(postgres: PostgresDatabases) -> Iterator[Settings]:
    with environment(database_url=postgres.create()) as settings:
        db.migrate()
        for offset in range(0, HISTORY, 5000):
            with changes("ops") as tx:
                made = rows(5000, settings.model_name, ended_days_ago=(20.0, 1.0), seed=offset)
                transitions.create_ended(tx, made)
        with db.get_engine().connect() as connection:
            connection.execution_options(isolation_level="AUTOCOMMIT").execute(
                text("VACUUM (ANALYZE) jobs")
            )
        body = JobCreate(prompt="a burst", lane="bulk", params={"max_tokens": 1})
        with changes("api") as tx:
            transitions.create(
                tx, [jobs.new_job("t", body, settings.model_name) for _ in range(BACKLOG)]
            )
        with changes("worker") as tx:
            ids = [r[0] for r in tx.connection.execute(text(_QUEUED), {"n": RUNNING})]
            transitions.claim(tx, ids, worker="w", lease_s=60, stamp=1.0)
        yield settings
        db.dispose()


_QUEUED = "SELECT id FROM jobs WHERE status = 'queued' ORDER BY id LIMIT :n"


def plan(connection: Connection, statement: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The executed plan of ``statement`` (rolled back)."""
    compiled = statement.compile(dialect=connection.dialect)
    found = connection.exec_driver_sql(
        "EXPLAIN (ANALYZE, FORMAT JSON) " + str(compiled), compiled.construct_params(params)
    ).scalar_one()
    connection.rollback()
    tree: dict[str, Any] = (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]
    return tree


def scans(node: dict[str, Any]) -> list[tuple[str, str | None, int]]:
    """Every scan of the plan: (node type, index, rows it read)."""
    found = []
    if "Scan" in node["Node Type"]:
        read = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        found.append((node["Node Type"], node.get("Index Name"), read))
    for child in node.get("Plans", []):
        found += scans(child)
    return found


def test_a_claim_and_an_outcome_write_take_the_primary_key_after_a_burst(
    history: Settings,
) -> None:
    with db.get_engine().connect() as connection:
        queued = [r[0] for r in connection.execute(text(_QUEUED), {"n": CLAIM})]
        running = connection.execute(
            text("SELECT id, lease_token FROM jobs WHERE status = 'running' LIMIT 1")
        ).one()
        connection.rollback()
        claim = plan(
            connection,
            transitions._CLAIM_MANY[True],
            {"b_ids": queued, "b_worker": "w", "b_lease": 9e9, "b_stamp": 2.0},
        )
        outcome = plan(
            connection,
            transitions._RECORD_ONE,
            {
                **dict.fromkeys(OUTCOME_NULLS),
                "b_id": running.id,
                "b_token": running.lease_token,
                "b_status": "succeeded",
                "b_stamp": 3.0,
                "b_failed_lines": 0,
            },
        )
    for statement, named in ((claim, CLAIM), (outcome, 1)):
        found = scans(statement)
        # Its own rows through jobs_pkey, not the backlog (or every running job) behind
        # ix_jobs_status_lane: no scan reads more rows than the statement names.
        assert {index for _, index, _ in found if index} == {"jobs_pkey"}, found
        assert max(read for _, _, read in found) == named, found
