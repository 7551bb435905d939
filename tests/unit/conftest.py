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
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core import db
from app.core.messaging import clients
from app.core.settings import Settings, get_settings
from tests.conftest import fresh_redis_url


def _forget() -> None:
    get_settings.cache_clear()
    clients.reset()
    db.dispose()


@contextlib.contextmanager
def environment(**values: str) -> Iterator[Settings]:
    """``INFERQ_<NAME>=value`` for each of ``values`` while the block runs, with everything
    built from the settings before dropped on the way in and out."""
    saved = {}
    for name, value in values.items():
        key = f"INFERQ_{name.upper()}"
        saved[key] = os.environ.get(key)
        os.environ[key] = value
    _forget()
    try:
        yield get_settings()
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        _forget()


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
    shutil.copy(migrated, tmp_path / "inferq.db")
    with environment(
        data_dir=str(tmp_path),
        database_url="",
        redis_url=fresh_redis_url(),
        require_auth="false",
        model_wait_s="0.5",
    ) as settings:
        yield settings
