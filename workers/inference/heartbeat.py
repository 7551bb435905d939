"""The worker's heartbeat: renew leases, catch missed cancels, announce the worker in Redis.

Every ``heartbeat_s`` the leases of all jobs this worker holds are extended in one transaction.
A lease that could not be renewed belongs to someone else now (the reaper re-queued the job), so
the job is aborted here to stop wasting the engine. The same pass reads cancel requests, a
backstop for a cancel broadcast this worker missed. The same beat rewrites the worker's presence
record in Redis (workers/presence.py: engine, model, lanes, load, metrics address), which
``inferq up``, ``inferq status`` and the API's Prometheus service discovery read.

Its beat is also the worker's liveness (``/healthz`` on the worker's metrics port, a
Kubernetes liveness probe, docs/kubernetes.md): a worker whose heartbeat stopped keeps no lease
and shows in no presence record, so it must not count as alive either.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from sqlalchemy import tuple_, update
from sqlalchemy.exc import SQLAlchemyError

from app.core.db import session_scope
from app.core.models import Job, JobStatus, now
from app.core.settings import Settings
from workers import metrics
from workers.inference.executor import Executor
from workers.presence import Presence

log = logging.getLogger("inferq.heartbeat")


class Heartbeat:
    def __init__(self, executor: Executor, settings: Settings, info: dict[str, Any]) -> None:
        self.executor = executor
        self.settings = settings
        self.info = info
        self.presence = Presence(
            "inference", executor.worker_id, settings.heartbeat_s, self._describe
        )
        self._stop = threading.Event()
        self._poked = threading.Event()  # announce now (the intake's capacity moved)
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._beat: float | None = None  # monotonic time of the last beat

    def start(self) -> None:
        self.presence.announce()
        self._beat = time.monotonic()
        self._thread.start()

    def health(self) -> tuple[bool, str]:
        """Alive while the heartbeat thread runs and has beaten within three intervals (one
        slow renewal under a loaded database is not death; three are a lease in danger)."""
        if self._beat is None:
            return False, "starting: the engine is not up yet"
        if not self._thread.is_alive():
            return False, "the heartbeat thread has stopped"
        age = time.monotonic() - self._beat
        if age > 3 * self.settings.heartbeat_s:
            return False, f"no heartbeat for {age:.0f} s"
        return True, f"heartbeat {age:.1f} s ago"

    def poke(self) -> None:
        """Announce the presence record now, not at the next beat (any thread)."""
        self._poked.set()

    def stop(self) -> None:
        self._stop.set()
        self._poked.set()
        self._thread.join(timeout=5)
        self.presence.withdraw()

    def _loop(self) -> None:
        due = time.monotonic() + self.settings.heartbeat_s
        while True:
            self._poked.wait(max(0.0, due - time.monotonic()))
            if self._stop.is_set():
                return
            if self._poked.is_set():
                self._poked.clear()
                self.presence.announce()
            if time.monotonic() < due:
                continue
            due += self.settings.heartbeat_s
            try:
                self.renew()
            except SQLAlchemyError as exc:
                log.warning("lease renewal failed (database): %s", exc)
            self.presence.announce()
            self._beat = time.monotonic()

    def renew(self) -> None:
        held = self.executor.held()
        if not held:
            return
        stamp = now()
        # One statement for every lease: per-job updates made a heartbeat of a worker holding
        # thousands of jobs a load of its own. A row renews only while it is still running
        # under our token; the same statement reads cancel requests.
        with session_scope() as session:
            # Core execution: the ORM's bulk-update machinery cost ~0.1 s of CPU per renewal of
            # a few hundred leases.
            rows = (
                session.connection()
                .execute(
                    update(Job)
                    .where(
                        tuple_(Job.id, Job.lease_token).in_(list(held.items())),
                        Job.status == JobStatus.RUNNING,
                    )
                    .values(lease_expires_at=stamp + self.settings.lease_ttl_s)
                    .returning(Job.id, Job.cancel_requested_at)
                )
                .all()
            )
        renewed = {row.id for row in rows}
        for job_id in held.keys() - renewed:
            log.warning("lease on %s lost; aborting it here", job_id)
            self.executor.request_abort(job_id, "lease_lost")
        for row in rows:
            if row.cancel_requested_at is not None:
                self.executor.request_abort(row.id, "cancelled")

    def _describe(self) -> dict[str, Any]:
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
