"""A dispatcher's presence record (app/dispatcher/loop.py) is kept by a thread of its own and is
honest about the loop: present while the loop runs (a loop waiting for the database included,
tests/integration/test_presence.py), withdrawn at once when the loop ends or fails, and when it
has not gone round for ``STALL_S`` (here shortened), written again when it does."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from app.core.messaging import clients
from app.core.messaging.names import DISPATCHER_KEY_PREFIX
from app.core.settings import Settings
from app.dispatcher import loop
from app.dispatcher.loop import Dispatcher
from tests.support import wait_until


@pytest.fixture
def dispatcher(core: Settings) -> Iterator[Dispatcher]:
    yield Dispatcher(core, clients.redis_client())


def record(dispatcher: Dispatcher) -> dict[str, object] | None:
    raw = clients.redis_client().get(DISPATCHER_KEY_PREFIX + dispatcher.worker_id)
    return None if raw is None else dict(json.loads(raw))


def test_the_record_is_kept_while_the_loop_runs_and_withdrawn_on_a_clean_stop(
    dispatcher: Dispatcher,
) -> None:
    stop = threading.Event()
    running = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
    running.start()
    try:
        wait_until(lambda: record(dispatcher) is not None, 5, "the record")
        assert dispatcher.health() == (True, "ok")
        found = record(dispatcher)
        assert found is not None
        assert found["role"] == "dispatcher" and found["sent"] == 0 and found["queues"] == []
    finally:
        stop.set()
        running.join(10)
    assert not running.is_alive()
    assert record(dispatcher) is None
    assert dispatcher.health() == (False, "the dispatcher's loop is not running")


def test_a_loop_that_fails_withdraws_the_record_at_once(
    dispatcher: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    failing = threading.Event()

    def step() -> None:
        failing.wait(10)
        raise RuntimeError("a bug in the loop")

    monkeypatch.setattr(dispatcher, "step", step)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            dispatcher.run(threading.Event())
        except RuntimeError as exc:
            errors.append(exc)

    running = threading.Thread(target=run, daemon=True)
    running.start()
    wait_until(lambda: record(dispatcher) is not None, 5, "the record")
    failing.set()
    running.join(10)
    assert errors and record(dispatcher) is None


def test_a_loop_that_hangs_past_the_bound_is_withdrawn_until_it_goes_round(
    dispatcher: Dispatcher, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Above an idle step (a wait of IDLE_S for a wake-up), far below the real bound.
    monkeypatch.setattr(loop, "STALL_S", 3 * loop.IDLE_S)
    hung = threading.Event()
    go_on = threading.Event()
    step = dispatcher.step

    def hanging() -> None:
        if not go_on.is_set():
            hung.set()
            go_on.wait(10)
        step()

    monkeypatch.setattr(dispatcher, "step", hanging)
    stop = threading.Event()
    running = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
    running.start()
    try:
        wait_until(lambda: hung.is_set(), 5, "the loop to hang")
        wait_until(lambda: record(dispatcher) is None, 8, "the hung loop's record to go")
        healthy, why = dispatcher.health()
        assert not healthy and "has not gone round" in why
        go_on.set()
        wait_until(lambda: record(dispatcher) is not None, 5, "the record to come back")
        assert dispatcher.health() == (True, "ok")
    finally:
        go_on.set()
        stop.set()
        running.join(10)
    assert record(dispatcher) is None
