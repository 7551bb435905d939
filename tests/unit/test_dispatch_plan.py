"""The dispatcher's plan (app/dispatcher/plan.py) on tables of cases: pure, nothing to start.

The formula in the module's docstring, case by case: how deep a queue is kept for the live
workers' slots, what a lane below a waiting lane may hold, and when messages are taken back.
"""

from __future__ import annotations

import pytest

from app.core.messaging.broker import jobs_per_message
from app.dispatcher.plan import LiveWorker, Recall, Refill, decide, lanes_above, target

CHUNK = 32  # bulk_chunk_size
DEPTH = 0.5  # INFERQ_DISPATCH_DEPTH


def worker(
    model: str = "m",
    lanes: str = "realtime,standard,bulk",
    slots: int = 16,
    reserved: dict[str, int] | None = None,
) -> LiveWorker:
    return LiveWorker.of(
        {
            "model": model,
            "lanes": lanes.split(","),
            "concurrency": slots,
            "intake": {"reserved": reserved or {"realtime": 2, "standard": 2, "bulk": 4}},
        }
    )


def test_lanes_above_are_the_strictly_higher_ones() -> None:
    assert lanes_above("realtime") == []
    assert lanes_above("standard") == ["realtime"]
    assert lanes_above("bulk") == ["realtime", "standard"]


@pytest.mark.parametrize(
    ("lane", "slots", "above", "expected"),
    [
        ("realtime", 16, False, 2 + 8),  # margin of 2 jobs + ceil(0.5 * 16)
        ("standard", 3, False, 2 + 2),  # ceil(1.5) = 2
        ("bulk", 16, False, CHUNK + 8),  # a bulk queue's margin is one message
        ("standard", 0, False, 2),  # no worker: the margin alone
        ("bulk", 0, True, 0),  # a lane above waits and no slot is kept for bulk: nothing
        ("bulk", 4, True, CHUNK + 2),  # the reserved share's slots
    ],
)
def test_target(lane: str, slots: int, above: bool, expected: int) -> None:
    assert target(lane, slots, above, depth=DEPTH, bulk_chunk=CHUNK) == expected


def test_a_message_is_a_chunk_for_bulk_and_one_job_otherwise() -> None:
    unit = jobs_per_message
    assert [unit(lane, CHUNK) for lane in ("realtime", "standard", "bulk")] == [1, 1, CHUNK]
    # At most a quarter of the smallest worker's slots, at least one job.
    assert [unit("bulk", CHUNK, slots) for slots in (256, 128, 20, 3)] == [CHUNK, CHUNK, 5, 1]
    assert unit("standard", CHUNK, 20) == 1


def test_a_worker_counts_what_it_holds_not_its_slots() -> None:
    """A worker announces what it holds at most (its engine's capacity and the jobs it lets
    wait there, workers/inference/intake.py); the setting's slots count only without it."""
    record = {"model": "m", "lanes": ["bulk"], "concurrency": 256, "intake": {"reserved": {}}}
    assert LiveWorker.of(record).slots == 256
    assert LiveWorker.of({**record, "intake": {"reserved": {}, "holds": 20}}).slots == 20


@pytest.mark.parametrize(
    ("waiting_above", "lane", "slots"),
    [
        (set(), "bulk", 16),  # nothing waits above: every slot
        ({"realtime"}, "bulk", 4),  # realtime waits: bulk keeps its reserved share
        ({"realtime"}, "standard", 2),
        ({"realtime", "standard"}, "bulk", 4),
    ],
)
def test_a_worker_gives_a_lane_below_a_waiting_lane_its_reserved_share(
    waiting_above: set[str], lane: str, slots: int
) -> None:
    assert worker().slots_for(lane, waiting_above) == slots


def test_a_worker_that_does_not_take_the_waiting_lane_gives_all_its_slots() -> None:
    bulk_only = worker(lanes="bulk")
    assert bulk_only.slots_for("bulk", {"realtime"}) == 16
    assert bulk_only.slots_for("standard", set()) == 0  # a lane it does not consume


Case = tuple[str, int, bool, set[str], list[LiveWorker], Refill | Recall | None]

CASES: dict[str, Case] = {
    # lane, messages in the list, jobs waiting, lanes above waiting, workers -> decision
    "an empty realtime queue is filled to its target": (
        "realtime",
        0,
        True,
        set(),
        [worker()],
        Refill(10, 1),
    ),
    "a queue holding part of its target gets the rest": (
        "standard",
        4,
        True,
        set(),
        [worker(), worker()],
        Refill(2 + 16 - 4, 1),
    ),
    "a full queue gets nothing": ("standard", 10, True, set(), [worker()], None),
    "bulk is refilled in whole messages": (
        "bulk",
        0,
        True,
        set(),
        [worker(slots=128)],
        Refill(CHUNK + 64, CHUNK),
    ),
    "less room than a message: bulk waits": ("bulk", 3, True, set(), [worker(slots=128)], None),
    "a worker of 16 slots gets messages of a quarter of them": (
        "bulk",
        0,
        True,
        set(),
        [worker(slots=128), worker()],
        Refill(4 + 72, 4),  # the smallest worker's quarter; the margin is one such message
    ),
    "no jobs waiting: nothing to send": ("realtime", 0, False, set(), [worker()], None),
    "workers of another model do not count": (
        "realtime",
        0,
        True,
        set(),
        [worker(model="other")],
        Refill(2, 1),
    ),
    "realtime waits: bulk's extra messages are taken back": (
        "bulk",
        5,
        True,
        {"realtime"},
        [worker()],
        Recall(5 - 2),  # target 32 + 2 -> ceil(34 / 32) = 2 messages may stay
    ),
    "realtime waits: what bulk's share allows stays": (
        "bulk",
        2,
        True,
        {"realtime"},
        [worker()],
        None,
    ),
    "no slot kept for bulk: every bulk message is taken back": (
        "bulk",
        3,
        False,
        {"standard"},
        [worker(reserved={"realtime": 8, "standard": 8})],
        Recall(3),
    ),
    "a worker of the lower lane alone keeps its slots for it": (
        "bulk",
        0,
        True,
        {"realtime"},
        [worker(lanes="bulk", slots=128)],
        Refill(CHUNK + 64, CHUNK),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_decide(name: str) -> None:
    lane, messages, waiting, above, workers, expected = CASES[name]
    decision = decide(lane, "m", messages, waiting, above, workers, depth=DEPTH, bulk_chunk=CHUNK)
    assert decision == expected
