"""The one owner of the SQLAlchemy engine and sessions.

The API takes a session per request (``app/api/deps.py``, from :func:`new_session`); workers
and the CLI use :func:`session_scope`, which commits or rolls back (:func:`transaction` where
Core statements need no session), and wrap work that must outlive a database outage in
:func:`with_db_retry`. SQLite runs in WAL mode and starts every
transaction with ``BEGIN IMMEDIATE``: with many writer threads and processes, a deferred
transaction that reads and then writes fails at once with SQLITE_BUSY instead of waiting, while
an immediate one waits for ``busy_timeout``. That makes SQLite the single-writer path.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, Table, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from app.core.models import pg_json_dumps, pg_json_loads
from app.core.settings import get_settings

log = logging.getLogger("inferq.db")
T = TypeVar("T")

_lock = threading.Lock()
_engine: Engine | None = None
_sessionmaker: sessionmaker[Session] | None = None

SQLITE_BUSY_TIMEOUT_MS = 30_000


def _sqlite_engine(url: str) -> Engine:
    database = make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        pool_size=20,
        max_overflow=40,
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite so that "begin" below decides.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        # Not where the caller asked for none: a migration's autocommit block runs what SQLite
        # reads only outside a transaction (PRAGMA foreign_keys; migrations/versions/0016).
        if connection.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
            _begin_immediate(connection.connection.dbapi_connection)

    return engine


# How long one try at the writer's lock waits inside SQLite before this module tries again.
SQLITE_TRY_MS = 2


def _begin_immediate(dbapi_connection: Any) -> None:
    """``BEGIN IMMEDIATE``, tried again every ``SQLITE_TRY_MS`` until the connection's own busy
    timeout has passed (``SQLITE_BUSY_TIMEOUT_MS``, or what its user set: a worker's heartbeat
    waits one heartbeat, workers/inference/heartbeat.py), which it keeps.

    Not SQLite's own wait (``busy_timeout``) for the lock: its handler sleeps ever longer
    between tries (1, 2, 5, 10, 15, 20, 25 ... 100 ms: ``sqliteDefaultBusyCallback``), so a
    writer queued behind a 30 ms transaction woke up to 50 ms after the lock was free, and the
    writers behind it later still: beside retention's sweep the submissions' TTFT p99 rose to
    400-500 ms in bursts (docs/benchmarks.md, "Issue 66 ... sixth session"). Here a waiting
    writer's tries are at most ``SQLITE_TRY_MS`` apart, each inside SQLite (its first sleeps of
    1 ms)."""
    cursor = dbapi_connection.cursor()
    wait_ms = int(cursor.execute("PRAGMA busy_timeout").fetchone()[0])
    deadline = time.monotonic() + wait_ms / 1000
    try:
        cursor.execute(f"PRAGMA busy_timeout={min(SQLITE_TRY_MS, wait_ms)}")
        while True:
            try:
                cursor.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    # As SQLAlchemy raises it: what callers catch (with_db_retry, the sweep).
                    raise OperationalError("BEGIN IMMEDIATE", None, exc) from exc
    finally:
        cursor.execute(f"PRAGMA busy_timeout={wait_ms}")
        cursor.close()


def get_engine() -> Engine:
    """Return the process-wide engine, creating it on first use."""
    global _engine, _sessionmaker
    with _lock:
        if _engine is None:
            settings = get_settings()
            url = settings.sqlalchemy_url
            if url.startswith("sqlite"):
                _engine = _sqlite_engine(url)
            else:
                _engine = create_engine(
                    url,
                    pool_pre_ping=True,
                    pool_size=20,
                    max_overflow=40,
                    pool_timeout=settings.dependency_timeout_s * 5,
                    connect_args=_connect_args(
                        url, settings.dependency_timeout_s, settings.lease_ttl_s
                    ),
                    # jsonb refuses NUL: strings are escaped (app/core/models.py, ESCAPE).
                    json_serializer=pg_json_dumps,
                    json_deserializer=pg_json_loads,
                )
            _sessionmaker = sessionmaker(_engine, expire_on_commit=False)
        return _engine


def _connect_args(url: str, timeout_s: float, lease_s: float) -> dict[str, Any]:
    if make_url(url).get_backend_name() == "postgresql":
        # No transaction here waits on anything but the database, so one left idle for a
        # lease is a paused or cut-off process's: the server ends it, freeing the rows it
        # locked (a paused worker mid-claim would otherwise block the reaper on them).
        idle_ms = max(1000, int(lease_s * 1000))
        return {
            "connect_timeout": max(1, int(timeout_s)),
            "options": f"-c idle_in_transaction_session_timeout={idle_ms}",
        }
    return {}


def _factory() -> sessionmaker[Session]:
    get_engine()
    assert _sessionmaker is not None
    return _sessionmaker


@contextmanager
def transaction() -> Iterator[Connection]:
    """A Core transaction (commit on success, roll back on error): for the statements of the
    hot paths (claims, outcomes, stamps), which need no ORM session around them."""
    with get_engine().begin() as connection:
        yield connection


@contextmanager
def session_scope() -> Iterator[Session]:
    """A unit of work: commit on success, roll back on error, always close."""
    session = _factory()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def new_session() -> Session:
    """A session the caller closes (the API's per-request dependency)."""
    return _factory()()


def with_db_retry(fn: Callable[[], T], what: str, stop: threading.Event | None = None) -> T:
    """Run ``fn`` until the database answers: workers pause while it is down (docs/reliability.md,
    "Reliability contract"), acknowledging nothing that is not committed."""
    delay = 0.2
    while True:
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            if stop is not None and stop.is_set():
                raise
            log.warning(
                "database unavailable during %s, retrying in %.1fs: %s",
                what,
                delay,
                exc.orig if hasattr(exc, "orig") else exc,
            )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


# The tables whose statistics are kept fresh by :func:`refresh_statistics`, and its rule: one
# whose rows changed by more than ``STATS_BASE + STATS_FRACTION * live rows`` since its last
# ANALYZE is analyzed again (autovacuum's own rule, with its defaults of 50 and 0.1).
ANALYZED = ("jobs",)
STATS_BASE = 1000
STATS_FRACTION = 0.1


def refresh_statistics() -> list[str]:
    """On PostgreSQL, ANALYZE the tables of ``ANALYZED`` whose statistics are stale; returns
    them. Nothing on SQLite.

    Why not leave it to autovacuum: it looks at a database once a minute
    (``autovacuum_naptime``), and the jobs table grows by thousands of rows a second. Until it
    is analyzed, the planner takes it for as small as it was, and a statement planned then
    keeps its plan in the connection that prepared it (psycopg prepares a statement run five
    times): a fenced outcome write, ``id = $1 AND status = $3``, planned while the table was
    nearly empty walks the status index over every running job, for every row it writes.
    Measured with the `ceiling` scenario on a new database: the worker's connections spent
    2.2 s of server CPU with the table analyzed every 2 s, 30.8 s without (docs/benchmarks.md,
    "Issue 65"). An ANALYZE reads a sample (300 times the statistics target in rows, not the table),
    takes a lock that neither reads nor writes wait for, and skips a table another session is
    analyzing (``SKIP_LOCKED``), so several dispatchers calling this cost nothing more.
    """
    engine = get_engine()
    if engine.dialect.name != "postgresql":
        return []
    with engine.connect() as connection:
        stale = [
            name
            for name in ANALYZED
            if connection.execute(
                text(
                    "SELECT n_mod_since_analyze > :base + :fraction * n_live_tup"
                    " FROM pg_stat_user_tables WHERE relid = to_regclass(:name)"
                ),
                {"base": STATS_BASE, "fraction": STATS_FRACTION, "name": name},
            ).scalar()
        ]
        for name in stale:
            connection.execute(text(f'ANALYZE (SKIP_LOCKED) "{name}"'))
        connection.commit()
    return stale


def copy_rows(connection: Connection, table: Table, rows: Sequence[dict[str, Any]]) -> None:
    """Insert ``rows`` (dicts of the same columns) into ``table`` with PostgreSQL's ``COPY ...
    FROM STDIN``, in ``connection``'s transaction: what an executemany INSERT writes, each value
    through its column's type as an INSERT binds it (the escapes of app/core/models.py, JSON),
    and the columns a row leaves out given their defaults as the ORM would.

    An executemany INSERT is a statement per row on the server (psycopg's pipeline); COPY is one
    stream. Measured on 20,000 jobs in chunks of 250: the server's CPU 0.071 → 0.019 ms a row,
    the caller's 0.113 → 0.036 (docs/benchmarks.md, "Issue 65"). Errors are raised as
    SQLAlchemy's, as an INSERT's would be (``OperationalError`` when the server is gone, which
    ``with_db_retry`` waits out; ``IntegrityError``).
    """
    if not rows:
        return
    defaults: dict[str, Any] = {}
    for column in table.c:
        if column.name in rows[0] or column.default is None:
            continue
        if not column.default.is_scalar:
            raise ValueError(f"{table.name}.{column.name}: a default COPY cannot write")
        defaults[column.name] = column.default.arg  # type: ignore[attr-defined]
    names = [*rows[0], *defaults]
    dialect = connection.dialect
    process = [table.c[name].type.bind_processor(dialect) for name in names]
    quoted = ", ".join(dialect.identifier_preparer.quote(name) for name in names)
    statement = f"COPY {table.name} ({quoted}) FROM STDIN"
    driver = connection.connection.driver_connection
    assert driver is not None
    try:
        with driver.cursor() as cursor, cursor.copy(statement) as copy:
            for row in rows:
                values = [*row.values(), *defaults.values()]
                copy.write_row(
                    [v if f is None else f(v) for v, f in zip(values, process, strict=True)]
                )
    except driver.Error as exc:  # psycopg's errors, as SQLAlchemy raises them
        raise DBAPIError.instance(statement, None, exc, type(driver).Error) from exc


def migrate(revision: str = "head") -> None:
    """Bring the schema to ``revision`` with Alembic (what `inferq migrate` runs)."""
    from importlib.resources import files

    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(files("migrations")))
    command.upgrade(config, revision)


def dispose() -> None:
    """Drop pooled connections (after fork, or at shutdown)."""
    global _engine, _sessionmaker
    with _lock:
        if _engine is not None:
            _engine.dispose()
        _engine = None
        _sessionmaker = None
