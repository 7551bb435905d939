"""The runner: many threads feed one engine; deadlines, aborts and micro-batches."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from app.core.settings import Settings
from workers.engines.base import GenChunk, GenRequest
from workers.engines.simulated import CostModel, SimulatedEngine
from workers.inference.runner import BulkPacer, GenResult, Runner


@pytest.fixture
def runner() -> Iterator[Runner]:
    runner = Runner(SimulatedEngine(CostModel.from_settings(Settings(), base_ms=2.0)))
    runner.start()
    yield runner
    runner.shutdown()


def test_requests_from_many_threads_are_batched_in_one_engine(runner: Runner) -> None:
    results: list[GenResult] = []
    lock = threading.Lock()
    # All submit at once, and each runs for 64 steps: on a loaded machine (CI builds images
    # beside this layer) threads started one after another missed each other's steps.
    together = threading.Barrier(24)

    def task(i: int) -> None:
        together.wait(30)
        result = runner.submit(GenRequest(f"r{i}", prompt=f"job {i}", max_tokens=64)).result(30)
        with lock:
            results.append(result)

    threads = [threading.Thread(target=task, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    engine = runner.engine
    assert isinstance(engine, SimulatedEngine)
    assert len(results) == 24
    assert all(r.completion_tokens == 64 and r.finish_reason == "length" for r in results)
    assert all(r.text and r.prompt_tokens == 2 and r.first_token_at for r in results)
    # The engine ran all 24 sequences together in one step at least once.
    assert engine.max_batch >= 20


def test_deadline_aborts_with_the_text_so_far(runner: Runner) -> None:
    started = time.time()
    result = runner.submit(
        GenRequest("d", prompt="x", max_tokens=100_000), deadline=started + 0.3
    ).result(10)
    assert result.abort_reason == "deadline"
    assert result.finish_reason == "abort"
    assert 0 < result.completion_tokens < 100_000
    assert len(result.text.split()) == result.completion_tokens
    assert time.time() - started < 2


def test_abort_from_another_thread(runner: Runner) -> None:
    streamed: list[str] = []
    future = runner.submit(
        GenRequest("c", prompt="x", max_tokens=100_000),
        on_delta=lambda chunk: streamed.append(chunk.text),
    )
    time.sleep(0.2)
    runner.abort("c", "cancelled")
    result = future.result(10)
    assert result.abort_reason == "cancelled"
    assert result.text == "".join(streamed)
    assert result.completion_tokens == len(streamed) > 0


def test_micro_batches_wait_for_size_or_time() -> None:
    engine = SimulatedEngine(CostModel.from_settings(Settings(), base_ms=1.0))
    runner = Runner(engine, batching="micro", micro_max_size=4, micro_max_wait_ms=150)
    runner.start()
    try:
        # Five requests at once: one batch of 4 leaves at once, the fifth after its wait.
        futures = [runner.submit(GenRequest(f"m{i}", prompt="x", max_tokens=4)) for i in range(5)]
        start = time.monotonic()
        for f in futures:
            f.result(10)
        assert runner.batcher is not None
        assert list(runner.batcher.history) == [(4, "full"), (1, "waited")]
        assert time.monotonic() - start >= 0.13
        # Static batching: a batch never joins a running one.
        assert engine.max_batch == 4
    finally:
        runner.shutdown()


def test_bulk_pacing_keeps_bulk_prefills_out_of_a_realtime_first_token() -> None:
    engine = SimulatedEngine(CostModel.from_settings(Settings(), base_ms=2.0))
    runner = Runner(engine, bulk_prefill_limit=2, bulk_busy_at=0)
    runner.start()
    try:
        # Realtime traffic is active: pacing applies (without it bulk enters unpaced).
        runner.submit(GenRequest("warm", prompt="hi", max_tokens=1, priority=0)).result(30)
        long_prompt = " ".join(["word"] * 400)
        bulk = [
            runner.submit(GenRequest(f"b{i}", prompt=long_prompt, max_tokens=4, priority=2))
            for i in range(12)
        ]
        in_engine: list[int] = []

        def on_delta(_chunk: GenChunk) -> None:
            if not in_engine:  # the realtime request's first token: who is in the engine?
                stats = runner.engine.stats()
                in_engine.append(stats.running + stats.waiting)

        realtime = runner.submit(
            GenRequest("rt", prompt="now", max_tokens=4, priority=0), on_delta=on_delta
        )
        done = [f.result(30) for f in bulk]
        assert realtime.result(30).first_token_at is not None
        assert all(r.completion_tokens == 4 for r in done)
        # The realtime request shared its first step with at most the 2 bulk prefills admitted
        # before it; unpaced, all 12 long bulk prompts would have been prefilled with it.
        assert in_engine and in_engine[0] <= 3
        assert runner.pacer.bulk_prefilling == 0 and runner.pacer.bulk_in_engine == 0
    finally:
        runner.shutdown()


def test_a_step_budget_holds_bulk_out_while_steps_are_too_long() -> None:
    step = [50.0]  # the engine's recent step time (ms), as the worker's metrics report it
    engine = SimulatedEngine(CostModel.from_settings(Settings(), base_ms=2.0))
    # busy_at is far above what runs here: with a budget, bulk is paced anyway.
    runner = Runner(
        engine, bulk_prefill_limit=1, bulk_busy_at=128, step_budget_ms=20, step_ms=lambda: step[0]
    )
    runner.start()
    try:
        # Realtime traffic is active: the budget applies (without it bulk enters freely).
        runner.submit(GenRequest("warm", prompt="hi", max_tokens=1, priority=0)).result(30)
        first = runner.submit(GenRequest("b0", prompt="x", max_tokens=600, priority=2))
        deadline = time.monotonic() + 10
        while runner.pacer.bulk_in_engine == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        rest = [
            runner.submit(GenRequest(f"b{i}", prompt="x", max_tokens=4, priority=2))
            for i in range(1, 6)
        ]
        time.sleep(0.2)  # several rechecks of the budget
        # One bulk request always runs; the others wait while the steps are over budget.
        stats = runner.engine.stats()
        assert stats.running + stats.waiting == 1
        assert runner.pacer.bulk_in_engine == 1 and not any(f.done() for f in rest)
        # One of those waiting is cancelled: it ends at once and takes no place.
        runner.abort("b1", "cancelled")
        cancelled = rest[0].result(30)
        assert cancelled.abort_reason == "cancelled" and cancelled.completion_tokens == 0
        step[0] = 5.0  # the steps fit the budget again: the others enter, one prefill at a time
        done = [f.result(30) for f in rest[1:]]
        assert all(r.completion_tokens == 4 for r in done)
        assert first.result(30).completion_tokens == 600
        assert runner.pacer.bulk_in_engine == 0 and runner.pacer.bulk_prefilling == 0
    finally:
        runner.shutdown()


def test_with_a_step_budget_one_bulk_request_enters_even_while_realtime_waits() -> None:
    async def scenario() -> None:
        pacer = BulkPacer(2, busy_at=128, step_budget_ms=10, step_ms=lambda: 50.0)
        pacer.realtime_in()  # a realtime request awaits its first token; steps are over budget
        await asyncio.wait_for(pacer.bulk_in(), 1)  # the engine holds no bulk: this one enters
        second = asyncio.ensure_future(pacer.bulk_in())
        await asyncio.sleep(0.1)  # several rechecks
        assert not second.done() and pacer.bulk_in_engine == 1
        pacer.realtime_out()
        pacer.bulk_first_token()
        pacer.bulk_done()  # the first one left the engine: the second takes its place
        await asyncio.wait_for(second, 1)
        assert pacer.bulk_in_engine == 1 and pacer.bulk_prefilling == 1

    asyncio.run(scenario())
