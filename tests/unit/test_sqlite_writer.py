"""SQLite's writer's lock as every transaction of inferq's takes it (``app/core/db.py``,
``_begin_immediate``): a writer queued behind another waits for it, tries again itself rather
than in SQLite's ever longer sleeps, and past its connection's busy timeout fails as SQLAlchemy
raises it, its connection left as it was. On a SQLite file of the test's own, a second writer
holding the lock from the standard library's own connection."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from app.core import db


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    made = db._sqlite_engine(f"sqlite:///{tmp_path / 'writer.db'}")
    with made.begin() as connection:
        connection.execute(text("CREATE TABLE seen (who TEXT, at REAL)"))
    yield made
    made.dispose()


def holder(engine: Engine) -> sqlite3.Connection:
    """Another writer, in a transaction that holds the lock until it ends."""
    other = sqlite3.connect(str(engine.url.database), isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    return other


def busy_timeout(engine: Engine) -> int:
    with engine.connect() as connection:
        return int(connection.exec_driver_sql("PRAGMA busy_timeout").scalar_one())


def test_a_writer_queued_behind_another_begins_once_it_ends(engine: Engine) -> None:
    other = holder(engine)
    began: list[float] = []

    def write() -> None:
        with engine.begin() as connection:
            began.append(time.monotonic())
            connection.execute(text("INSERT INTO seen VALUES ('queued', 0)"))

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.3)  # well past a try (SQLITE_TRY_MS): the writer is waiting, not failed
    assert writer.is_alive() and not began
    other.execute("INSERT INTO seen VALUES ('holder', 0)")
    released = time.monotonic()
    other.execute("COMMIT")
    writer.join(10)
    assert not writer.is_alive()
    assert began and began[0] >= released
    with engine.connect() as connection:
        assert connection.execute(text("SELECT who FROM seen ORDER BY rowid")).scalars().all() == [
            "holder",
            "queued",
        ]
    # Its statements keep SQLite's own wait, the whole of it.
    assert busy_timeout(engine) == db.SQLITE_BUSY_TIMEOUT_MS


def test_a_writer_waits_as_long_as_its_connection_says_then_fails_as_sqlalchemy_raises_it(
    engine: Engine,
) -> None:
    """A connection's own busy timeout bounds its wait (a worker's heartbeat sets one
    heartbeat's), and the connection keeps it."""
    other = holder(engine)
    try:
        with engine.connect() as connection:
            driver = connection.connection.driver_connection
            assert driver is not None
            driver.execute("PRAGMA busy_timeout = 300")
            waited = time.monotonic()
            with pytest.raises(OperationalError, match="locked"), connection.begin():
                connection.execute(text("INSERT INTO seen VALUES ('late', 0)"))
            assert 0.3 <= time.monotonic() - waited < db.SQLITE_BUSY_TIMEOUT_MS / 1000
            assert driver.execute("PRAGMA busy_timeout").fetchone()[0] == 300
            driver.execute(f"PRAGMA busy_timeout = {db.SQLITE_BUSY_TIMEOUT_MS}")
    finally:
        other.execute("ROLLBACK")
        other.close()
    # Nothing written; the pooled connection writes again.
    with engine.begin() as connection:
        assert connection.execute(text("SELECT count(*) FROM seen")).scalar_one() == 0
        connection.execute(text("INSERT INTO seen VALUES ('after', 0)"))
