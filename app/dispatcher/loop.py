"""The dispatcher's loop: which queues have jobs to send, what they hold, and acting on the plan.

Every queue (a lane of a model) is kept just deep enough to keep that model's workers full,
and the lanes below a waiting lane hold only their reserved shares: the rule is stated, and
decided for each queue, in app/dispatcher/plan.py; a refill (app/dispatcher/refill.py) sends
the jobs it asks for, in the fair order, and a recall takes messages back. The workers' slots
are read again at once when a queue is found empty (a worker just started, or more work than
expected).

Which queues have waiting jobs: the API, the workers and the reaper push a queue's name onto
``names.WAKE_KEY`` when they leave jobs for it; the loop also looks in the database every
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

from app.core import clients, fairshare, snapshot
from app.core.db import session_scope
from app.core.models import LANE_PRIORITY, UNSENT, Job, now
from app.core.names import DISPATCHER_KEY_PREFIX, WAKE_KEY
from app.core.settings import LANES, Settings, get_settings
from app.dispatcher.plan import LiveWorker, Recall, decide, lanes_above
from app.dispatcher.refill import Route, must_make_way, recall, refill

log = logging.getLogger("inferq.dispatcher")

SCAN_S = 1.0  # how often the database is asked which queues have waiting jobs
IDLE_S = 1.0  # longest wait for a wake-up while nothing waits
IDLE_WAIT_S = 0.05  # longest wait between looks at lists that do not move
SLOTS_S = 1.0  # how often the workers' presence records (their slots) are read
SLOTS_FRESH_S = 0.1  # ... while a queue is found empty
WEIGHTS_S = 5.0  # how often the tenants' weights are read
RETRY_S = 1.0  # pause after Redis or the database failed
MAKE_WAY_S = 1.0  # least time between two lists taken back for tenants that start waiting


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
        self._made_way: dict[Route, float] = {}  # when each list was last taken back for one
        self._interval = settings.dispatch_interval_ms / 1000  # the wait while lists move
        self._wait = self._interval

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
        """Wait for a wake-up (briefly while queues are being filled), then look at every
        queue with jobs waiting and the lanes below them, and act on each one's plan, in lane
        order."""
        self.announce()
        woken = self._woken(self._wait if self.backlog else IDLE_S)
        self.backlog |= woken
        if time.monotonic() - self._scanned >= SCAN_S:
            self._scanned = time.monotonic()
            self.backlog |= self._scan()
        if not self.backlog:
            return
        depths = self._look()
        if self.settings.dispatch_policy == "fair":
            depths = self._make_way(woken, depths)
        empty = any(not d for r, d in depths.items() if r in self.backlog)
        workers = self._live_workers(fresh=empty)
        for route, depth in depths.items():
            # Decided with the backlog as the refills above left it (a lane they emptied no
            # longer holds this one back).
            above = {
                lane for lane in lanes_above(route.lane) if Route(lane, route.model) in self.backlog
            }
            action = decide(
                route.lane,
                route.model,
                depth,
                route in self.backlog,
                above,
                workers,
                depth=self.settings.dispatch_depth,
                bulk_chunk=self.settings.bulk_chunk_size,
            )
            if isinstance(action, Recall):
                self._recall(route, action.messages)
            elif action is not None:
                self._refill(route, action.jobs, action.unit)

    def _look(self) -> dict[Route, int]:
        """The messages in the list of each queue with jobs waiting, and of the lanes below
        them (they may hold messages to recall), in lane order."""
        below = {
            Route(lane, route.model)
            for route in self.backlog
            for lane in LANES
            if route.lane in lanes_above(lane)
        }
        routes = sorted(self.backlog | below, key=lambda r: (LANE_PRIORITY.get(r.lane, 9), r.model))
        pipe = self.client.pipeline(transaction=False)
        for route in routes:
            pipe.llen(route.queue)
        depths = {route: int(n) for route, n in zip(routes, pipe.execute(), strict=True)}
        # Lists nobody takes from (a model with no worker, a full worker) need no look every
        # tick: the wait doubles, up to IDLE_WAIT_S, until a list moves or a refill is made.
        moved = depths != self._depths
        self._depths = depths
        if moved:
            self._wait = self._interval
        else:
            self._wait = min(self._wait * 2, max(self._interval, IDLE_WAIT_S))
        return depths

    def _make_way(self, woken: set[Route], depths: dict[Route, int]) -> dict[Route, int]:
        """A tenant that starts waiting on a queue whose list holds others' messages goes
        into the fair order at once: the list is taken back and refilled in that order, so the
        newcomer waits for what the workers hold, not also for the list (docs/architecture.md,
        "Fair share")."""
        for route in woken:
            held = depths.get(route, 0)
            # At most once a MAKE_WAY_S a queue: many tenants coming and going on a busy
            # realtime queue would otherwise have its list taken back at every wake-up.
            if not held or time.monotonic() - self._made_way.get(route, 0.0) < MAKE_WAY_S:
                continue
            if must_make_way(route, self.waited.get(route, set())):
                self._made_way[route] = time.monotonic()
                self._recall(route, held)
                depths[route] = self.client.llen(route.queue)
        return depths

    def _recall(self, route: Route, messages: int) -> None:
        recalled = recall(route, messages)
        if recalled:
            self.recalled += recalled
            self.backlog.add(route)
            self._wait = self._interval

    def _refill(self, route: Route, jobs: int, unit: int) -> None:
        done = refill(
            route,
            jobs,
            policy=self.settings.dispatch_policy,
            unit=unit,
            weights=self._tenant_weights(),
            waited=self.waited.get(route, set()),
            client=self.client,
        )
        self._wait = self._interval
        self.sent += done.sent
        self.expired += done.expired
        self.waited[route] = done.waiting
        if not done.waiting:
            self.backlog.discard(route)

    def _woken(self, wait_s: float) -> set[Route]:
        """Queues named on the wake-up list, waiting up to ``wait_s`` for the first."""
        first = self.client.blpop([WAKE_KEY], timeout=wait_s)
        if first is None:
            return set()
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(WAKE_KEY, 0, -1)
        pipe.delete(WAKE_KEY)
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
        return DISPATCHER_KEY_PREFIX + self.worker_id

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
    clients.warn_if_not_durable()
    dispatcher = Dispatcher(settings, clients.redis_client())
    log.info(
        "dispatcher %s: policy %s, queues %s deep (share of the workers' slots), ready.",
        dispatcher.worker_id,
        settings.dispatch_policy,
        settings.dispatch_depth,
    )
    dispatcher.run(stop)
    sys.exit(0)
