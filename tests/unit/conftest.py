"""The fast layer's fixtures: everything in this process, on a real SQLite file and a real Redis.

No process is started for these: the API is called in process (``httpx.ASGITransport``), the
owners of state, the relay, the limits and the dispatcher's plan directly. Each test that
needs a database gets a SQLite file of its own (a copy of one migrated once per session) and a
Redis database of its own, and the process's clients and what it read through them are dropped
before and after it (``get_settings.cache_clear``, ``clients.reset``, ``db.dispose``: the
functions made for it, docs/architecture.md, "Settings").
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core import db
from app.core.processes.environment import environment
from app.core.settings import Settings
from tests.conftest import fresh_redis_url


@pytest.fixture(scope="session")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite file migrated to the head revision, once (tests copy it)."""
    data = tmp_path_factory.mktemp("migrated")
    with environment(data_dir=str(data), database_url=""):
        db.migrate()
    return data / "inferq.db"


@pytest.fixture
def core(tmp_path: Path, migrated: Path) -> Iterator[Settings]:
    """Settings on a SQLite file of this test's own and a Redis database of its own; the
    API's keys are off (the tests that check them turn them on)."""
    with own_database(tmp_path, migrated) as settings:
        yield settings


@contextlib.contextmanager
def own_database(data: Path, migrated: Path, **settings: str) -> Iterator[Settings]:
    """Settings on a copy of the ``migrated`` SQLite file in ``data`` and a Redis database of
    its own, the API's keys off, and ``settings`` (INFERQ_ names, lowercase, without the
    prefix): what :func:`core` gives a test, for a test that needs more than one."""
    shutil.copy(migrated, data / "inferq.db")
    with environment(
        **{
            "data_dir": str(data),
            "database_url": "",
            "redis_url": fresh_redis_url(),
            "require_auth": "false",
            "model_wait_s": "0.5",
            **settings,
        }
    ) as made:
        yield made
