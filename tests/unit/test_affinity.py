"""Prefix affinity's choice of worker (app/dispatcher/affinity.py): rendezvous hashing moves
only what must move, and the load bound sends past it to the shared queue."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from app.core.messaging.broker import LaneOrder
from app.core.messaging.names import lane_queues, own_queue, owner_of, shared_of
from app.dispatcher.affinity import Placement, home

PREFIXES = [f"{i:016x}" for i in range(3000)]


def test_a_joining_worker_takes_about_a_third_and_only_from_the_others() -> None:
    two = ["host-a:101", "host-b:202"]
    three = [*two, "host-c:303"]
    before = {p: home(p, two) for p in PREFIXES}
    after = {p: home(p, three) for p in PREFIXES}
    moved = [p for p in PREFIXES if before[p] != after[p]]
    assert all(after[p] == "host-c:303" for p in moved)  # nothing moves between the old two
    assert 0.28 < len(moved) / len(PREFIXES) < 0.39  # 1/3 predicted


def test_a_leaving_worker_gives_away_only_its_own() -> None:
    three = ["w:1", "w:2", "w:3"]
    before = {p: home(p, three) for p in PREFIXES}
    after = {p: home(p, ["w:1", "w:2"]) for p in PREFIXES}
    assert all(before[p] == after[p] for p in PREFIXES if before[p] != "w:3")
    shares = Counter(before.values())
    assert min(shares.values()) > len(PREFIXES) / 3 * 0.85


def test_under_the_bound_a_prefix_goes_to_its_home() -> None:
    placement = Placement.of(["w:1", "w:2"], {"w:1": 4, "w:2": 4}, {}, 0, 1.25)
    chosen = placement.place("abc", 1)
    assert chosen == home("abc", ["w:1", "w:2"])
    assert placement.sent == {chosen: 1} and placement.overflow == {}


def test_past_the_bound_the_shared_queue_and_the_overflow_is_counted() -> None:
    workers = ["w:1", "w:2"]
    busy = home("abc", workers)
    assert busy is not None
    other = next(w for w in workers if w != busy)
    # load(busy) + 1 = 11 > 1.25 * (10 + 0 + 1) / 2 = 6.9
    placement = Placement.of(workers, {busy: 10, other: 0}, {}, 0, 1.25)
    assert placement.place("abc", 1) is None
    assert placement.overflow == {busy: 1} and placement.shared == 1


def test_an_idle_worker_takes_its_own_message_whatever_its_size() -> None:
    placement = Placement.of(["w:1", "w:2"], {}, {}, 0, 1.25)
    assert placement.place("abc", 32) == home("abc", ["w:1", "w:2"])


def test_no_prefix_or_one_worker_goes_to_the_shared_queue() -> None:
    assert Placement.of(["w:1", "w:2"], {}, {}, 0, 1.25).place("", 1) is None
    assert Placement.of(["w:1"], {}, {}, 0, 1.25).place("abc", 1) is None


@given(
    st.lists(st.integers(0, 40), min_size=2, max_size=6),
    st.lists(st.sampled_from(PREFIXES[:5]), min_size=1, max_size=200),
    st.floats(1.0, 2.0),
)
def test_no_worker_is_sent_past_c_times_the_mean(
    running: list[int], prefixes: list[str], factor: float
) -> None:
    """Whatever the loads and however hot a prefix: a worker's load after a message sent to it
    by affinity is within max(|m|, c * mean) of the loads then."""
    workers = [f"w:{i}" for i in range(len(running))]
    placement = Placement.of(workers, dict(zip(workers, running, strict=True)), {}, 0, factor)
    for prefix in prefixes:
        before = dict(placement.load)
        bound = placement.bound(1)
        chosen = placement.place(prefix, 1)
        if chosen is not None:
            assert before[chosen] + 1 <= bound
            assert placement.load[chosen] <= max(1, factor * placement.total / len(workers))


def test_a_worker_tries_its_own_queue_first_and_lanes_keep_their_order() -> None:
    order = LaneOrder()
    order.items = []
    own = {
        lane: lane_queues(lane, "m", "vm:7", {"standard", "bulk"})
        for lane in ("realtime", "standard", "bulk")
    }
    queues = [q for lane in ("bulk", "realtime", "standard") for q in reversed(own[lane])]
    order.update(queues)
    assert order.items == [
        "realtime:m",
        own_queue("standard", "m", "vm:7"),
        "standard:m",
        own_queue("bulk", "m", "vm:7"),
        "bulk:m",
    ]
    assert owner_of(own_queue("bulk", "m", "vm:7")) == "vm:7" and owner_of("bulk:m") is None
    assert shared_of(own_queue("bulk", "m", "vm:7")) == "bulk:m"
