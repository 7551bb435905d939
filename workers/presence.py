"""A process's presence record in Redis: who it is, where its /metrics are, how it is doing.

Inference workers and ops workers announce themselves the same way, under their role's key
prefix (``app.core.messaging.names.PRESENCE_KEY_PREFIXES``): one JSON record per process,
rewritten by a thread of its own every ``REFRESH_S`` (or every ``interval_s``, the heartbeat,
where that is shorter) and at once when :meth:`Presence.poke` d, and expiring after three
intervals, so the record of a process that died without saying goodbye drops out by itself.
``inferq up``, ``inferq status``, the dispatcher, the catalog of models and the API's
Prometheus service discovery read these records (app/core/processes/presence.py).

The thread writes nothing but this record, from what the process keeps in memory: it waits
for no database transaction and no engine, so a busy process's record is as fresh as an idle
one's. A process whose own work has stopped says so with ``alive`` (an inference worker: its
heartbeat, workers/inference/heartbeat.py): while it answers False the record is withdrawn,
so the process is seen as gone at once, not after its record expires.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import redis

from app.core.messaging import clients
from app.core.messaging.names import PRESENCE_KEY_PREFIXES, Role
from app.core.models import now

log = logging.getLogger("inferq.presence")

# The most time between two writes of a record: what a record's load (jobs in flight, tokens/s)
# and `last seen` lag behind at most. The expiry stays three intervals (three heartbeats), the
# margin every reader's "gone" is measured by; one SET a second is nothing to Redis.
REFRESH_S = 1.0


def process_id() -> str:
    """``hostname:pid``: this process's id in presence records, job logs and leases."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Presence:
    """The record of one process, announced on demand or by a thread of its own."""

    def __init__(
        self,
        role: Role,
        worker_id: str,
        interval_s: float,
        describe: Callable[[], dict[str, Any]],
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        self.role = role
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.describe = describe
        self.alive = alive
        self.ttl_s = max(5, int(interval_s * 3))
        self.every_s = min(interval_s, REFRESH_S)
        self._stop = threading.Event()
        self._poked = threading.Event()
        self._thread: threading.Thread | None = None
        self._withdrawn = False

    @property
    def key(self) -> str:
        return PRESENCE_KEY_PREFIXES[self.role] + self.worker_id

    def announce(self) -> None:
        """Write the record now; a Redis that is down is logged, never raised."""
        record = {
            **self.describe(),
            "role": self.role,
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "seen_at": now(),
        }
        try:
            clients.redis_client().set(self.key, json.dumps(record), ex=self.ttl_s)
        except redis.RedisError as exc:
            log.warning("could not announce this %s worker in Redis: %s", self.role, exc)

    def withdraw(self) -> None:
        """Remove the record (a clean stop); without it the record would expire by itself."""
        with contextlib.suppress(redis.RedisError):
            clients.redis_client().delete(self.key)

    def poke(self) -> None:
        """Announce now, not at the next refresh (any thread; with :meth:`start`)."""
        self._poked.set()

    def start(self) -> None:
        """Announce now, then every ``every_s`` (and when poked) from a daemon thread until
        :meth:`stop`."""
        self.announce()
        self._thread = threading.Thread(target=self._loop, name=f"{self.role}-presence")
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poked.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.withdraw()

    def _loop(self) -> None:
        while True:
            self._poked.wait(self.every_s)
            if self._stop.is_set():
                return
            self._poked.clear()
            try:
                self._refresh()
            except Exception:
                # A record that cannot be described is not written (it expires if this lasts);
                # the thread stays, so a passing fault does not end the announcements.
                log.exception("could not describe this %s worker", self.role)

    def _refresh(self) -> None:
        if self.alive():
            if self._withdrawn:
                log.warning("this %s worker is alive again: announcing it", self.role)
                self._withdrawn = False
            self.announce()
            return
        if not self._withdrawn:
            log.warning("this %s worker is not alive: its presence record is withdrawn", self.role)
            self._withdrawn = True
        self.withdraw()
