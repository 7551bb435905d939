"""The bridge between Celery's task threads and the one engine of this worker process.

The runner owns a private asyncio loop on a daemon thread; the engine is built and driven only
there. Any task thread calls :meth:`Runner.submit` and blocks on the returned future, so jobs
from all threads are in flight in the same engine at once and a continuous-batching engine
batches them at every step.

With ``batching="micro"`` (always for engines without continuous batching) the runner releases
static micro-batches instead: a batch leaves when it has ``max_size`` requests or its oldest has
waited ``max_wait``, and the next batch waits until the previous one has finished.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

from app.core.models import LANE_PRIORITY, choice
from app.core.settings import Settings
from workers import metrics
from workers.engines.base import Engine, EngineStats, GenChunk, GenRequest, PoolRequest, PoolResult

log = logging.getLogger("inferq.runner")

REALTIME_PRIORITY = LANE_PRIORITY["realtime"]
# Steps whose median a step budget is held to: the median of all recent ones (the worker's
# announced step time) would follow a change too slowly.
BUDGET_STEPS = 8
BULK_PRIORITY = LANE_PRIORITY["bulk"]


@dataclass
class GenResult:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    first_token_at: float | None
    abort_reason: str | None = None  # set when the runner stopped it: cancelled, deadline, ...
    # Every choice (index, text, finish_reason, logprobs; stop_reason and prompt_logprobs where
    # the engine gave them), where the request asked for more than one (``n``, several
    # prompts), for logprobs or for the prompt's; ``text`` and ``finish_reason`` are choice 0's.
    choices: list[dict[str, Any]] | None = None
    # ``echo``: what each choice's output starts with, by choice, and with logprobs asked the
    # prompt's tokens' (the first without one); claims.ending_of puts them in front.
    echoes: dict[int, tuple[str, list[dict[str, Any]] | None]] = field(default_factory=dict)


def _choices(
    count: int,
    texts: dict[int, list[str]],
    finishes: dict[int, str],
    logprobs: dict[int, list[dict[str, Any]]] | None,
    aborted: bool,
    extras: dict[int, dict[str, Any]],
) -> list[dict[str, Any]]:
    return [
        {
            **choice(
                i,
                "".join(texts.get(i, ())),
                "abort" if aborted else finishes.get(i),
                None if logprobs is None else logprobs.get(i, []),
            ),
            **extras.get(i, {}),
        }
        for i in range(count)
    ]


def _echo_logprobs(prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A prompt's logprobs (``GenChunk.prompt_logprobs``) as the output's are stored
    (``token_logprob``), for an ``echo`` with logprobs: the first token has none (None)."""
    return [
        {
            "token": p["token"],
            "logprob": p["logprob"],
            "top_logprobs": [
                {"token": t["token"], "logprob": t["logprob"]} for t in p["top_logprobs"]
            ],
        }
        for p in prompt
    ]


def _prompts(req: GenRequest) -> list[GenRequest]:
    """The engine requests of ``req``: itself, or one per prompt of several (``prompts``)."""
    if not req.prompts:
        return [req]
    return [
        replace(req, request_id=f"{req.request_id}/{p}", prompt=prompt, prompts=())
        for p, prompt in enumerate(req.prompts)
    ]


