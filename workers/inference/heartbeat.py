"""The worker's heartbeat: renew leases and catch missed cancels; and the worker's presence.

Every ``heartbeat_s`` the leases of all jobs this worker holds are extended in one transaction.
A lease that could not be renewed belongs to someone else now (the reaper re-queued the job), so
the job is aborted here to stop wasting the engine. The same pass reads cancel requests, a
backstop for a cancel broadcast this worker missed.

The worker's presence record in Redis (app/core/processes/presence.py: engine, model, lanes, load,
metrics address), which ``inferq up``, ``inferq status``, the dispatcher and the catalog read,
is written by a thread of its own, every second, from what the engine and the intake publish
in memory: it used to be written by this thread after each renewal, so a renewal waiting for
the database (SQLite's write lock, held for seconds by a batch's validation) held the record
back with it, and under load it showed the load of a heartbeat ago (docs/architecture.md,
"A busy worker's presence").

Its beat is also the worker's liveness (``/healthz`` on the worker's metrics port, a
Kubernetes liveness probe, docs/kubernetes.md): a worker whose heartbeat stopped keeps no lease,
so it must not count as alive, and its presence record is withdrawn while it does not
(``alive``). So that waiting for the database is never taken for a stopped heartbeat, a renewal
waits for a lock at most ``heartbeat_s`` (then fails, and the next pass tries again) on a
connection of the heartbeat's own, which it never waits for behind the task threads' claims.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from sqlalchemy import Connection, tuple_, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from app.core.db import SQLITE_BUSY_TIMEOUT_MS, get_engine
from app.core.models import Job, JobStatus, among, now, status_is
from app.core.processes.presence import Presence
from app.core.settings import Settings
from workers import metrics
from workers.inference.executor import Executor

log = logging.getLogger("inferq.heartbeat")


class Heartbeat:
    def __init__(self, executor: Executor, settings: Settings, info: dict[str, Any]) -> None:
        self.executor = executor
        self.settings = settings
        self.info = info
        self.presence = Presence(
            "inference",
            executor.worker_id,
            settings.heartbeat_s,
            self._describe,
            alive=lambda: self.health()[0],
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._beat: float | None = None  # monotonic time of the last beat
        self._connection: Connection | None = None  # the renewals' own (see _transaction)

    def start(self) -> None:
        self._beat = time.monotonic()
        with contextlib.suppress(SQLAlchemyError):  # else at the first renewal
            self._connect()  # now, while the pool has connections to spare
        self._thread.start()  # first: the record is written while the heartbeat is alive
        self.presence.start()

    def health(self) -> tuple[bool, str]:
        """Alive while the heartbeat thread runs and has beaten within three intervals (a
        renewal waits for the database one interval at most, so a busy database is not
        death; three are a lease in danger)."""
        if self._beat is None:
            return False, "starting: the engine is not up yet"
        if not self._thread.is_alive():
            return False, "the heartbeat thread has stopped"
        age = time.monotonic() - self._beat
        if age > 3 * self.settings.heartbeat_s:
            return False, f"no heartbeat for {age:.0f} s"
        return True, f"heartbeat {age:.1f} s ago"

    def poke(self) -> None:
        """Announce the presence record now, not at its next refresh (any thread)."""
        self.presence.poke()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.presence.stop()
        if not self._thread.is_alive():  # else its renewal still uses the connection
            self._disconnect()

    def _loop(self) -> None:
        due = time.monotonic() + self.settings.heartbeat_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            # A renewal that took its whole interval (it waited for the database) is tried
            # again at once, not twice to catch up.
            due = max(due + self.settings.heartbeat_s, time.monotonic())
            try:
                self.renew()
            except SQLAlchemyError as exc:
                log.warning("lease renewal failed (database), trying again: %s", exc)
            self._beat = time.monotonic()

    def renew(self) -> None:
        held = self.executor.held()
        if not held:
            return
        stamp = now()
        # One statement for every lease: per-job updates made a heartbeat of a worker holding
        # thousands of jobs a load of its own. A row renews only while it is still running
        # under our token; the same statement reads cancel requests. Core execution: the ORM's
        # bulk-update machinery cost ~0.1 s of CPU per renewal of a few hundred leases.
        with self._transaction() as connection:
            rows = connection.execute(
                update(Job)
                .where(
                    # The ids on their own first: SQLite answers a row value's IN by reading
                    # every row of the table, the whole history, holding the writer's lock
                    # (250-285 ms a renewal over a million jobs: tests/unit/test_sqlite_plans.py);
                    # by the ids it looks each one up by the primary key, then checks its token.
                    among(Job.id, held.keys(), postgresql=connection.dialect.name == "postgresql"),
                    tuple_(Job.id, Job.lease_token).in_(list(held.items())),
                    status_is(JobStatus.RUNNING),
                )
                .values(lease_expires_at=stamp + self.settings.lease_ttl_s)
                .returning(Job.id, Job.cancel_requested_at)
            ).all()
        renewed = {row.id for row in rows}
        for job_id in held.keys() - renewed:
            log.warning("lease on %s lost; aborting it here", job_id)
            self.executor.request_abort(job_id, "lease_lost")
        for row in rows:
            if row.cancel_requested_at is not None:
                self.executor.request_abort(row.id, "cancelled")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Connection]:
        """A transaction on the heartbeat's own connection that waits for a lock at most
        ``heartbeat_s``: SQLite's busy timeout for its BEGIN IMMEDIATE (30 s for everyone else,
        app/core/db.py), PostgreSQL's ``lock_timeout`` for the rows. The connection is kept
        between renewals: a busy worker's task threads can hold every pooled connection while
        they wait for the same lock, and a checkout would wait behind them."""
        connection = self._connect()
        wait_ms = max(1, int(self.settings.heartbeat_s * 1000))
        sqlite = connection.dialect.name == "sqlite"
        try:
            if sqlite:
                _busy_timeout(connection, wait_ms)
            with connection.begin():
                if connection.dialect.name == "postgresql":
                    connection.exec_driver_sql(f"SET LOCAL lock_timeout = {wait_ms}")
                yield connection
        except DBAPIError as exc:
            if exc.connection_invalidated:  # the database went away: a new one next time
                self._disconnect()
            raise
        finally:
            # The connection goes back to the pool one day (stop, or a heartbeat that was only
            # asked to renew): with everyone's busy timeout.
            if sqlite and self._connection is not None:
                with contextlib.suppress(Exception):
                    _busy_timeout(connection, SQLITE_BUSY_TIMEOUT_MS)

    def _connect(self) -> Connection:
        if self._connection is None:
            self._connection = get_engine().connect()
        return self._connection

    def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            with contextlib.suppress(SQLAlchemyError):
                connection.close()

    def _describe(self) -> dict[str, Any]:
        # Values the engine's loop and the intake publish as they go (the engine's stats are
        # kept by its own step hook, vLLM's stat logger): reading them waits for neither.
        stats = self.executor.runner.stats()
        return {
            **self.info,
            "in_flight": self.executor.runner.in_flight(),
            "running": stats.running,
            "waiting": stats.waiting,
            "kv_cache_usage": stats.kv_cache_usage,
            "tokens_per_s": round(stats.generated_tokens_per_s, 1),
            "engine_stats": stats.extra,
            # The engine's own count of prompt tokens looked up in its prefix cache and found
            # there: `inferq status` and the console show the hit rate (prefix affinity).
            "prefix_cache": {
                "queries": stats.prefix_cache_queries,
                "hits": stats.prefix_cache_hits,
            },
            "step_ms": metrics.steps.median_ms(),
            "intake": self.executor.intake.snapshot(),
        }


def _busy_timeout(connection: Connection, ms: int) -> None:
    """SQLite's busy timeout on ``connection``'s own sqlite3 connection, outside a transaction
    (through SQLAlchemy the statement would begin one, which waits with the old timeout)."""
    driver = connection.connection.driver_connection
    assert driver is not None
    driver.execute(f"PRAGMA busy_timeout = {ms}")
