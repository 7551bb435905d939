"""Running a message's jobs: claim them under a lease, generate, hand the outcomes to the recorder.

- A claim (``transitions.claim``) moves a message's jobs (one, or a bulk chunk) from ``queued``
  to ``running`` in one transaction and gives each a new fencing token. A redelivered message
  for jobs that are running, finished or cancelled claims nothing, so jobs cancelled while
  queued never run.
- The jobs go into the engine at once, at most the worker's slots at a time; each outcome goes
  to the recorder (``workers/inference/recorder.py``) as soon as its job leaves the engine.
- No DB transaction is open while the engine works. Database errors are retried with backoff
  and the Celery message is acknowledged only after every outcome is committed.
- Job slots are taken from the lane intake when the message arrives and given back as each job
  leaves the engine (``workers/inference/intake.py``).

Its parts (runner, recorder, intake) are built by the worker's composition root
(workers/inference/main.py) and passed in.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence

from app.core.db import with_db_retry
from app.core.lifecycle import transitions
from app.core.lifecycle.changes import changes
from app.core.lifecycle.transitions import Outcome
from app.core.models import JobStatus, now
from app.core.settings import Settings
from workers import metrics
from workers.engines.base import (
    EngineDeadError,
    EngineRequestError,
    GenChunk,
    GenRequest,
    PoolRequest,
    PoolResult,
)
from workers.inference import tools
from workers.inference.claims import (
    Claim,
    Released,
    ending_of,
    pooled_ending_of,
    request_for,
    request_id,
)
from workers.inference.intake import Intake
from workers.inference.recorder import Recorder
from workers.inference.runner import Result, Runner

log = logging.getLogger("inferq.executor")


class Executor:
    def __init__(
        self,
        runner: Runner,
        recorder: Recorder,
        intake: Intake,
        settings: Settings,
        on_engine_dead: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self.recorder = recorder
        self.intake = intake
        self.worker_id = recorder.worker_id
        self.settings = settings
        self.on_engine_dead = on_engine_dead
        self._lock = threading.Lock()
        # job id -> lease token (None until claimed, and again once out of the engine);
        # membership is set before the claim so that a cancel published right after the claim
        # commits is not missed.
        self._held: dict[str, int | None] = {}
        self._aborts: dict[str, str] = {}
        # job id -> the calls of a streamed job with tools, found as its output is relayed
        self._streamed: dict[str, tools.Streamed] = {}

    def start(self) -> None:
        """Start the recorder (its thread, the relay's and the announcer's)."""
        self.recorder.start()

    def held(self) -> dict[str, int]:
        """The leases this worker holds in its engine: job id -> token."""
        with self._lock:
            return {job_id: token for job_id, token in self._held.items() if token is not None}

    def request_abort(self, job_id: str, reason: str) -> bool:
        """Stop a job this worker holds (cancel, deadline, lost lease); False if not held."""
        with self._lock:
            if job_id not in self._held:
                return False
            self._aborts.setdefault(job_id, reason)
            token = self._held[job_id]
        if token is not None:
            self.runner.abort(request_id(job_id, token), reason)
        return True

    def execute(
        self, job_ids: Sequence[str], lane: str, message_id: str | None = None
    ) -> dict[str, int]:
        """Run one message's jobs; returns how many ended which way.

        Slots were usually taken when the message was received; ``message_id`` says which.
        """
        ids = list(dict.fromkeys(job_ids))
        with self.intake.hold(lane, len(ids), key=message_id) as slots, self._holding(ids):
            claims = with_db_retry(lambda: self.claim(ids), "claim")
            slots.release(len(ids) - len(claims))
            ended: Counter[str] = Counter(skipped=len(ids) - len(claims))
            if ended["skipped"]:
                # A duplicate or late message (its jobs taken, ended or cancelled): rare, and
                # the one trace of it now that Celery's per-task lines are off.
                log.info(
                    "message %s: %d of %d job(s) no longer queued, skipped",
                    message_id,
                    ended["skipped"],
                    len(ids),
                )
            with self._lock:
                for claim in claims:
                    self._held[claim.job_id] = claim.token
            # A message may carry more jobs than the worker has slots (a bulk chunk on a small
            # worker): at most ``slots`` of them are in the engine at once.
            waiting = deque(claims)
            futures: dict[concurrent.futures.Future[Result], Claim] = {}
            running = self._start_from(waiting, max(1, self.intake.slots), futures)
            recorded: list[tuple[Claim, Outcome, concurrent.futures.Future[bool]]] = []
            try:
                while running:
                    done, running = concurrent.futures.wait(
                        running, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    self.intake.left(len(done))
                    slots.release(len(done))
                    with self._lock:
                        # Out of the engine: no lease to renew (the outcome write is fenced by
                        # its token), so a heartbeat does not take it for a lost lease.
                        for future in done:
                            self._held[futures[future].job_id] = None
                    for future in done:
                        claim = futures[future]
                        ending = self._ending(claim, future)
                        if isinstance(ending, Released):
                            if ending.reason == "shutdown":
                                self._hand_back(claim)
                            ended[ending.reason] += 1
                        else:
                            recorded.append((claim, ending, self.recorder.put(claim, ending)))
                    running |= self._start_from(waiting, len(done), futures)
            except EngineDeadError:
                unfinished = [c for f, c in futures.items() if not f.done() or f.exception()]
                unfinished += list(waiting)
                log.critical("the engine died; handing %d job(s) back", len(unfinished))
                for claim in unfinished:
                    self._hand_back(claim)
                self.on_engine_dead()
                raise
            for claim, outcome, written in recorded:
                ended[self.recorder.stored(claim, outcome, written) or "fenced"] += 1
            return {k: v for k, v in ended.items() if v}

    @contextlib.contextmanager
    def _holding(self, ids: list[str]) -> Iterator[None]:
        """The message's jobs count as held (cancels find them) until it is done."""
        with self._lock:
            for job_id in ids:
                self._held[job_id] = None
        try:
            yield
        finally:
            with self._lock:
                for job_id in ids:
                    self._held.pop(job_id, None)
                    self._aborts.pop(job_id, None)
                    self._streamed.pop(job_id, None)

    def _start_from(
        self,
        waiting: deque[Claim],
        n: int,
        futures: dict[concurrent.futures.Future[Result], Claim],
    ) -> set[concurrent.futures.Future[Result]]:
        """Put up to ``n`` waiting claims into the engine (one wake-up); returns their futures."""
        claims = [waiting.popleft() for _ in range(min(n, len(waiting)))]
        if not claims:
            return set()
        started = self.runner.submit_many(
            [(c.request, c.deadline, self._relay_pieces(c)) for c in claims]
        )
        with self._lock:
            reasons = [self._aborts.get(c.job_id) for c in claims]
        for claim, reason in zip(claims, reasons, strict=True):
            if reason is not None:  # cancelled (or expired) before it reached the engine
                self.runner.abort(claim.request.request_id, reason)
        futures.update(zip(started, claims, strict=True))
        self.intake.entered(len(started))
        return set(started)

    def _relay_pieces(self, claim: Claim) -> Callable[[GenChunk], None] | None:
        """The engine's output pieces of a streamed job go to its caller (on the loop thread),
        each with its choice's index and, asked for, its tokens' logprobs; a job with tools
        relays its content and pieces of its calls instead of its text
        (workers/inference/tools.py)."""
        request = claim.request
        if claim.relay != "tokens" or claim.reply_to is None or isinstance(request, PoolRequest):
            return None  # a pooled job streams nothing: its caller gets the end
        reply_to, token, publish = claim.reply_to, claim.token, self.recorder.relay.piece
        if request.tool_choice == "none":

            def relay(chunk: GenChunk) -> None:
                # A token with no text (the end of sequence) still has its logprob.
                if chunk.text or chunk.logprobs:
                    publish(reply_to, token, chunk.text, chunk.index, None, chunk.logprobs)

            return relay
        streamed = self._streamed[claim.job_id] = tools.Streamed(
            request.tools or {}, self.runner.engine
        )

        def relay_calls(chunk: GenChunk) -> None:
            if chunk.prompt_text is not None:  # an echo: what the reply continues, no calls
                publish(reply_to, token, chunk.text, chunk.index, None, None)
                return
            found = streamed.feed(chunk)
            if found.content or found.calls or chunk.logprobs:
                publish(reply_to, token, found.content, chunk.index, found.calls, chunk.logprobs)

        return relay_calls

    def _ending(
        self, claim: Claim, future: concurrent.futures.Future[Result]
    ) -> Outcome | Released:
        """How the job left the engine (raises EngineDeadError)."""
        try:
            result = future.result()
            if isinstance(result, PoolResult):
                return pooled_ending_of(result, claim.lines)
            streamed = self._streamed.pop(claim.job_id, None)
            request = claim.request
            if streamed is not None:
                result = streamed.apply(result)
            elif isinstance(request, GenRequest) and request.tools is not None:
                result = tools.with_calls(result, request.tools, self.runner.engine)
            return ending_of(result)
        except EngineRequestError as exc:
            return Outcome(JobStatus.FAILED, error_code=exc.code, error_message=str(exc))
        except EngineDeadError:
            raise
        except Exception as exc:
            log.exception("job %s failed in the engine", claim.job_id)
            return Outcome(
                JobStatus.FAILED, error_code="engine_error", error_message=type(exc).__name__
            )

    def claim(self, job_ids: list[str]) -> list[Claim]:
        """Claim the queued ones among ``job_ids`` in one transaction; expire the overdue."""
        stamp = now()
        with changes("worker", worker=self.worker_id, announce=self.recorder.announce) as tx:
            rows = transitions.claim(
                tx,
                job_ids,
                worker=self.worker_id,
                lease_s=self.settings.lease_ttl_s,
                stamp=stamp,
            )
        claims = [
            Claim(
                lease=transitions.lease_of(row),
                request=request_for(row, row.lease_token, self.settings),
                deadline=row.deadline_at,
                relay=row.relay,
                reply_to=row.reply_to,
                lines=row.lines,
            )
            for row in rows
        ]
        for claim in claims:
            metrics.QUEUE_WAIT.labels(claim.lease.lane).observe(max(0.0, stamp - claim.created_at))
        return claims

    def _hand_back(self, claim: Claim) -> None:
        """Return a job this worker cannot finish to the queue, without waiting for its lease."""

        def release() -> None:
            with changes("worker", worker=self.worker_id, reason="handed_back") as tx:
                transitions.hand_back(tx, claim.lease, now())

        with_db_retry(release, "hand back")
