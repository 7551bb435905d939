"""Fixtures of the integration layer's in-process tests on a real database server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core import db
from app.core.settings import Settings
from tests.conftest import PostgresDatabases, database_url_for, fresh_redis_url
from tests.unit.conftest import environment


@pytest.fixture(params=["sqlite", "postgres"])
def migrated_settings(
    request: pytest.FixtureRequest, tmp_path: Path, postgres: PostgresDatabases
) -> Iterator[Settings]:
    """This process's settings on a migrated database of the test's own: a SQLite file, then
    a new PostgreSQL database, and a Redis database of its own."""
    url = database_url_for(request.param, tmp_path, postgres)
    with environment(
        data_dir=str(tmp_path), database_url=url, redis_url=fresh_redis_url()
    ) as settings:
        db.migrate()
        yield settings
