"""The dispatcher's loop: which queues need jobs, and how many.

It keeps every queue (a lane of a model) just deep enough to keep that model's workers full::

    unit(lane)     = bulk_chunk_size for bulk, else 1          (jobs per message)
    target(queue)  = margin + ceil(INFERQ_DISPATCH_DEPTH * slots)
                     (0 when a lane above waits and slots = 0)
                     slots = the job slots of the live workers that may take the queue's jobs
                             now: all of a worker's slots, but only its reserved share of this
                             lane (lane_reserved_share) while it consumes a lane above that
                             has jobs waiting
                     margin = 2 jobs (realtime, standard) or one message (bulk)
    refill(queue)  = target - unit * messages in its list      (when >= unit)
    recall(queue)  = messages in its list - ceil(target / unit) (when a lane above waits)

and a refill (app/dispatcher/refill.py) sends that many waiting jobs, in the fair order. A
shallow queue is what makes the order hold: a job in the list is past the dispatcher, so a
tenant that arrives behind a backlog waits for at most ``target`` jobs and what the workers
hold, not for the backlog.

Lanes keep strict priority (docs/architecture.md, "Fair share"). A worker polls its lists in
lane order, but a lane's jobs beyond its target wait in the database until the next refill;
a worker that drains that list sooner must not take a lower lane's message meanwhile. So
while a lane has jobs waiting, the lanes below it (of the same model) hold only what their
reserved shares may take (the worker's intake keeps those slots for them, workers/intake.py):
nothing is sent past that, and messages sent before the lane above filled up (when nothing
waited there) are recalled, their jobs unsent again. The worker then waits in its poll for
the refill, as it did when every job was in the lists. The margin keeps the refills ahead of
the workers, so that waiting is rare. The workers' slots are read again at once when a
queue is found empty (a worker just started, or more work than expected).

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import redis
from sqlalchemy import select
from sqlalchemy.exc import InterfaceError, OperationalError

from app.core import dispatch, fairshare, snapshot
from app.core.db import session_scope
from app.core.models import LANE_PRIORITY, UNSENT, Job, now
from app.core.settings import LANES, Settings, get_settings
from app.dispatcher.refill import Route, recall, refill

log = logging.getLogger("inferq.dispatcher")

SCAN_S = 1.0  # how often the database is asked which queues have waiting jobs
IDLE_S = 1.0  # longest wait for a wake-up while nothing waits
IDLE_WAIT_S = 0.05  # longest wait between looks at lists that do not move
SLOTS_S = 1.0  # how often the workers' presence records (their slots) are read
SLOTS_FRESH_S = 0.1  # ... while a queue is found empty
WEIGHTS_S = 5.0  # how often the tenants' weights are read
RETRY_S = 1.0  # pause after Redis or the database failed


def _lanes_above(lane: str) -> list[str]:
    """The lanes whose jobs a worker takes before ``lane``'s."""
    rank = LANE_PRIORITY.get(lane, len(LANES))
    return [other for other in LANES if LANE_PRIORITY[other] < rank]


@dataclass(frozen=True)
class LiveWorker:
    """A live inference worker, as its presence record shows it (workers/heartbeat.py)."""

    model: str
    lanes: frozenset[str]
    slots: int
    reserved: Mapping[str, int]  # each lane's reserved slots (its intake, workers/intake.py)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> LiveWorker:
        reserved = (record.get("intake") or {}).get("reserved") or {}
        return cls(
            str(record["model"]),
            frozenset(str(lane) for lane in record.get("lanes") or []),
            int(record.get("concurrency") or 0),
            {str(lane): int(n) for lane, n in reserved.items()},
        )

    def slots_for(self, lane: str, waiting_above: set[str]) -> int:
        """The slots this worker may give ``lane``'s jobs while the lanes ``waiting_above``
        have jobs waiting: all of them, or only the lane's reserved share if it takes one of
        those lanes too."""
        if lane not in self.lanes:
            return 0
        return self.reserved.get(lane, 0) if self.lanes & waiting_above else self.slots


class Dispatcher:
    def __init__(self, settings: Settings, client: redis.Redis) -> None:
        self.settings = settings
        self.client = client
        self.backlog: set[Route] = set()  # queues whose last refill left jobs waiting
        self.waited: dict[Route, set[str]] = {}  # tenants waiting at each queue's last refill
        self.sent = 0
        self.expired = 0
        self.recalled = 0  # jobs whose message was taken back (a lane above them waited)
        self._scanned = 0.0
        self._workers: tuple[float, list[LiveWorker]] = (0.0, [])
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
        # The lanes below a waiting lane are looked at too: they may hold messages to recall.
        below = {
            Route(lane, route.model)
            for route in self.backlog
            for lane in LANES
            if route.lane in _lanes_above(lane)
        }
        routes = sorted(self.backlog | below, key=lambda r: (LANE_PRIORITY.get(r.lane, 9), r.model))
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
        empty = any(not d for r, d in zip(routes, depths, strict=True) if r in self.backlog)
        workers = self._live_workers(fresh=empty)
        for route, depth in zip(routes, depths, strict=True):
            unit = self.unit(route.lane)
            above = {
                lane
                for lane in _lanes_above(route.lane)
                if Route(lane, route.model) in self.backlog
            }
            slots = sum(w.slots_for(route.lane, above) for w in workers if w.model == route.model)
            margin = unit if route.lane == "bulk" else 2
            target = margin + math.ceil(self.settings.dispatch_depth * slots)
            if above and not slots:
                target = 0
            if above and depth > math.ceil(target / unit):
                recalled = recall(route, int(depth) - math.ceil(target / unit))
                if recalled:
                    self.recalled += recalled
                    self.backlog.add(route)
                    self._wait = interval
                continue
            room = target - unit * int(depth)
            if route not in self.backlog or room < unit:
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

    def _live_workers(self, fresh: bool = False) -> list[LiveWorker]:
        """The live inference workers (their presence records), read at most every
        ``SLOTS_S`` (``fresh``: every ``SLOTS_FRESH_S``)."""
        at, workers = self._workers
        if time.monotonic() - at < (SLOTS_FRESH_S if fresh else SLOTS_S):
            return workers
        workers = [
            LiveWorker.of(record)
            for record in snapshot.workers(self.client)
            if isinstance(record.get("model"), str)
        ]
        self._workers = (time.monotonic(), workers)
        return workers

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
            "recalled": self.recalled,
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
