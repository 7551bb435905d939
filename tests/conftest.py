"""Fixtures for real services: Redis and PostgreSQL on loopback, SQLite files in tmp dirs."""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.support import Receiver, Stack, running_stack

REDIS_BASE = os.environ.get("INFERQ_TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
# Databases 1-15 of the local Redis, handed out in turn: stacks that are alive at the same time
# (a module's shared stack and a test's own) must never share a queue.
_redis_dbs = itertools.cycle(range(1, 16))


def fresh_redis_url() -> str:
    url = f"{REDIS_BASE}/{next(_redis_dbs)}"
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {REDIS_BASE}: {exc}")
    client.flushdb()
    return url


PG_ADMIN_URL = os.environ.get(
    "INFERQ_TEST_PG_ADMIN_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@pytest.fixture
def redis_url() -> str:
    """A Redis database of its own, emptied for the test (never db 0)."""
    return fresh_redis_url()


class PostgresDatabases:
    """Creates throw-away databases on the local PostgreSQL server and drops them after."""

    def __init__(self) -> None:
        self.admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
        self.created: list[str] = []

    def create(self) -> str:
        name = f"inferq_test_{secrets.token_hex(4)}"
        with self.admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        self.created.append(name)
        return make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)

    def drop_all(self) -> None:
        with self.admin.connect() as conn:
            for name in self.created:
                conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        self.admin.dispose()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresDatabases]:
    databases = PostgresDatabases()
    try:
        with databases.admin.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        pytest.fail(f"PostgreSQL is required at {PG_ADMIN_URL}: {exc}")
    yield databases
    databases.drop_all()


def database_url_for(backend: str, tmp: Path, postgres: PostgresDatabases) -> str:
    if backend == "postgres":
        return postgres.create()
    return f"sqlite:///{tmp / 'inferq.db'}"


@contextlib.contextmanager
def backend_stack_for(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres: PostgresDatabases,
    name: str,
    **settings: Any,
) -> Iterator[Stack]:
    """A running stack on the database ``request.param`` names (sqlite or postgres)."""
    tmp = tmp_path_factory.mktemp(f"{name}-{request.param}")
    url = database_url_for(request.param, tmp, postgres)
    with running_stack(tmp, url, fresh_redis_url(), **settings) as stack:
        yield stack


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def backend_stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres: PostgresDatabases,
) -> Iterator[Stack]:
    """API + one simulated worker, on SQLite and on PostgreSQL (shared by a module's tests)."""
    with backend_stack_for(request, tmp_path_factory, postgres, "stack", sim_time_scale=0.2) as s:
        yield s


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    """A webhook receiver on loopback for a module's tests (each test uses its own paths)."""
    r = Receiver()
    try:
        yield r
    finally:
        r.close()
