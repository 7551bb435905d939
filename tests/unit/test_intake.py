"""The lane intake: the room rule, and the consumer changes it makes (workers/inference/intake.py).

The consumer here is a stand-in for Celery's: it keeps a queue *selection* and a live consumer
the way ``Consumer.add_task_queue`` / ``cancel_task_queue`` do (selection first, then the live
consumer), and can lose its broker connection, which is what the real one does during a Redis
outage (tests/chaos/test_dependencies.py drives the real one).
"""

from __future__ import annotations

import threading

from workers.inference.intake import Intake

MODEL = "m"


def lane_of_model(queue: str) -> str:
    """The lane of one of MODEL's queues: the intake never touches another model's."""
    lane, model = queue.split(":")
    assert model == MODEL
    return lane


class Consumer:
    def __init__(self, lanes: list[str]) -> None:
        self.selected = set(lanes)
        self.live = set(lanes)
        self.connected = True

    def add_task_queue(self, queue: str) -> None:
        lane = lane_of_model(queue)
        self.selected.add(lane)
        if not self.connected:
            # What kombu raised from a channel whose connection was closed.
            raise AttributeError("'NoneType' object has no attribute 'hostname'")
        self.live.add(lane)

    def cancel_task_queue(self, queue: str) -> None:
        lane = lane_of_model(queue)
        self.selected.discard(lane)
        if not self.connected:
            raise AttributeError("'NoneType' object has no attribute 'hostname'")
        self.live.discard(lane)

    def reconnect(self) -> None:
        """Celery rebuilds the task consumer from the selection."""
        self.connected = True
        self.live = set(self.selected)

    def call_soon(self, fn: object) -> None:
        raise AssertionError("bound on this thread: changes are applied directly")


LANES = ["realtime", "standard", "bulk"]
SHARE = {"realtime": 0.25, "standard": 0.25, "bulk": 0.25}


def bound(slots: int = 8, chunk: int = 2) -> tuple[Intake, Consumer]:
    intake = Intake(LANES, slots, SHARE, chunk, MODEL)
    consumer = Consumer(LANES)
    intake.bind(consumer)
    return intake, consumer


def test_a_lane_never_takes_the_reservations_of_the_others() -> None:
    intake, consumer = bound()
    # 8 slots, 2 reserved per lane. Bulk may fill 8 - 2 - 2 = 4 slots, in chunks of 2.
    intake.take("bulk", 2)
    assert "bulk" in consumer.live
    intake.take("bulk", 2)
    assert intake.room("bulk") == 0
    assert consumer.live == {"realtime", "standard"}
    # Realtime still has its 2 reserved slots and the 2 nobody reserved.
    assert intake.room("realtime") == 2
    intake.give("bulk", 1)
    assert consumer.live == {"realtime", "standard"}, "one slot is less than a bulk chunk"
    intake.give("bulk", 1)
    assert consumer.live == set(LANES)


def test_changes_made_while_the_broker_is_down_hold_after_it_is_back() -> None:
    intake, consumer = bound()
    consumer.connected = False
    intake.take("bulk", 2)
    intake.take("bulk", 2)  # closes bulk: the live consumer raises, the selection changed
    assert consumer.selected == {"realtime", "standard"}
    intake.give("bulk", 2)  # re-opens bulk while still down
    assert consumer.selected == set(LANES)
    intake.take("bulk", 2)  # and closes it again
    consumer.reconnect()
    assert consumer.live == {"realtime", "standard"}
    assert intake.snapshot()["open"] == ["realtime", "standard"]
    intake.give("bulk", 2)
    assert consumer.live == set(LANES), "bulk re-opens once the broker is back"


def test_changes_from_other_threads_go_through_the_consumer_loop() -> None:
    intake = Intake(LANES, 8, SHARE, 2, MODEL)
    calls: list[object] = []

    class Loop(Consumer):
        def call_soon(self, fn: object) -> None:
            calls.append(fn)

    consumer = Loop(LANES)
    intake.bind(consumer)
    thread = threading.Thread(target=lambda: (intake.take("bulk", 2), intake.take("bulk", 2)))
    thread.start()
    thread.join()
    assert consumer.live == set(LANES), "nothing changed off the consumer's loop"
    assert len(calls) == 1
    calls[0]()  # type: ignore[operator]
    assert consumer.live == {"realtime", "standard"}