class MicroBatcher:
    """Static micro-batching in front of the engine (the classic dynamic batcher)."""

    def __init__(self, max_size: int, max_wait_s: float) -> None:
        self.max_size = max_size
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[int, float, str, asyncio.Future[None]]] = []
        self._in_flight: set[str] = set()
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # (size, why it left: "full" or "waited") of recent batches, for metrics and tests.
        self.history: deque[tuple[int, str]] = deque(maxlen=256)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="micro-batcher")

    async def admit(self, req: GenRequest) -> None:
        """Wait until ``req`` is released in a batch."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((req.priority, time.monotonic(), req.request_id, future))
        self._changed.set()
        try:
            await future
        except asyncio.CancelledError:
            self._pending = [p for p in self._pending if p[3] is not future]
            raise

    def done(self, request_id: str) -> None:
        self._in_flight.discard(request_id)
        self._changed.set()

    async def _loop(self) -> None:
        while True:
            self._pending = [p for p in self._pending if not p[3].done()]
            if not self._pending or self._in_flight:
                self._changed.clear()
                await self._changed.wait()
                continue
            oldest = min(p[1] for p in self._pending)
            remaining = oldest + self.max_wait_s - time.monotonic()
            if len(self._pending) < self.max_size and remaining > 0:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), remaining)
                continue
            self._pending.sort(key=lambda p: (p[0], p[1]))
            batch, self._pending = self._pending[: self.max_size], self._pending[self.max_size :]
            self.history.append((len(batch), "full" if len(batch) == self.max_size else "waited"))
            for _, _, request_id, future in batch:
                self._in_flight.add(request_id)
                future.set_result(None)


# (request, deadline, on_delta, the caller's future): one request for the loop thread to start.
# What the engine gives back for a request: a generation's text, or a pooled job's rows.
Result = GenResult | PoolResult

_Spawn = tuple[
    GenRequest | PoolRequest,
    float | None,
    Callable[[GenChunk], None] | None,
    concurrent.futures.Future[Result],
]


def _settle(future: concurrent.futures.Future[Result], task: asyncio.Task[Result]) -> None:
    """Copy a finished task's outcome to the caller's future."""
    if task.cancelled():
        future.set_exception(concurrent.futures.CancelledError())
    elif (exc := task.exception()) is not None:
        future.set_exception(exc)
    else:
        future.set_result(task.result())


class BulkPacer:
    """Keeps bulk work from delaying realtime first tokens (used on the loop thread only).

    While realtime traffic is active (a realtime request in the last ``WINDOW_S``):

    - **prefills**: once the engine is busy (``busy_at`` bulk requests in it), at most
      ``limit`` bulk requests are in prefill (submitted, no first token yet) at once, and none
      enters while a realtime request awaits its first token. A step that prefills a bulk
      message's 32 new sequences lasts several decode steps, and a realtime request scheduled
      in it, or arriving during it, waits for all of it.
    - **step budget**: with ``step_budget_ms`` set, no bulk request enters while the engine's
      recent steps (``step_ms()``, the median of the last few) take longer than the budget,
      so the running bulk sequences thin out as they finish until a step fits it; those that
      enter are prefill-limited as above (at least one at a time) however few are running. A
      realtime request waits for the step under way and then for its own, so both shrink; the
      price is bulk throughput while realtime traffic lasts (docs/benchmarks.md, "mixed").
      One bulk request always may run, so bulk never stops.

    Without realtime traffic bulk is not paced: pacing costs bulk throughput (measured:
    0.925 -> 0.789 of the engine's on vLLM CPU), which only buys something when there is
    realtime work to protect. The first realtime request after a quiet spell can still share
    a step with a bulk message's prefills. ``limit`` 0 and ``step_budget_ms`` 0 turn each off.
    """

    WINDOW_S = 5.0
    RECHECK_S = 0.02  # while bulk waits: how often time alone (the window, the steps) is checked

    def __init__(
        self,
        limit: int,
        busy_at: int = 0,
        step_budget_ms: float = 0.0,
        step_ms: Callable[[], float | None] = lambda: None,
    ) -> None:
        self.limit = limit
        self.busy_at = busy_at
        self.step_budget_ms = step_budget_ms
        self.step_ms = step_ms
        self.bulk_in_engine = 0
        self.bulk_prefilling = 0
        self.realtime_waiting = 0
        self.last_realtime = float("-inf")
        # Bulk requests waiting to enter, first come first served: each change wakes at most
        # the ones it lets in (hundreds of waiters re-checking on every change cost the engine
        # loop's thread more than the steps they wait for).
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._recheck: asyncio.TimerHandle | None = None

    def realtime_in(self) -> None:
        self.realtime_waiting += 1
        self.last_realtime = time.monotonic()

    def realtime_out(self) -> None:
        self.realtime_waiting -= 1
        self._admit_waiting()

    async def bulk_in(self) -> None:
        if not self._waiting and self._may_admit():
            self._enter()
            return
        entered: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(entered)
        self._schedule_recheck()
        try:
            await entered
        except asyncio.CancelledError:
            if entered.cancelled():  # cancelled while waiting (a deadline, an abort)
                with contextlib.suppress(ValueError):  # _admit_waiting may have dropped it
                    self._waiting.remove(entered)
            else:  # let in, then cancelled before it could run
                self.bulk_done()
                self.bulk_first_token()
            raise

    def bulk_first_token(self) -> None:
        self.bulk_prefilling -= 1
        self._admit_waiting()

    def bulk_done(self) -> None:
        self.bulk_in_engine -= 1
        self._admit_waiting()

    def _enter(self) -> None:
        self.bulk_prefilling += 1
        self.bulk_in_engine += 1

    def _admit_waiting(self) -> None:
        while self._waiting and self._may_admit():
            entered = self._waiting.popleft()
            if entered.done():  # cancelled while waiting: it takes no place
                continue
            self._enter()
            entered.set_result(None)

    def _schedule_recheck(self) -> None:
        if self._recheck is None:
            self._recheck = asyncio.get_running_loop().call_later(self.RECHECK_S, self._on_recheck)

    def _on_recheck(self) -> None:
        self._recheck = None
        self._admit_waiting()
        if self._waiting:
            self._schedule_recheck()

    def _may_admit(self) -> bool:
        if time.monotonic() - self.last_realtime > self.WINDOW_S:
            return True
        limit = self.limit
        if self.step_budget_ms > 0:
            if self.bulk_in_engine == 0:
                return True  # one bulk request always may run: bulk never stops
            step = self.step_ms()
            if step is not None and step > self.step_budget_ms:
                return False
            # The engine is kept below its busy point here: without the prefill limit, the
            # bulk held back would all enter together, in steps far over the budget.
            limit = max(1, limit)
        elif limit <= 0 or self.bulk_in_engine < self.busy_at:
            return True
        return self.realtime_waiting == 0 and self.bulk_prefilling < limit


def yield_cpu_to_engine(increment: int) -> None:
    """Lower the priority of every thread of this process (threads made later inherit it).

    Called once an engine that runs in processes of its own (vLLM's EngineCore) has started:
    those processes keep their priority. The work of this process - vLLM's front end, Celery,
    claims, result writes, heartbeats - can wait a few milliseconds; the engine's scheduler
    loop is on the critical path of every step. The in-process baseline of ``inferq bench``
    does the same, so comparisons stay like for like. Linux only: niceness is per thread there.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return
    for tid in os.listdir(tasks):
        with contextlib.suppress(OSError):  # a thread that has just ended
            current = os.getpriority(os.PRIO_PROCESS, int(tid))
            os.setpriority(os.PRIO_PROCESS, int(tid), min(19, current + increment))
    log.info("this process's threads niced +%d: the engine's processes come first", increment)


class Runner:
    def __init__(
        self,
        engine: Engine,
        *,
        batching: str = "continuous",
        micro_max_size: int = 16,
        micro_max_wait_ms: float = 100.0,
        bulk_prefill_limit: int = 0,
        bulk_busy_at: int = 0,
        step_budget_ms: float = 0.0,
        step_ms: Callable[[], float | None] = lambda: None,
        yield_cpu: int = 0,
    ) -> None:
        self.engine = engine
        self.yield_cpu = yield_cpu
        continuous = engine.continuous_batching and batching != "micro"
        self.batching = "continuous" if continuous else "micro"
        self._micro_args = (micro_max_size, micro_max_wait_ms / 1000.0)
        self.batcher: MicroBatcher | None = None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="engine-loop", daemon=True)
        self._tasks: dict[str, asyncio.Task[Result]] = {}
        self._abort_reasons: dict[str, str] = {}
        # Static micro-batches run as a unit: there is no engine step to keep short.
        self.pacer = BulkPacer(
            bulk_prefill_limit if continuous else 0,
            bulk_busy_at,
            step_budget_ms if continuous else 0.0,
            step_ms,
        )

    @classmethod
    def from_settings(cls, engine: Engine, settings: Settings, *, pacing: bool = True) -> Runner:
        """The runner a worker builds; ``pacing=False`` gives the raw engine (baselines)."""
        return cls(
            engine,
            batching=settings.batching,
            micro_max_size=settings.micro_batch_max_size,
            micro_max_wait_ms=settings.micro_batch_max_wait_ms,
            bulk_prefill_limit=settings.bulk_prefill_limit if pacing else 0,
            bulk_busy_at=settings.worker_concurrency // 2,
            step_budget_ms=settings.realtime_step_ms if pacing else 0.0,
            step_ms=functools.partial(metrics.steps.median_ms, BUDGET_STEPS),
            yield_cpu=settings.worker_nice,
        )

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self) -> None:
        """Start the loop thread and the engine (blocks until the engine is ready)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self) -> None:
        await self.engine.start()
        if self.yield_cpu and self.engine.own_processes:
            yield_cpu_to_engine(self.yield_cpu)
        if self.batching == "micro":
            self.batcher = MicroBatcher(*self._micro_args)
            self.batcher.start()

    @overload
    def submit(
        self,
        req: GenRequest,
        *,
        deadline: float | None = None,
        on_delta: Callable[[GenChunk], None] | None = None,
    ) -> concurrent.futures.Future[GenResult]: ...

    @overload
    def submit(
        self,
        req: PoolRequest,
        *,
        deadline: float | None = None,
        on_delta: Callable[[GenChunk], None] | None = None,
    ) -> concurrent.futures.Future[PoolResult]: ...

    def submit(
        self,
        req: GenRequest | PoolRequest,
        *,
        deadline: float | None = None,
        on_delta: Callable[[GenChunk], None] | None = None,
    ) -> concurrent.futures.Future[Any]:
        """Start ``req`` in the engine; the future resolves when it finishes or is stopped.

        ``deadline`` is unix time; past it the request is aborted with reason ``deadline``.
        ``on_delta(chunk)`` is called on the loop thread for every streamed piece (its
        ``index`` is the choice's: a request with ``n`` > 1 streams several) and for the last.
        """
        future: concurrent.futures.Future[Result] = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self._spawn, [(req, deadline, on_delta, future)])
        return future

    def submit_many(
        self,
        requests: list[
            tuple[GenRequest | PoolRequest, float | None, Callable[[GenChunk], None] | None]
        ],
    ) -> list[concurrent.futures.Future[Result]]:
        """:meth:`submit` for several (request, deadline, on_delta) with one loop wake-up."""
        futures: list[concurrent.futures.Future[Result]] = [
            concurrent.futures.Future() for _ in requests
        ]
        batch: list[_Spawn] = [
            (req, deadline, on_delta, f)
            for (req, deadline, on_delta), f in zip(requests, futures, strict=True)
        ]
        self.loop.call_soon_threadsafe(self._spawn, batch)
        return futures

    def _spawn(self, batch: list[_Spawn]) -> None:
        # Lighter than run_coroutine_threadsafe, whose two-way future chaining was the largest
        # single cost of a busy worker's loop thread (py-spy, ceiling benchmark).
        for req, deadline, on_delta, future in batch:
            if future.set_running_or_notify_cancel():
                work: Coroutine[Any, Any, Result] = (
                    self._pool(req, deadline)
                    if isinstance(req, PoolRequest)
                    else self._generate(req, deadline, on_delta)
                )
                task = self.loop.create_task(work)
                task.add_done_callback(functools.partial(_settle, future))

    def abort(self, request_id: str, reason: str) -> None:
        """Stop a request from any thread; it finishes with ``abort_reason=reason``."""
        self.loop.call_soon_threadsafe(self._abort, request_id, reason)

    def _abort(self, request_id: str, reason: str) -> None:
        task = self._tasks.get(request_id)
        if task is None or task.done():
            return
        self._abort_reasons.setdefault(request_id, reason)
        task.cancel()

    async def _merged(self, subs: list[GenRequest]) -> AsyncIterator[tuple[int, GenChunk]]:
        """The engine's chunks of each request of ``subs`` (one per prompt), as they come, with
        the prompt's number; an engine error of any ends them all (vLLM's server fails a
        request of several prompts when one fails)."""
        if len(subs) == 1:
            async for chunk in self.engine.generate(subs[0]):
                yield 0, chunk
            return
        queue: asyncio.Queue[tuple[int, GenChunk | BaseException | None]] = asyncio.Queue()

        async def pump(p: int, sub: GenRequest) -> None:
            try:
                async for chunk in self.engine.generate(sub):
                    queue.put_nowait((p, chunk))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait((p, exc))
                return
            queue.put_nowait((p, None))

        tasks = [asyncio.ensure_future(pump(p, sub)) for p, sub in enumerate(subs)]
        try:
            left = len(tasks)
            while left:
                p, item = await queue.get()
                if item is None:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield p, item
        finally:
            for task in tasks:
                task.cancel()

    async def _generate(
        self,
        req: GenRequest,
        deadline: float | None,
        on_delta: Callable[[GenChunk], None] | None,
    ) -> GenResult:
        task = asyncio.current_task()
        assert task is not None
        self._tasks[req.request_id] = task
        subs = _prompts(req)
        n = int(req.options.get("n", 1))
        texts: dict[int, list[str]] = {0: []}  # by choice: prompt p's are p * n .. p * n + n - 1
        finishes: dict[int, str] = {}
        extras: dict[int, dict[str, Any]] = {}  # by choice: stop_reason, prompt_logprobs
        echoes: dict[int, tuple[str, list[dict[str, Any]] | None]] = {}
        logprobs: dict[int, list[dict[str, Any]]] | None = {} if "logprobs" in req.options else None
        # The prompt's logprobs go in front of the output's of an echo (completions only: a
        # chat's echo is the reply it continues).
        echo_logprobs = req.echo and logprobs is not None and req.messages is None
        tokens = 0
        prompt_tokens: dict[int, int] = {}  # by prompt
        started: set[int] = set()  # prompts whose first chunk came
        first_at: float | None = None
        released = False
        realtime = req.priority == REALTIME_PRIORITY
        bulk = prefilling = False
        if realtime:
            self.pacer.realtime_in()
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            async with asyncio.timeout(timeout):
                if req.priority >= BULK_PRIORITY:
                    await self.pacer.bulk_in()
                    bulk = prefilling = True
                if self.batcher is not None:
                    await self.batcher.admit(req)
                    released = True
                async for p, chunk in self._merged(subs):
                    if p not in started:
                        started.add(p)
                        for index in range(p * n, p * n + n):
                            if chunk.prompt_logprobs is not None:
                                extras.setdefault(index, {})["prompt_logprobs"] = (
                                    chunk.prompt_logprobs
                                )
                            if req.echo:
                                echoed = (
                                    _echo_logprobs(chunk.prompt_logprobs or [])
                                    if echo_logprobs
                                    else None
                                )
                                echoes[index] = (chunk.prompt_text or "", echoed)
                                if on_delta is not None and (chunk.prompt_text or echoed):
                                    # prompt_text marks the piece as the echo
                                    text = chunk.prompt_text or ""
                                    on_delta(
                                        GenChunk(
                                            text, 0, index=index, logprobs=echoed, prompt_text=text
                                        )
                                    )
                    index = p * n + chunk.index
                    if chunk.num_tokens and first_at is None:
                        first_at = time.time()
                        if realtime:
                            realtime = False
                            self.pacer.realtime_out()
                        if prefilling:
                            prefilling = False
                            self.pacer.bulk_first_token()
                    if chunk.text:
                        texts.setdefault(index, []).append(chunk.text)
                    if logprobs is not None and chunk.logprobs:
                        logprobs.setdefault(index, []).extend(chunk.logprobs)
                    tokens += chunk.num_tokens
                    if chunk.prompt_tokens is not None:
                        prompt_tokens[p] = chunk.prompt_tokens
                    if index != chunk.index:
                        chunk = replace(chunk, index=index)
                    if on_delta is not None and (
                        chunk.text or chunk.num_tokens or chunk.finish_reason
                    ):
                        on_delta(chunk)
                    if chunk.finish_reason is not None:
                        finishes[index] = chunk.finish_reason
                        if chunk.stop_reason is not None:
                            extras.setdefault(index, {})["stop_reason"] = chunk.stop_reason
        except TimeoutError:
            self._abort_reasons.setdefault(req.request_id, "deadline")
        except asyncio.CancelledError:
            if req.request_id not in self._abort_reasons:
                raise  # not our abort: the loop is shutting down
        finally:
            if realtime:
                self.pacer.realtime_out()
            if prefilling:
                self.pacer.bulk_first_token()
            if bulk:
                self.pacer.bulk_done()
            self._tasks.pop(req.request_id, None)
            if released and self.batcher is not None:
                self.batcher.done(req.request_id)
        reason = self._abort_reasons.pop(req.request_id, None)
        finish = finishes.get(0)
        if reason is not None:
            for sub in subs:
                await self.engine.abort(sub.request_id)
            finish = "abort"
        choices = None
        count = n * len(subs)
        if count > 1 or logprobs is not None or extras:
            choices = _choices(count, texts, finishes, logprobs, reason is not None, extras)
        text = "".join(texts[0])
        total_prompt = sum(prompt_tokens.values())
        return GenResult(text, finish, total_prompt, tokens, first_at, reason, choices, echoes)

    async def _pool(self, req: PoolRequest, deadline: float | None) -> PoolResult:
        """A pooled job's inputs in the engine, under the same deadline, aborts and pacing as a
        generation: its pooling is its prefill (bulk waits for the pacer to let it in)."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks[req.request_id] = task
        realtime = req.priority == REALTIME_PRIORITY
        bulk = False
        result: PoolResult | None = None
        if realtime:
            self.pacer.realtime_in()
        try:
            timeout = None if deadline is None else max(0.0, deadline - time.time())
            async with asyncio.timeout(timeout):
                if req.priority >= BULK_PRIORITY:
                    await self.pacer.bulk_in()
                    bulk = True
                result = await self.engine.pool(req)
        except TimeoutError:
            self._abort_reasons.setdefault(req.request_id, "deadline")
        except asyncio.CancelledError:
            if req.request_id not in self._abort_reasons:
                raise  # not our abort: the loop is shutting down
        finally:
            if realtime:
                self.pacer.realtime_out()
            if bulk:
                self.pacer.bulk_first_token()
                self.pacer.bulk_done()
            self._tasks.pop(req.request_id, None)
        reason = self._abort_reasons.pop(req.request_id, None)
        if reason is not None or result is None:
            return PoolResult(b"", 0, 0, abort_reason=reason or "abort")
        return result

    def in_flight(self) -> int:
        return len(self._tasks)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is left, shut the engine down, stop the loop."""
        if not self._thread.is_alive():
            return
        for request_id in list(self._tasks):
            self.abort(request_id, "shutdown")
        try:
            asyncio.run_coroutine_threadsafe(self.engine.shutdown(), self.loop).result(timeout)
        except Exception:
            log.exception("engine shutdown failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
