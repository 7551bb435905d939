"""Who is up: the presence records that every long-running process keeps in Redis, the one way
of keeping one (:class:`Presence`: an inference or ops worker's, workers/inference/heartbeat.py
and workers/ops/main.py; a dispatcher's, app/dispatcher/loop.py), and their reads by `inferq
up`, `inferq status`, the console, the catalog of models, the reaper, the dispatcher and the
API's Prometheus service discovery; and each live process's /metrics as a scrape target.

A process announces itself under its role's key prefix
(``app.core.messaging.names.PRESENCE_KEY_PREFIXES``): one JSON record per process, rewritten by
a thread of its own every ``REFRESH_S`` (or every ``interval_s``, the heartbeat, where that is
shorter) and at once when :meth:`Presence.poke` d, and expiring after three intervals (at least
5 s), so the record of a process that died without saying goodbye drops out by itself; nothing
here is kept between calls.

The thread writes nothing but this record, from what the process keeps in memory: it waits for
no database transaction and no engine, so a busy process's record is as fresh as an idle one's.
A process whose own work has stopped says so with ``alive`` (an inference worker: its heartbeat;
a dispatcher: its loop, app/dispatcher/loop.py): while it answers False the record is
withdrawn, so the process is seen as gone at once, not after its record expires.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import redis

from app.core.messaging import clients
from app.core.messaging.names import PRESENCE_KEY_PREFIXES, Role
from app.core.models import now

log = logging.getLogger("inferq.presence")

# The most time between two writes of a record: what a record's load (jobs in flight, tokens/s)
# and `last seen` lag behind at most. The expiry stays three intervals (three heartbeats), the
# margin every reader's "gone" is measured by; one SET a second is nothing to Redis.
REFRESH_S = 1.0


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
            log.warning("could not announce this %s process in Redis: %s", self.role, exc)

    def withdraw(self) -> None:
        """Remove the record (a clean stop); without it the record would expire by itself."""
        with contextlib.suppress(redis.RedisError):
            clients.redis_client().delete(self.key)

    def poke(self) -> None:
        """Announce now, not at the next refresh (any thread; with :meth:`start`)."""
        self._poked.set()

    def start(self) -> None:
        """Announce now, then every ``every_s`` (and when poked) from a daemon thread until
        :meth:`stop` (after which it may be started again)."""
        self._stop.clear()
        self._withdrawn = False
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
                log.exception("could not describe this %s process", self.role)

    def _refresh(self) -> None:
        if self.alive():
            if self._withdrawn:
                log.warning("this %s process is alive again: announcing it", self.role)
                self._withdrawn = False
            self.announce()
            return
        if not self._withdrawn:
            log.warning("this %s process is not alive: its presence record is withdrawn", self.role)
            self._withdrawn = True
        self.withdraw()


# --- the reads -----------------------------------------------------------------------------------


def presence(client: redis.Redis, role: Role) -> list[dict[str, Any]]:
    """The presence records of live processes of ``role`` (``inference``, ``ops`` or
    ``dispatcher``; written by :class:`Presence`), sorted by worker id.

    A record expires a few heartbeats after its process stops announcing, so a dead worker
    drops out of this list by itself.
    """
    prefix = PRESENCE_KEY_PREFIXES[role]
    found: list[dict[str, Any]] = []
    for key in client.scan_iter(match=prefix + "*", count=100):
        raw = client.get(key)
        if raw is None:  # expired between SCAN and GET
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        name = key.decode() if isinstance(key, bytes) else str(key)
        record.setdefault("worker_id", name.removeprefix(prefix))
        found.append(record)
    return sorted(found, key=lambda record: str(record["worker_id"]))


def workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live inference workers (``workers/inference/heartbeat.py``), sorted by worker id."""
    return presence(client, "inference")


def ops_workers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live ops workers (``workers/ops/main.py``), sorted by worker id."""
    return presence(client, "ops")


def dispatchers(client: redis.Redis) -> list[dict[str, Any]]:
    """Live dispatchers (``app/dispatcher/loop.py``), sorted by id."""
    return presence(client, "dispatcher")


# Target labels taken from a presence record; `worker`, `engine` and `model` are also the labels
# of inferq_worker_info, so a query can join a target's series on them.
TARGET_LABELS = {"worker": "worker_id", "engine": "engine", "model": "model"}


def metrics_targets(client: redis.Redis) -> list[dict[str, Any]]:
    """Every live worker's and ops worker's /metrics, in Prometheus's HTTP service discovery
    format: ``[{"targets": ["host:port"], "labels": {...}}]``, one group per process.

    Labels: ``role`` (``inference`` or ``ops``), ``worker`` (the worker id), ``engine`` and
    ``model`` (inference workers), and ``__scheme__`` and ``__metrics_path__`` from the URL the
    process announced. A record without a metrics URL (a worker still starting) is left out.
    """
    groups: list[dict[str, Any]] = []
    for role in PRESENCE_KEY_PREFIXES:
        for record in presence(client, role):
            url = urlsplit(str(record.get("metrics_url") or ""))
            if not url.netloc:
                continue
            labels = {
                "role": role,
                "__scheme__": url.scheme or "http",
                "__metrics_path__": url.path or "/metrics",
            }
            for label, field_name in TARGET_LABELS.items():
                if record.get(field_name):
                    labels[label] = str(record[field_name])
            groups.append({"targets": [url.netloc], "labels": labels})
    return groups
