"""The dispatcher's plan for one queue: how many jobs to send it, or how many messages to take
back. Pure: what the loop saw goes in, a decision comes out (app/dispatcher/loop.py acts on it).

A queue (a lane of a model) is kept just deep enough to keep that model's workers full::

    unit(lane)     = jobs per message: 1, or for bulk min(bulk_chunk_size, the smallest
                     worker's slots / 4) (app/core/messaging/broker.py, jobs_per_message)
    target(queue)  = margin + ceil(INFERQ_DISPATCH_DEPTH * slots)
                     (0 when a lane above waits and slots = 0)
                     slots = the job slots of the live workers that may take the queue's jobs
                             now: all that a worker holds (its engine's capacity and the jobs it
                             lets wait there, within its slots), but only its reserved share of this
                             lane (lane_reserved_share) while it consumes a lane above that
                             has jobs waiting
                     margin = 2 jobs (realtime, standard) or one message (bulk)
    refill(queue)  = target - unit * messages in its list      (when it has jobs waiting and
                                                                 the result is >= unit)
    recall(queue)  = messages in its list - ceil(target / unit) (when a lane above waits and
                                                                 the result is > 0)

A shallow queue is what makes the order hold: a job in the list is past the dispatcher, so a
tenant that arrives behind a backlog waits for at most ``target`` jobs and what the workers
hold, not for the backlog. Lanes keep strict priority (docs/architecture.md, "Fair share"):
while a lane has jobs waiting, the lanes below it (of the same model) hold only what their
reserved shares may take (the worker's intake keeps those slots for them,
workers/inference/intake.py): nothing is sent past that, and the messages sent before the lane
above filled up are recalled, their jobs unsent again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from app.core.messaging.broker import jobs_per_message
from app.core.models import LANE_PRIORITY
from app.core.settings import LANES

MARGIN_JOBS = 2  # the margin of a realtime or standard queue (a bulk queue's: one message)


def lanes_above(lane: str) -> list[str]:
    """The lanes whose jobs a worker takes before ``lane``'s."""
    rank = LANE_PRIORITY.get(lane, len(LANES))
    return [other for other in LANES if LANE_PRIORITY[other] < rank]


@dataclass(frozen=True)
class LiveWorker:
    """A live inference worker, as its presence record shows it (workers/inference/heartbeat.py)."""

    model: str
    lanes: frozenset[str]
    slots: int
    reserved: Mapping[str, int]  # each lane's reserved slots (its intake)
    worker_id: str = ""
    own_lanes: frozenset[str] = frozenset()  # lanes whose own queue it consumes (affinity)

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> LiveWorker:
        intake = record.get("intake") or {}
        reserved = intake.get("reserved") or {}
        # What the worker holds at most now: its engine's capacity and the few jobs it lets
        # wait there, within its slots (workers/inference/intake.py); a queue deeper than that
        # is a wait outside the fair order.
        slots = int(intake.get("holds") or record.get("concurrency") or 0)
        return cls(
            str(record["model"]),
            frozenset(str(lane) for lane in record.get("lanes") or []),
            slots,
            {str(lane): int(n) for lane, n in reserved.items()},
            str(record.get("worker_id") or ""),
            frozenset(str(lane) for lane in record.get("own_lanes") or []),
        )

    def slots_for(self, lane: str, waiting_above: set[str]) -> int:
        """The slots this worker may give ``lane``'s jobs while the lanes ``waiting_above``
        have jobs waiting: all of them, or only the lane's reserved share if it takes one of
        those lanes too."""
        if lane not in self.lanes:
            return 0
        return self.reserved.get(lane, 0) if self.lanes & waiting_above else self.slots


@dataclass(frozen=True)
class Refill:
    """Send up to ``jobs`` waiting jobs, ``unit`` a message."""

    jobs: int
    unit: int


@dataclass(frozen=True)
class Recall:
    """Take the newest ``messages`` back out of the list."""

    messages: int


def target(lane: str, slots: int, above: bool, *, depth: float, bulk_chunk: int) -> int:
    """The jobs a queue of ``lane`` should hold for ``slots`` (``above``: a lane above waits)."""
    if above and not slots:
        return 0
    margin = jobs_per_message(lane, bulk_chunk) if lane == "bulk" else MARGIN_JOBS
    return margin + math.ceil(depth * slots)


def decide(
    lane: str,
    model: str,
    messages: int,
    waiting: bool,
    above: set[str],
    workers: Iterable[LiveWorker],
    *,
    depth: float,
    bulk_chunk: int,
) -> Refill | Recall | None:
    """What to do with the queue of ``lane`` of ``model``, holding ``messages``, with jobs
    ``waiting`` to be sent or not, while the lanes ``above`` (of the same model) have jobs
    waiting, given the live ``workers``."""
    takers = [w for w in workers if w.model == model and lane in w.lanes]
    size = jobs_per_message(lane, bulk_chunk, min((w.slots for w in takers), default=0))
    slots = sum(w.slots_for(lane, above) for w in takers)
    goal = target(lane, slots, bool(above), depth=depth, bulk_chunk=size)
    if above and messages > math.ceil(goal / size):
        return Recall(messages - math.ceil(goal / size))
    room = goal - size * messages
    if not waiting or room < size:
        return None
    return Refill(room, size)
