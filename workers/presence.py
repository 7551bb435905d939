"""A process's presence record in Redis: who it is, where its /metrics are, how it is doing.

Inference workers and ops workers announce themselves the same way, under their role's key
prefix (``app.core.messaging.names.PRESENCE_KEY_PREFIXES``): one JSON record per process, rewritten
every ``interval_s`` and expiring after three intervals, so the record of a process that died
without saying goodbye drops out by itself. ``inferq up``, ``inferq status`` and the API's
Prometheus service discovery read these records (app/core/processes/presence.py).
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
    ) -> None:
        self.role = role
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.describe = describe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
            clients.redis_client().set(
                self.key, json.dumps(record), ex=max(5, int(self.interval_s * 3))
            )
        except redis.RedisError as exc:
            log.warning("could not announce this %s worker in Redis: %s", self.role, exc)

    def withdraw(self) -> None:
        """Remove the record (a clean stop); without it the record would expire by itself."""
        with contextlib.suppress(redis.RedisError):
            clients.redis_client().delete(self.key)

    def start(self) -> None:
        """Announce now, then every ``interval_s`` from a daemon thread until :meth:`stop`."""
        self.announce()
        self._thread = threading.Thread(target=self._loop, name=f"{self.role}-presence")
        self._thread.daemon = True
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.withdraw()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.announce()
