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

Each dispatcher keeps a presence record (``inferq:dispatcher:<host>-<pid>``: its policy, the
queues it is filling, what it has sent), which `inferq up`, `inferq status`, the console and
the missing-dispatcher signal (app/core/observe/missing.py, `/readyz`) read. It is kept the way
every process keeps one (app/core/processes/presence.py): rewritten every second by a thread of
its own from the values the loop publishes as it goes, expiring after 5 s. The loop wrote it
itself at the top of each step, so a step that waited for the database (SQLite's write lock, up
to its 30 s busy timeout) let it expire and a running dispatcher read as none
(docs/architecture.md, "A busy worker's presence"). The record is withdrawn while the loop is
not alive (:meth:`Dispatcher.health`): its thread has ended or left the loop, or it has not gone
round for ``STALL_S``, three of the longest waits a pass makes for the database; a dispatcher
waiting for a lock is alive, one whose loop is gone or hangs is not.
"""

from __future__ import annotations

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

from app.core.db import SQLITE_BUSY_TIMEOUT_MS, refresh_statistics, session_scope
from app.core.messaging import broker, clients
from app.core.messaging.names import (
    AFFINITY_OVERFLOW_KEY,
    AFFINITY_SENT_KEY,
    WAKE_KEY,
    own_queue,
    own_queues,
    owner_of,
    shared_of,
)
from app.core.models import LANE_PRIORITY, UNSENT, Job
from app.core.processes import presence
from app.core.processes.presence import Presence
from app.core.settings import LANES, Settings, get_settings
from app.dispatcher.plan import LiveWorker, Recall, decide, lanes_above
from app.dispatcher.refill import Affine, Route, must_make_way, recall, refill

log = logging.getLogger("inferq.dispatcher")

SCAN_S = 1.0  # how often the database is asked which queues have waiting jobs
# How often the jobs table's statistics are looked at, and refreshed if stale
# (app/core/db.py, refresh_statistics: plans made on a table that has since grown).
STATS_S = 2.0
IDLE_S = 1.0  # longest wait for a wake-up while nothing waits
IDLE_WAIT_S = 0.05  # longest wait between looks at lists that do not move
SLOTS_S = 1.0  # how often the workers' presence records (their slots) are read
SLOTS_FRESH_S = 0.1  # ... while a queue is found empty
RETRY_S = 1.0  # pause after Redis or the database failed
MAKE_WAY_S = 1.0  # least time between two lists taken back for tenants that start waiting
REBALANCE_S = 0.5  # least time between two own queues of a route evened out (_rebalance)
REBALANCE_MIN = 4  # messages an own queue holds before half of them may be taken back
# The presence record's interval: rewritten every second, expiring after 5 s (the least expiry
# of a record, app/core/processes/presence.py), as it always has.
PRESENCE_S = 1.0
# The loop is taken for hung, and its record withdrawn, when it has not gone round for this
# long: three of the longest waits one of its transactions makes for SQLite's write lock (its
# busy timeout, after which the pass fails and the loop goes round), so a busy database is
# never taken for a hung loop.
STALL_S = 3 * SQLITE_BUSY_TIMEOUT_MS / 1000


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
        self._analyzed = 0.0
        self._workers: tuple[float, list[LiveWorker]] = (0.0, [])
        self.worker_id = f"{socket.gethostname()}-{os.getpid()}"
        # What the presence thread reads: published by the loop (``_went_round``), replaced
        # whole, never changed in place.
        self._published: dict[str, Any] = {}
        self._round = 0.0  # monotonic time the loop last went round (or made a refill)
        self._looping: threading.Thread | None = None  # the thread in ``run``, while it is
        self.presence = Presence(
            "dispatcher",
            self.worker_id,
            PRESENCE_S,
            lambda: self._published,
            alive=lambda: self.health()[0],
        )
        self._depths: dict[Route, int] = {}  # each list's length at the last look
        # The messages in each live worker's own queue of each route at the last look, and in
        # the route's shared queue (prefix affinity: app/dispatcher/affinity.py).
        self._own: dict[Route, dict[str, int]] = {}
        self._shared: dict[Route, int] = {}
        self._swept = 0.0  # when the own queues of gone workers were last looked for
        self._rebalanced: dict[Route, float] = {}  # when each route's own queues were evened
        self.rebalanced = 0  # jobs taken back from a long own queue for a waiting worker
        self.affinity_sent = 0
        self.affinity_overflow = 0
        self._made_way: dict[Route, float] = {}  # when each list was last taken back for one
        self._interval = settings.dispatch_interval_ms / 1000  # the wait while lists move
        self._wait = self._interval

    def run(self, stop: threading.Event) -> None:
        """Step until ``stop``, keeping the presence record meanwhile; it is withdrawn when
        this returns or raises (a clean stop, or a loop that failed)."""
        self._went_round()
        self._looping = threading.current_thread()
        self.presence.start()
        try:
            while not stop.is_set():
                try:
                    self.step()
                except (OperationalError, InterfaceError) as exc:
                    log.warning("database unavailable; retrying: %s", exc.orig or exc)
                    stop.wait(RETRY_S)
                except redis.RedisError as exc:
                    log.warning("Redis unavailable; retrying: %s", exc)
                    stop.wait(RETRY_S)
                self._went_round()
        finally:
            self._looping = None
            self.presence.stop()

    def health(self) -> tuple[bool, str]:
        """Alive while a thread is in :meth:`run` and its loop has gone round within
        ``STALL_S``: a pass that waits for the database (SQLite's busy timeout, 30 s) is a
        dispatcher waiting, not a gone one; a loop that ended, or hangs past three such waits,
        is gone."""
        looping = self._looping
        if looping is None or not looping.is_alive():
            return False, "the dispatcher's loop is not running"
        age = time.monotonic() - self._round
        if age > STALL_S:
            return False, f"the dispatcher's loop has not gone round for {age:.0f} s"
        return True, "ok"

    def _went_round(self) -> None:
        """Publish what the presence record says (the presence thread reads it every second)
        and that the loop moves."""
        self._round = time.monotonic()
        self._published = {
            "policy": self.settings.dispatch_policy,
            "queues": sorted(route.queue for route in self.backlog),
            "sent": self.sent,
            "expired": self.expired,
            "recalled": self.recalled,
            "affinity_sent": self.affinity_sent,
            "affinity_overflow": self.affinity_overflow,
            "rebalanced": self.rebalanced,
        }

    def step(self) -> None:
        """Wait for a wake-up (briefly while queues are being filled), then look at every
        queue with jobs waiting and the lanes below them, and act on each one's plan, in lane
        order."""
        woken = self._woken(self._wait if self.backlog else IDLE_S)
        self.backlog |= woken
        if time.monotonic() - self._scanned >= SCAN_S:
            self._scanned = time.monotonic()
            self.backlog |= self._scan()
        if time.monotonic() - self._analyzed >= STATS_S:
            self._analyzed = time.monotonic()
            refresh_statistics()
        if time.monotonic() - self._swept >= SLOTS_S:
            self._swept = time.monotonic()
            self._take_back_gone(self._live_workers())
        if not self.backlog:
            return
        depths = self._look(self._live_workers())
        depths = self._rebalance(depths)
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
                self._refill(route, action.jobs, action.unit, workers)

    def _own_queues(self, route: Route, workers: list[LiveWorker]) -> dict[str, str]:
        """Worker id -> its own queue of ``route``, for the live workers that consume one (and
        only while this dispatcher sends the route's lane by affinity)."""
        if route.lane not in self.settings.affine_lanes:
            return {}
        return {
            w.worker_id: own_queue(route.lane, route.model, w.worker_id)
            for w in workers
            if w.model == route.model and route.lane in w.own_lanes
        }

    def _queues(self, route: Route) -> list[str]:
        """``route``'s lists at the last look: its shared one, then the workers' own."""
        own = self._own.get(route, {})
        return [route.queue, *(own_queue(route.lane, route.model, w) for w in own)]

    def _look(self, workers: list[LiveWorker]) -> dict[Route, int]:
        """The messages in the lists of each queue with jobs waiting, and of the lanes below
        them (they may hold messages to recall), in lane order: its shared list and the live
        workers' own lists of it together."""
        below = {
            Route(lane, route.model)
            for route in self.backlog
            for lane in LANES
            if route.lane in lanes_above(lane)
        }
        routes = sorted(self.backlog | below, key=lambda r: (LANE_PRIORITY.get(r.lane, 9), r.model))
        pipe = self.client.pipeline(transaction=False)
        owned = {route: self._own_queues(route, workers) for route in routes}
        for route in routes:
            pipe.llen(route.queue)
            for name in owned[route].values():
                pipe.llen(name)
        sizes = iter(pipe.execute())
        depths: dict[Route, int] = {}
        for route in routes:
            self._shared[route] = int(next(sizes))
            self._own[route] = {worker: int(next(sizes)) for worker in owned[route]}
            depths[route] = self._shared[route] + sum(self._own[route].values())
        # Lists nobody takes from (a model with no worker, a full worker) need no look every
        # tick: the wait doubles, up to IDLE_WAIT_S, until a list moves or a refill is made.
        moved = depths != self._depths
        self._depths = depths
        if moved:
            self._wait = self._interval
        else:
            self._wait = min(self._wait * 2, max(self._interval, IDLE_WAIT_S))
        return depths

    def _rebalance(self, depths: dict[Route, int]) -> dict[Route, int]:
        """Work stealing between own queues (docs/scheduling.md, "Prefix affinity"): a worker
        whose own queue and the lane's shared queue are both empty is about to wait, while the
        plan may count the lane full because another worker's own queue is long. Half of the
        longest own queue is taken back; its jobs are placed again, and those whose worker is
        past the load bound go to the shared queue, where the waiting worker takes them. At most
        once a ``REBALANCE_S`` a queue, and only an own queue of ``REBALANCE_MIN`` messages or
        more. Only the routes of this look: ``_own`` keeps the last counts of routes no longer
        looked at, which would take messages back on old numbers."""
        for route in list(depths):
            own = self._own.get(route, {})
            if len(own) < 2 or self._shared.get(route, 0) or min(own.values()) > 0:
                continue
            longest = max(own, key=lambda w: own[w])
            if own[longest] < REBALANCE_MIN:
                continue
            if time.monotonic() - self._rebalanced.get(route, 0.0) < REBALANCE_S:
                continue
            self._rebalanced[route] = time.monotonic()
            half = own[longest] // 2
            taken = self._recall(route, half, [own_queue(route.lane, route.model, longest)])
            if taken:
                self.rebalanced += taken
                depths[route] = depths.get(route, 0) - half
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
            if must_make_way(route, self.waited.get(route, set()), self._queues(route)):
                self._made_way[route] = time.monotonic()
                self._recall(route, held)
                depths[route] = self.client.llen(route.queue)
        return depths

    def _recall(self, route: Route, messages: int, queues: list[str] | None = None) -> int:
        """Take up to ``messages`` back from ``route``'s lists (``queues``: only those) into
        the fair order; returns how many jobs."""
        recalled = recall(self._queues(route) if queues is None else queues, messages)
        if recalled:
            self.recalled += recalled
            self.backlog.add(route)
            self._wait = self._interval
        return recalled

    def _refill(self, route: Route, jobs: int, unit: int, workers: list[LiveWorker]) -> None:
        own = self._own_queues(route, workers)
        affine = None
        if len(own) >= 2:
            listed = self._own.get(route, {})
            affine = Affine(
                sorted(own),
                {w: unit * listed.get(w, 0) for w in own},
                unit * self._shared.get(route, 0),
                self.settings.affinity_load_factor,
            )
        done = refill(
            route,
            jobs,
            policy=self.settings.dispatch_policy,
            unit=unit,
            waited=self.waited.get(route, set()),
            client=self.client,
            affine=affine,
        )
        if done.sent_to or done.overflow:
            self._count_affinity(done.sent_to, done.overflow)
        self._wait = self._interval
        self.sent += done.sent
        self.expired += done.expired
        self.waited[route] = done.waiting
        if not done.waiting:
            self.backlog.discard(route)
        self._went_round()  # a refill is a transaction: the next may wait for the lock anew

    def _count_affinity(self, sent: dict[str, int], overflow: dict[str, int]) -> None:
        """Add a refill's jobs sent by affinity and by overflow to each worker's counts in
        Redis, which /metrics, `inferq status` and the console show (summed over dispatchers)."""
        self.affinity_sent += sum(sent.values())
        self.affinity_overflow += sum(overflow.values())
        pipe = self.client.pipeline(transaction=False)
        for worker, n in sent.items():
            pipe.hincrby(AFFINITY_SENT_KEY, worker, n)
        for worker, n in overflow.items():
            pipe.hincrby(AFFINITY_OVERFLOW_KEY, worker, n)
        pipe.execute()

    def _take_back_gone(self, workers: list[LiveWorker]) -> None:
        """Empty the own queues of workers that are gone (died, drained, scaled in) back into
        the fair order: their jobs wait unsent again and go wherever the dispatcher sends them
        now, each once (a job is claimed by a compare-and-set). The queues of live workers,
        even of another model, stay."""
        live = {w.worker_id for w in workers}
        for name in own_queues(self.client):
            if owner_of(name) in live:
                continue
            held = int(self.client.llen(name))
            if held:
                back = self._recall(Route.of_queue(shared_of(name)), held, [name])
                log.warning(
                    "worker %s is gone: %d job(s) from its own queue %s wait to be sent again",
                    owner_of(name),
                    back,
                    name,
                )
            broker.forget_own(name)

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
            for record in presence.workers(self.client)
            if isinstance(record.get("model"), str)
        ]
        self._workers = (time.monotonic(), workers)
        return workers


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
