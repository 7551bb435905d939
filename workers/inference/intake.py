"""Lane intake: how many job slots each lane may hold in this worker, and the queue consumers
that follow from it.

A worker has ``worker_concurrency`` job slots (the engine's ``max_num_seqs``). Each lane has a
reserved share of them (``lane_reserved_share``). A lane may take a free slot only if that
leaves the *unused* reservations of the other lanes untouched::

    room(lane) = slots - used(all lanes) - sum(max(0, reserved(m) - used(m)) for m != lane)

So a bulk backlog can never take the slots kept for realtime and standard, and a flood of
realtime work can never take the slots kept for bulk (bulk's guaranteed share); when a lane is
idle its reservation is not lost, and the other lanes share everything else.

The slots are an upper bound; the engine decides how many it runs at once (its
``max_num_seqs``, and on a GPU how many sequences its KV cache holds). A job the engine cannot
start waits inside it in arrival order, outside the dispatcher's fair share, deadlines and
lanes. So standard and bulk take a message only while the engine's own queue is short::

    engine_room = engine_queue - waiting_in_engine - taken_not_yet_in_engine
    open(lane)  = room(lane) >= need(lane)  and  (lane == realtime  or  engine_room >= 1)

``waiting_in_engine`` is read from the engine at every step (its stats' ``waiting``), and
``engine_queue`` is ``INFERQ_WORKER_ENGINE_QUEUE`` (a few jobs: enough that a freed sequence
is refilled at the next step, few enough that what waits there is a moment's work), or what the
engine ends in ``REFILL_S`` if more: ``max(INFERQ_WORKER_ENGINE_QUEUE, ended_per_s *
REFILL_S)``, so an engine of short jobs is not left idle while its next message comes. Realtime
is taken at once within its slots: vLLM's priority scheduling runs it before waiting bulk.

The same look gives the engine's capacity, what the dispatcher's queue depth is a share of
(app/dispatcher/plan.py): ``capacity`` = the sequences running at a step where some waited
through the whole step (the engine is full), else the most seen running, starting at the
slots. A change of a tenth or more is announced at once (the heartbeat's presence record),
not at the next beat. What the worker holds at most, ``holds = min(slots, capacity +
engine_queue)``, is what the dispatcher counts it as, and sizes bulk messages by: a quarter of
it at most (app/core/messaging/broker.py, ``jobs_per_message``), the room a bulk message needs here.

Celery fetches whatever its free threads can hold, from any queue. To make the rule bind before
a message is fetched, the worker stops consuming a lane's queue when the lane has no room (and
resumes when it has): Celery's ``cancel_task_queue`` / ``add_task_queue`` on the consumer.
Slots are taken when a message is *received* (Celery's ``task_received`` signal, on the
consumer's event-loop thread), so a queue closes before that loop issues its next broker poll:
no message is fetched past a lane's room. Slots come back from the task threads as each job
leaves the engine; the reopening is scheduled onto the consumer's loop with ``call_soon``
(thread-safe). While bulk is closed, the poll only waits on realtime and standard, so their
messages are taken at once, and the engine has free sequences for them because bulk never holds
the reserved slots.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from app.core.messaging.broker import jobs_per_message
from app.core.messaging.names import lane_queues
from app.core.settings import LANES, Settings

# The time from a lane opening to its next message's jobs in the engine: Celery's broker poll
# (50 ms, docs/architecture.md, "Intake"), the claim's transaction, the dispatcher refilling
# the list behind it; the engine's queue holds at least what the engine ends meanwhile.
REFILL_S = 0.25
RATE_WINDOW_S = 2.0

log = logging.getLogger("inferq.intake")


class Intake:
    def __init__(
        self,
        lanes: list[str],
        slots: int,
        reserved_share: dict[str, float],
        bulk_chunk: int,
        model: str,
        engine_queue: int = 0,
        worker_id: str = "",
        affine: frozenset[str] = frozenset(),
    ) -> None:
        self.lanes = list(lanes)
        # Each lane's queues, the worker's own first where the lane is sent by prefix affinity
        # (app/core/messaging/names.py, lane_queues): they open and close together.
        self.queues = {
            lane: lane_queues(lane, model, worker_id, affine if worker_id else ())
            for lane in self.lanes
        }
        # 0: no bound from the engine's queue (the slots alone decide).
        self.engine_queue = engine_queue
        self.waiting_in_engine = 0
        self.in_engine = 0
        self._ended: deque[float] = deque()  # when jobs left the engine, the last RATE_WINDOW_S
        self.capacity = slots
        self._announced = slots
        self._engine_load: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self._on_capacity: Callable[[], None] = lambda: None
        self.model = model  # the lanes are this model's queues (app/core/messaging/names.py)
        self.slots = slots
        self.reserved = {lane: int(slots * reserved_share.get(lane, 0.0)) for lane in self.lanes}
        self.used = dict.fromkeys(self.lanes, 0)
        self.bulk_chunk = bulk_chunk
        self._need = {lane: self.need(lane) for lane in self.lanes}
        self.open = set(self.lanes)  # the consumer starts on every lane
        self._applied = set(self.lanes)
        self._consumer: Any = None
        self._loop_thread: int | None = None
        self._keys: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, worker_id: str = "") -> Intake:
        """The intake of a worker of ``settings``; ``worker_id``: it consumes its own queues
        (prefix affinity) under that id, in ``settings.affine_lanes``."""
        return cls(
            settings.lanes,
            settings.worker_concurrency,
            settings.lane_reserved_share,
            settings.bulk_chunk_size,
            settings.model_name,
            settings.worker_engine_queue,
            worker_id,
            settings.affine_lanes,
        )

    @property
    def own_lanes(self) -> list[str]:
        """The lanes whose own queue this worker consumes (its presence record says so)."""
        return [lane for lane, queues in self.queues.items() if len(queues) > 1]

    def all_queues(self) -> list[str]:
        """Every queue this worker consumes, in the order it tries them."""
        return [name for lane in LANES if lane in self.queues for name in self.queues[lane]]

    def bind(self, consumer: Any) -> None:
        """Attach Celery's consumer (``worker_ready``); from now on lanes open and close."""
        with self._lock:
            self._consumer = consumer
            self._loop_thread = threading.get_ident()  # worker_ready runs on the loop's thread
        self._reconcile()

    def watch(self, load: Callable[[], tuple[int, int]], on_capacity: Callable[[], None]) -> None:
        """Read the engine's (running, waiting) with ``load`` at every engine step
        (:meth:`on_step`, on the engine's thread); ``on_capacity`` when the capacity moves."""
        self._engine_load = load
        self._on_capacity = on_capacity

    def on_step(self, _decoding: int, _emitted: int) -> None:
        """The engine took a step: what waits in it may have started."""
        running, waiting = self._engine_load()
        # Full only if jobs waited through a whole step: a job that arrived during the step
        # waits at its end without the engine being full.
        full = waiting > 0 and self.waiting_in_engine > 0
        self.waiting_in_engine = waiting
        capacity = running if full else max(self.capacity, running)
        self.capacity = max(1, min(self.slots, capacity))
        self._need = {lane: self.need(lane) for lane in self.lanes}
        if abs(self.capacity - self._announced) * 10 >= self._announced:
            self._announced = self.capacity
            self._on_capacity()
        self._reconcile()

    def entered(self, n: int) -> None:
        """``n`` taken jobs went into the engine."""
        with self._lock:
            self.in_engine += n
        self._reconcile()

    def left(self, n: int) -> None:
        """``n`` jobs left the engine (their slots are given back separately)."""
        now = time.monotonic()
        with self._lock:
            self.in_engine = max(0, self.in_engine - n)
            self._ended.extend([now] * n)
            while self._ended and self._ended[0] < now - RATE_WINDOW_S:
                self._ended.popleft()

    def queue_bound(self) -> int:
        """The jobs let wait in the engine: ``engine_queue``, or what the engine ends in
        ``REFILL_S`` if more (an engine of short jobs empties a queue of four before the next
        message is in)."""
        if not self.engine_queue:
            return 0
        ending = len(self._ended) / RATE_WINDOW_S
        return max(self.engine_queue, math.ceil(ending * REFILL_S))

    def engine_room(self) -> int:
        pending = max(0, sum(self.used.values()) - self.in_engine)
        return self.queue_bound() - self.waiting_in_engine - pending

    def is_open(self, lane: str) -> bool:
        if self.room(lane) < self._need[lane]:
            return False
        return lane == "realtime" or not self.engine_queue or self.engine_room() >= 1

    def room(self, lane: str) -> int:
        held_back = sum(max(0, self.reserved[m] - self.used[m]) for m in self.lanes if m != lane)
        return self.slots - sum(self.used.values()) - held_back

    def holds(self) -> int:
        """The most jobs this worker holds now: what its engine runs and the few it lets wait
        there, within the slots (the dispatcher's count of this worker, app/dispatcher/plan.py)."""
        if not self.engine_queue:
            return self.slots
        return min(self.slots, self.capacity + self.queue_bound())

    def need(self, lane: str) -> int:
        """Slots a message of ``lane`` may bring: a bulk message carries a chunk of jobs, sized
        by what the worker holds (app/core/messaging/broker.py, jobs_per_message)."""
        ceiling = self.slots - sum(self.reserved[m] for m in self.lanes if m != lane)
        wanted = jobs_per_message(lane, self.bulk_chunk, self.holds())
        return max(1, min(wanted, ceiling))

    def take(self, lane: str, n: int, key: str | None = None) -> None:
        """Occupy ``n`` slots for a message; a message's ``key`` takes slots only once."""
        with self._lock:
            if key is not None:
                if key in self._keys:
                    return
                self._keys.add(key)
            self.used[lane] = self.used.get(lane, 0) + n
        self._reconcile()

    def hold(self, lane: str, n: int, key: str | None = None) -> Hold:
        """The ``n`` slots of one message, given back as its jobs leave (:class:`Hold`)."""
        return Hold(self, lane, n, key)

    def settle(self, key: str | None) -> None:
        """The message ``key`` is finished (its slots were given back job by job)."""
        with self._lock:
            self._keys.discard(key or "")

    def give(self, lane: str, n: int = 1) -> None:
        with self._lock:
            self.used[lane] = max(0, self.used.get(lane, 0) - n)
        self._reconcile()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "slots": self.slots,
                "used": dict(self.used),
                "reserved": dict(self.reserved),
                "open": [lane for lane in self.lanes if lane in self.open],
                "engine_queue": self.queue_bound(),
                "capacity": self.capacity,
                "holds": self.holds(),
                "waiting_in_engine": self.waiting_in_engine,
                "in_engine": self.in_engine,
            }

    def _reconcile(self) -> None:
        with self._lock:
            wanted = {lane for lane in self.lanes if self.is_open(lane)}
            if wanted == self.open:
                return
            self.open = wanted
            consumer = self._consumer
        if consumer is None:
            return
        if threading.get_ident() == self._loop_thread:
            self._apply()  # before the loop polls the broker again
        else:
            # Ordering of call_soon callbacks is not guaranteed, so the callback applies the
            # latest wanted state rather than one change.
            consumer.call_soon(self._apply)

    def _apply(self) -> None:
        """On the consumer's loop: make the consumed queues match ``open``.

        Celery's ``add_task_queue`` / ``cancel_task_queue`` first change the app's queue
        *selection*, then the live consumer. While the broker is away the live consumer belongs
        to a closed connection and the second part raises (kombu: ``AttributeError`` from a
        channel whose connection is gone); raised on the consumer's loop, that killed the
        worker. The selection is already changed by then, and the consumer Celery rebuilds on
        reconnect consumes exactly the selected queues, so the change counts as applied.
        """
        with self._lock:
            consumer = self._consumer
            if consumer is None:
                return
            for lane in self.lanes:
                if lane in self.open and lane not in self._applied:
                    self._applied.add(lane)
                    change = consumer.add_task_queue
                    tasks = getattr(consumer, "task_consumer", None)
                    if tasks is not None:
                        # The queue was declared when the consumer first took it (and is
                        # again by a consumer Celery rebuilds); declaring it at every re-open
                        # (a LLEN, a SADD, a pipeline) was a tenth of a worker's CPU under a
                        # bulk flood (docs/benchmarks.md, "ceiling").
                        tasks.auto_declare = False
                elif lane not in self.open and lane in self._applied:
                    self._applied.discard(lane)
                    change = consumer.cancel_task_queue
                else:
                    continue
                try:
                    for name in self.queues[lane]:
                        change(name)
                except Exception as exc:
                    log.warning(
                        "%s(%s) failed: %r; the consumer Celery rebuilds when the broker is "
                        "back follows the selection",
                        change.__name__,
                        lane,
                        exc,
                    )


class Hold:
    """One message's slots: taken when it arrives (once per ``key``), given back job by job with
    :meth:`release`, and whatever is left when the message is done."""

    def __init__(self, intake: Intake, lane: str, n: int, key: str | None) -> None:
        self.intake, self.lane, self.key = intake, lane, key
        intake.take(lane, n, key=key)
        self.left = n

    def release(self, n: int) -> None:
        if n > 0:
            self.intake.give(self.lane, n)
            self.left -= n

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        _type: type[BaseException] | None,
        _value: BaseException | None,
        _tb: TracebackType | None,
    ) -> None:
        self.release(self.left)
        self.intake.settle(self.key)
