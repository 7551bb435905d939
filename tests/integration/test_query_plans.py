"""On a database with a large history, what runs per job or per look reads what is live, not
the history (issue 66, docs/benchmarks.md), on PostgreSQL, whatever its statistics say.

A database with a history of finished jobs, analyzed, then a burst of queued jobs the
statistics do not know yet (autovacuum analyzes after a tenth of the table has changed): the
planner estimated one row for ``status = 'queued'`` and answered a claim from
``ix_jobs_status_lane``, walking the whole backlog for each message a worker took, and an
outcome write walked every running job (now ``models.status_is``). Each statement is run as
the worker runs it, under ``EXPLAIN ANALYZE`` and rolled back.

Then every statement of the paths that look at the jobs (the API's submission and its admission
checks, GET /v1/jobs, the dispatcher's refill and fair share, the reaper, a worker's lease
renewal, retention's sweep, `inferq status`, /metrics, the console's pages) is caught as it runs
and explained the same way, as it ran and as its generic plan (psycopg prepares a statement on
its fifth run, and PostgreSQL may then plan it without its parameters' values: ``status = $1``
read the whole table until the live counts said ``models.live``): no scan of the jobs table
reads more rows than there are live jobs and a page. The console's search of a text that no job
has reads its window of the scope's newest jobs (``console_search_window``, here fewer than the
live jobs), not every job of the scope (docs/console.md).

And what a job's deletion deletes with it (``models.HANGING_ON_A_JOB``, and what a remaining
foreign key cascades to) is found by an index: without one, each job retention deletes read the
whole referencing table (idempotency keys had none).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Connection, event, text

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.models import HANGING_ON_A_JOB
from app.core.settings import Settings
from bench.history import rows
from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.looks import looks as every_look
from tests.unit.conftest import environment
from tests.unit.inprocess import Worker

# Finished jobs, analyzed: enough that reading them all is never the planner's cheap way to a
# few hundred rows (at 20,000 a reclaim of 500 ids by an IN list was a sequential scan).
HISTORY = 100_000
BACKLOG = 3_000  # queued jobs after the ANALYZE
RUNNING = 500  # of them claimed
CLAIM = 256  # ids a claim names (CEILING_CHUNK's size of message)
SEARCH_WINDOW = 2_000  # jobs a console search reads a page (under BACKLOG: the bound below)
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
    url = postgres.create()
    with environment(
        database_url=url,
        redis_url=fresh_redis_url(),
        require_auth="false",
        console_search_window=str(SEARCH_WINDOW),
    ) as settings:
        db.migrate()
        for offset in range(0, HISTORY, 20_000):
            with changes("ops") as tx:
                made = rows(
                    offset, 20_000, HISTORY, settings.model_name, ended_days_ago=(20.0, 1.0)
                )
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


def explain(connection: Connection, sql: str, parameters: Any) -> dict[str, Any]:
    """The executed plan of ``sql`` with its driver's ``parameters`` (rolled back)."""
    found = connection.exec_driver_sql("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, parameters)
    tree = found.scalar_one()
    connection.rollback()
    plan: dict[str, Any] = (json.loads(tree) if isinstance(tree, str) else tree)[0]["Plan"]
    return plan


_PLACEHOLDER = re.compile(r"%\((\w+)\)s")


def explain_generic(connection: Connection, sql: str, parameters: Any) -> dict[str, Any]:
    """The executed plan of ``sql`` as a prepared statement's generic plan: planned without
    its parameters' values, as psycopg's prepared statements may be after their fifth run
    (``plan_cache_mode = force_generic_plan``; rolled back, deallocated)."""
    import psycopg.sql

    names: list[str] = []

    def number(found: re.Match[str]) -> str:
        if found.group(1) not in names:
            names.append(found.group(1))
        return f"${names.index(found.group(1)) + 1}"

    prepared = _PLACEHOLDER.sub(number, sql)  # its %% stay: the driver reads them as %
    raw = connection.connection.driver_connection
    values = ", ".join(psycopg.sql.Literal(parameters[n]).as_string(raw) for n in names)
    values = values.replace("%", "%%")  # the driver reads the text's % as its placeholders
    connection.exec_driver_sql("SET plan_cache_mode = force_generic_plan")
    connection.exec_driver_sql(f"PREPARE look AS {prepared}")
    try:
        return explain(connection, f"EXECUTE look({values})" if names else "EXECUTE look", {})
    finally:
        connection.rollback()  # a PREPARE outlives its transaction: deallocated apart
        connection.exec_driver_sql("DEALLOCATE look")
        connection.rollback()


def plan(connection: Connection, statement: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The executed plan of ``statement`` bound to ``params`` (rolled back)."""
    compiled = statement.compile(dialect=connection.dialect)
    return explain(connection, str(compiled), compiled.construct_params(params))


def scans(node: dict[str, Any]) -> list[tuple[str | None, str, str | None, int]]:
    """Every node of the plan that reads a table or an index: (table, node type, index, rows
    it read over all its loops). A bitmap's index scan names its index but no table."""
    found = []
    if "Scan" in node["Node Type"] or "Relation Name" in node:
        read = node["Actual Rows"] + node.get("Rows Removed by Filter", 0)
        read += node.get("Rows Removed by Index Recheck", 0)
        found.append(
            (
                node.get("Relation Name"),
                node["Node Type"],
                node.get("Index Name"),
                read * node["Actual Loops"],
            )
        )
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
        assert {index for _, _, index, _ in found if index} == {"jobs_pkey"}, found
        assert max(read for _, _, _, read in found) == named, found


def test_what_runs_per_job_or_per_look_reads_what_is_live(history: Settings) -> None:
    engine = db.get_engine()
    caught: list[tuple[str, str, Any]] = []
    # A worker holding the running jobs' leases, whose heartbeat renews them all.
    executor = Worker(history).executor
    with engine.connect() as connection:
        held = connection.execute(text("SELECT id, lease_token FROM jobs WHERE status = 'running'"))
        executor._held.update((row.id, row.lease_token) for row in held)

    def catch(
        _conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, many: bool
    ) -> None:
        head = statement.lstrip().split(None, 1)[0].upper()
        if not many and head in ("SELECT", "UPDATE", "DELETE", "WITH") and " jobs" in statement:
            caught.append((looking[0], statement, parameters))

    looking = [""]  # the look whose statements are being caught
    looks = every_look(history, executor)
    event.listen(engine, "before_cursor_execute", catch)
    try:
        for name, look in looks.items():
            looking[0] = name
            look()
    finally:
        event.remove(engine, "before_cursor_execute", catch)
    assert {w for w, _, _ in caught} >= set(looks) - {"retention"}, "a look ran no statement"

    live = BACKLOG + 1  # the jobs not finished, the one submitted here included
    page = 100  # the most rows a page or a chunk asks for
    over = []
    with engine.connect() as connection:
        for look, statement, parameters in caught:
            for plans in (explain, explain_generic):
                for table, kind, index, read in scans(plans(connection, statement, parameters)):
                    if table == "jobs" and read > live + page:
                        over.append((look, plans.__name__, kind, index, read, statement[:300]))
    assert not over, "\n".join(map(str, over))


def test_what_a_deleted_job_takes_with_it_is_found_by_an_index(
    postgres: PostgresDatabases,
) -> None:
    with environment(database_url=postgres.create()):
        db.migrate()
        with db.get_engine().connect() as connection:
            # The leading column of each index, by table.
            indexed = set(
                connection.execute(
                    text(
                        """
                        SELECT i.indrelid::regclass::text, a.attname
                        FROM pg_index i
                        JOIN pg_attribute a
                          ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                        """
                    )
                ).tuples()
            )
            cascading = connection.execute(
                text(
                    """
                    SELECT c.conrelid::regclass::text, a.attname
                    FROM pg_constraint c
                    JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = c.conkey[1]
                    WHERE c.contype = 'f' AND c.confdeltype = 'c'
                    """
                )
            ).tuples()
            deleted_by = [(c.class_.__tablename__, c.key) for c in HANGING_ON_A_JOB]
            owed = [*deleted_by, *cascading]
        db.dispose()
    assert ("idempotency_keys", "job_id") in owed and ("webhook_attempts", "event_id") in owed
    assert [key for key in owed if key not in indexed] == []