class Engine:
    """What the intake reads from the engine at each step: (running, waiting)."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0

    def load(self) -> tuple[int, int]:
        return self.running, self.waiting


def watched(slots: int = 64, engine_queue: int = 2) -> tuple[Intake, Consumer, Engine, list[int]]:
    intake = Intake(LANES, slots, SHARE, 2, MODEL, engine_queue)
    consumer = Consumer(LANES)
    intake.bind(consumer)
    engine, announced = Engine(), []
    intake.watch(engine.load, lambda: announced.append(intake.capacity))
    return intake, consumer, engine, announced


def test_standard_and_bulk_wait_while_the_engines_own_queue_is_full() -> None:
    """engine_room = engine_queue - waiting_in_engine - taken_not_yet_in_engine: plenty of
    slots, but a message is taken only while fewer than engine_queue jobs wait in the engine;
    realtime is taken at once."""
    intake, consumer, engine, _ = watched()
    intake.take("bulk", 2)  # taken, not yet in the engine: the engine's queue is spoken for
    assert consumer.live == {"realtime"}
    intake.entered(2)  # in the engine, and the engine ran them
    engine.running = 2
    intake.on_step(2, 2)
    assert consumer.live == set(LANES)
    engine.waiting = 2  # two more taken and waiting in the engine: full again
    intake.take("standard", 1)
    intake.take("standard", 1)
    intake.entered(2)
    intake.on_step(2, 2)
    assert consumer.live == {"realtime"}
    intake.take("realtime", 1)
    assert "realtime" in consumer.live, "realtime is not held back by the engine's queue"
    engine.waiting = 1  # one of them started
    intake.on_step(3, 3)
    assert consumer.live == {"realtime"}, "the realtime job taken is not in the engine yet"
    intake.entered(1)
    intake.on_step(3, 3)
    assert consumer.live == set(LANES)


def test_the_capacity_is_what_runs_while_jobs_wait_through_a_step() -> None:
    intake, _, engine, announced = watched(slots=64)
    assert intake.capacity == 64, "at the start, the slots"
    engine.running, engine.waiting = 16, 3
    intake.on_step(16, 16)
    assert intake.capacity == 64, "jobs that arrived during the step do not make it full"
    intake.on_step(16, 16)
    assert intake.capacity == 16 and announced == [16]
    engine.waiting = 0
    intake.on_step(16, 16)
    engine.running = 17  # one more: less than a tenth, not announced
    intake.on_step(17, 17)
    assert intake.capacity == 17 and announced == [16]
    engine.running = 24  # shorter sequences: more fit
    intake.on_step(24, 24)
    assert intake.capacity == 24 and announced == [16, 24]
    snapshot = intake.snapshot()
    assert (snapshot["capacity"], snapshot["engine_queue"], snapshot["holds"]) == (24, 2, 26)


def test_a_bulk_message_needs_room_for_what_the_dispatcher_sends_this_worker() -> None:
    """The dispatcher sends bulk in messages of a quarter of what the smallest worker holds
    (app/core/messaging/broker.py): the room a worker wants for one follows what it holds, so an
    engine of 16 sequences does not wait for room for a whole chunk of 32."""
    intake = Intake(LANES, 256, SHARE, 32, MODEL, 4)
    engine = Engine()
    intake.watch(engine.load, lambda: None)
    assert intake.need("bulk") == 32
    engine.running, engine.waiting = 16, 4
    intake.on_step(16, 16)
    intake.on_step(16, 16)
    assert intake.holds() == 20
    assert intake.need("bulk") == 5
    assert intake.need("standard") == 1


def test_an_engine_that_ends_jobs_fast_gets_a_longer_queue() -> None:
    """The engine's queue holds at least what it ends in REFILL_S, or it idles while the next
    message comes: 40 jobs ended in the last RATE_WINDOW_S (20 a second) let 5 wait, not 2."""
    intake, consumer, engine, _ = watched(engine_queue=2)
    intake.take("bulk", 2)
    intake.entered(2)
    engine.waiting = 2
    intake.on_step(2, 2)
    assert consumer.live == {"realtime"}
    intake.left(40)
    assert intake.queue_bound() == 5
    intake.on_step(2, 2)
    assert consumer.live == set(LANES)
    assert intake.snapshot()["engine_queue"] == 5
