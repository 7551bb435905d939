"""`inferq migrate` on an empty PostgreSQL database, and the migration matches the models."""

from __future__ import annotations

from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from app.core.models import Base
from tests.conftest import PostgresDatabases, fresh_redis_url
from tests.support import Stack


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
        # No drift: what the migrations built is exactly what the models declare.
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    again = stack.cli("migrate")
    assert again.returncode == 0, again.stderr
    with engine.connect() as conn:
        assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head
    engine.dispose()
