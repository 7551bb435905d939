"""`inferq migrate` on an empty PostgreSQL database, and the migration matches the models; a
migration that rebuilds tables keeps their rows."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, insert, inspect, text

from app.core import db
from app.core.lifecycle import transitions
from app.core.lifecycle.changes import changes
from app.core.models import (
    Base,
    IdempotencyKey,
    Job,
    StoredResponse,
    WebhookAttempt,
    WebhookEvent,
    built_here,
)
from bench.history import rows
from tests.conftest import PostgresDatabases, database_url_for, fresh_redis_url
from tests.support import Stack
from tests.unit.conftest import environment


def test_migrate_creates_the_schema_on_empty_postgres(
    tmp_path: Path, postgres: PostgresDatabases
) -> None:
    url = postgres.create()
    engine = create_engine(url)
    assert inspect(engine).get_table_names() == []
    stack = Stack(tmp_path, url, fresh_redis_url())
    first = stack.cli("migrate")
    assert first.returncode == 0, first.stderr
    assert "database at head" in first.stdout
    assert set(inspect(engine).get_table_names()) == {
        "alembic_version",
        "api_keys",
        "jobs",
        "idempotency_keys",
        "webhook_endpoints",
        "responses",
        "webhook_events",
        "webhook_attempts",
        "files",
        "batches",
        "tenants",
    }
    with engine.connect() as conn:
        head = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
        # No drift: what the migrations built is exactly what the models declare (for this
        # database: models.ONE_DATABASE).
        context = MigrationContext.configure(
            conn, opts={"include_object": built_here(conn.dialect.name)}
        )
        assert compare_metadata(context, Base.metadata) == []
    again = stack.cli("migrate")
    assert again.returncode == 0, again.stderr
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
    engine.dispose()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_0016_drops_the_keys_to_jobs_and_keeps_every_row(
    backend: str, tmp_path: Path, postgres: PostgresDatabases
) -> None:
    """What hangs on a job loses its foreign key to ``jobs`` (``delete_finished`` deletes it),
    and nothing is lost on the way: on SQLite the tables are rebuilt, and dropping the old
    ``webhook_events`` with foreign keys on would take its attempts with it."""
    url = database_url_for(backend, tmp_path, postgres)
    with environment(data_dir=str(tmp_path), database_url=url, redis_url=fresh_redis_url()):
        db.migrate("0015")
        job = rows(0, 1, 1, "m", ended_days_ago=(1.0, 1.0))[0]
        with changes("ops") as tx:
            transitions.create_ended(tx, [job])
            tx.connection.execute(insert(IdempotencyKey), [KEY | {"job_id": job["id"]}])
            tx.connection.execute(insert(StoredResponse), [RESPONSE | {"job_id": job["id"]}])
            tx.connection.execute(insert(WebhookEvent), [EVENT | {"job_id": job["id"]}])
            tx.connection.execute(insert(WebhookAttempt), [ATTEMPT])
        db.migrate()
        engine = db.get_engine()
        tables = ["idempotency_keys", "responses", "webhook_events", "webhook_attempts"]
        with engine.connect() as connection:
            counts = [
                connection.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in tables
            ]
            if backend == "sqlite":  # foreign keys are on again for what comes next
                assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert counts == [1, 1, 1, 1]
        referred = {
            t: [k["referred_table"] for k in inspect(engine).get_foreign_keys(t)] for t in tables
        }
        assert referred == {
            "idempotency_keys": [],
            "responses": [],
            "webhook_events": ["webhook_endpoints"],
            "webhook_attempts": ["webhook_events"],
        }
        # And delete_finished takes them all with the job.
        with changes("ops") as tx:
            assert transitions.delete_finished(tx, Job.id == job["id"]) == [
                transitions.Deleted(job["tenant"], job["id"], 1)
            ]
        with engine.connect() as connection:
            counts = [
                connection.execute(text(f"SELECT count(*) FROM {t}")).scalar() for t in tables
            ]
        assert counts == [0, 0, 0, 0]
        db.dispose()


KEY = {"tenant": "t", "key": "k", "request_hash": "h", "created_at": 0.0, "expires_at": 1.0}
RESPONSE = {
    "id": "resp_1",
    "tenant": "t",
    "request": "{}",
    "input": "[]",
    "context": "[]",
    "service_tier": "default",
    "background": False,
    "created_at": 0.0,
}
EVENT = {
    "id": "evt_1",
    "tenant": "t",
    "type": "job.succeeded",
    "url": "http://127.0.0.1:9/hook",
    "occurred_at": 0.0,
    "status": "failed",
    "attempts": 1,
    "round_attempts": 1,
    "created_at": 0.0,
    "updated_at": 0.0,
}
ATTEMPT = {
    "id": "att_1",
    "event_id": "evt_1",
    "number": 1,
    "kind": "scheduled",
    "url": "http://127.0.0.1:9/hook",
    "started_at": 0.0,
    "ok": False,
}
