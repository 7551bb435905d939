"""The dispatcher's loop: which queues need jobs, and how many.

It keeps every queue (a lane of a model) just deep enough to keep that model's workers full::

    unit(lane)     = bulk_chunk_size for bulk, else 1          (jobs per message)
    target(queue)  = margin + ceil(INFERQ_DISPATCH_DEPTH * slots)
                     slots = the job slots of the live workers that consume the queue
                     margin = 2 jobs (realtime, standard) or one message (bulk)
    refill(queue)  = target - unit * messages in its list      (when >= unit)

The margin keeps lanes in strict priority: a worker that frees a slot finds the next realtime
(or standard) job in its list, not in the database a refill away, so it does not take a job of
a lower lane meanwhile. Bulk has no lane below it. The workers' slots are read again at once
when a queue is found empty (a worker just started, or more work than expected).

and a refill (app/dispatcher/refill.py) sends that many waiting jobs, in the fair order. A
shallow queue is what makes the order hold: a job in the list is past the dispatcher, so a
tenant that arrives behind a backlog waits for at most ``target`` jobs and what the workers
hold, not for the backlog.

Which queues have waiting jobs: the API, the workers and the reaper push a queue's name onto
``dispatch.WAKE_KEY`` when they leave jobs for it; the loop also looks in the database every
``SCAN_S`` (a wake-up lost with Redis, a dispatcher started late). A queue stays on the list
while a refill leaves jobs waiting; its list length is read every ``INFERQ_DISPATCH_INTERVAL_MS``
while the lists move, less often (up to ``IDLE_WAIT_S``) while none does.

Several dispatchers may run (one per host, for availability): a job is picked by one of them
only (refill.py), and each tenant's share is kept in Redis, where they all read it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError

from app.core import dispatch, fairshare, snapshot
from app.core.db import session_scope
from app.core.models import LANE_PRIORITY, UNSENT, Job, now
from app.core.settings import Settings, get_settings
from app.dispatcher.refill import Route, refill

log = logging.getLogger("inferq.dispatcher")

SCAN_S = 1.0  # how often the database is asked which queues have waiting jobs
IDLE_S = 1.0  # longest wait for a wake-up while nothing waits
IDLE_WAIT_S = 0.05  # longest wait between looks at lists that do not move
SLOTS_S = 1.0  # how often the workers' presence records (their slots) are read
SLOTS_FRESH_S = 0.1  # ... while a queue is found empty
WEIGHTS_S = 5.0  # how often the tenants' weights are read
RETRY_S = 1.0  # pause after Redis or the database failed


class Dispatcher:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.client = client
        self.backlog: set[Route] = set()  # queues whose last refill left jobs waiting
        self.waited: dict[Route, set[str]] = {}  # tenants waiting at each queue's last refill
        self.sent = 0
        self.expired = 0
        self._scanned = 0.0
        self._slots: tuple[float, dict[Route, int]] = (0.0, {})
        self._weights: tuple[float, dict[str, float]] = (-WEIGHTS_S, {})
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        self._announced = 0.0
        self._depths: dict[Route, int] = {}  # each list's length at the last look
        self._wait = settings.dispatch_interval_ms / 1000

    def unit(self, lane: str) -> int:
        return self.settings.bulk_chunk_size if lane == "bulk" else 1

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.step()
            except (OperationalError, InterfaceError) as exc:
                log.warning("database unavailable; retrying: %s", exc.orig or exc)
                stop.wait(RETRY_S)
            except redis.RedisError as exc:
                log.warning("Redis unavailable; retrying: %s", exc)
                stop.wait(RETRY_S)
        self.withdraw()

    def step(self) -> None:
        """Wait for a wake-up (briefly while queues are being filled), then refill every queue
        that has room, in lane order."""
        self.announce()
        self.backlog |= self._woken(self._wait if self.backlog else IDLE_S)
        if time.monotonic() - self._scanned >= SCAN_S:
            self._scanned = time.monotonic()
            self.backlog |= self._scan()
        if not self.backlog:
            return
        routes = sorted(self.backlog, key=lambda r: (LANE_PRIORITY.get(r.lane, 9), r.model))
        pipe = self.client.pipeline(transaction=False)
        for route in routes:
            pipe.llen(route.queue)
        depths = pipe.execute()
        # Lists nobody takes from (a model with no worker, a full worker) need no look every
        # tick: the wait doubles, up to IDLE_WAIT_S, until a list moves or a refill is made.
        moved = dict(zip(routes, depths, strict=True)) != self._depths
        self._depths = dict(zip(routes, depths, strict=True))
        interval = self.settings.dispatch_interval_ms / 1000
        self._wait = interval if moved else min(self._wait * 2, max(interval, IDLE_WAIT_S))
        slots = self._live_slots(fresh=0 in depths)
        for route, depth in zip(routes, depths, strict=True):
            unit = self.unit(route.lane)
            margin = unit if route.lane == "bulk" else 2
            target = margin + math.ceil(self.settings.dispatch_depth * slots.get(route, 0))
            room = target - unit * int(depth)
            if room < unit:
                continue
            done = refill(
                route,
                room,
                policy=self.settings.dispatch_policy,
                unit=unit,
                weights=self._tenant_weights(),
                waited=self.waited.get(route, set()),
                client=self.client,
            )
            self._wait = interval
            self.sent += done.sent
            self.expired += done.expired
            self.waited[route] = done.waiting
            if not done.waiting:
                self.backlog.discard(route)

    def _woken(self, wait_s: float) -> set[Route]:
        """Queues named on the wake-up list, waiting up to ``wait_s`` for the first."""
        first = self.client.blpop([dispatch.WAKE_KEY], timeout=wait_s)
        if first is None:
            return set()
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(dispatch.WAKE_KEY, 0, -1)
        pipe.delete(dispatch.WAKE_KEY)
        rest, _ = pipe.execute()
        names = {first[1], *rest}
        return {Route.of_queue(n.decode() if isinstance(n, bytes) else str(n)) for n in names}

    def _scan(self) -> set[Route]:
        """Queues with waiting jobs, from the database."""
        with session_scope() as session:
            found = session.execute(select(Job.lane, Job.model).where(UNSENT).distinct()).all()
        return {Route(lane, self.settings.base_of(model)) for lane, model in found}

    def _live_slots(self, fresh: bool = False) -> dict[Route, int]:
        """The job slots of the live workers consuming each queue (their presence records),
        read at most every ``SLOTS_S`` (``fresh``: every ``SLOTS_FRESH_S``)."""
        at, slots = self._slots
        if time.monotonic() - at < (SLOTS_FRESH_S if fresh else SLOTS_S):
            return slots
        slots = {}
        for record in snapshot.workers(self.client):
            model = record.get("model")
            if not isinstance(model, str):
                continue
            for lane in record.get("lanes") or []:
                route = Route(str(lane), model)
                slots[route] = slots.get(route, 0) + int(record.get("concurrency") or 0)
        self._slots = (time.monotonic(), slots)
        return slots

    def _tenant_weights(self) -> dict[str, float]:
        at, weights = self._weights
        if time.monotonic() - at >= WEIGHTS_S:
            with session_scope() as session:
                weights = fairshare.weights(session)
            self._weights = (time.monotonic(), weights)
        return weights

    # --- presence: `inferq status` and `inferq up` see the dispatchers that run ----------------

    @property
    def key(self) -> str:
        return dispatch.DISPATCHER_KEY_PREFIX + self.worker_id

    def announce(self) -> None:
        if time.monotonic() - self._announced < 1.0:
            return
        self._announced = time.monotonic()
        record: dict[str, Any] = {
            "role": "dispatcher",
            "worker_id": self.worker_id,
            "pid": os.getpid(),
            "seen_at": now(),
            "policy": self.settings.dispatch_policy,
            "queues": sorted(route.queue for route in self.backlog),
            "sent": self.sent,
            "expired": self.expired,
        }
        self.client.set(self.key, json.dumps(record), ex=5)

    def withdraw(self) -> None:
        with contextlib.suppress(redis.RedisError):
            self.client.delete(self.key)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = get_settings()
    stop = threading.Event()

    def _stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    dispatcher = Dispatcher(settings, dispatch.redis_client())
    log.info(
        "dispatcher %s: policy %s, queues %s deep (share of the workers' slots), ready.",
        dispatcher.worker_id,
        settings.dispatch_policy,
        settings.dispatch_depth,
    )
    dispatcher.run(stop)
    sys.exit(0)
