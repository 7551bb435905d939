"""Fixtures for real services: Redis and PostgreSQL on loopback, SQLite files in tmp dirs; and
how the slow layers share two cores under pytest-xdist (docs/development.md, "CI time").
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from tests.chaos.servers import RedisServer
from tests.support import Receiver, Stack, running_stack

REDIS_BASE = os.environ.get("INFERQ_TEST_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")
# Databases 1-15 of a Redis, handed out in turn: stacks that are alive at the same time (a
# module's shared stack and a test's own) must never share a queue.
_redis_dbs = itertools.cycle(range(1, 16))
# pytest-xdist's workers (.ci/run runs the slow layers in three): the first uses REDIS_BASE, each
# other one a redis-server of its own, so that every process still has fifteen databases to
# hand out and no two processes ever flush each other's. None outside xdist.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")


@functools.cache
def _redis_base() -> str:
    if XDIST_WORKER in (None, "gw0"):
        return REDIS_BASE
    folder = Path(tempfile.mkdtemp(prefix=f"inferq-redis-{XDIST_WORKER}-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # after close: LIFO
    server = RedisServer(folder)
    server.start()
    atexit.register(server.close)
    return server.url().rsplit("/", 1)[0]


def fresh_redis_url() -> str:
    url = f"{_redis_base()}/{next(_redis_dbs)}"
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


# --- the slow layers under pytest-xdist ---------------------------------------------------------
# .ci/run runs tests/integration with `-n 3 --dist loadfile --no-loadscope-reorder` (tests/chaos
# alone, after it): a module runs whole in one worker, so its shared stack starts once.
# The modules that take longest start first, so that none of them begins last and runs on alone
# (docs/development.md, "CI time", has their times); the others keep their order.
LONGEST_FIRST = (
    "tests/integration/test_engines.py",  # vLLM and transformers on the CPU
    "tests/integration/test_pooling_vllm.py",  # two pooling models on vLLM's CPU engine
    "tests/integration/test_conformance.py",  # a vllm serve beside an inferq stack on vLLM
    "tests/integration/test_bench_peer.py",  # the same, started by `inferq bench`, 3.5 minutes
    "tests/integration/test_webhooks.py",
    "tests/integration/test_fairshare.py",
    "tests/integration/test_schema_fuzz.py",
    "tests/integration/test_lifecycle.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker only: the longest modules first."""
    if XDIST_WORKER is None:
        return

    def rank(item: pytest.Item) -> int:
        name = item.nodeid.split("::")[0]
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: within a rank, collection order
