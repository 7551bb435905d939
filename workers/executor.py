"""Running a message's jobs: claim them under a lease, generate, record outcomes behind the fence.

- A claim is a compare-and-set from ``queued`` to ``running`` that increments the fencing token;
  a message's jobs (one, or a bulk chunk) are claimed in one transaction. A redelivered message
  for jobs that are running, finished or cancelled claims nothing, so jobs cancelled while
  queued never run.
- Every job of a message is in the engine at once; each outcome is written as soon as the job
  finishes, ``WHERE lease_token = <ours> AND status = 'running'``: a worker that lost its lease
  (paused, partitioned, presumed dead) changes nothing. Outcomes from all task threads are
  group-committed by one recorder thread, so a busy worker writes many results per transaction.
- No DB transaction is open while the engine works. Database errors are retried with backoff
  and the Celery message is acknowledged only after every outcome is committed.
- Job slots are taken from the lane intake when the message starts and given back as each job
  leaves the engine (``workers/intake.py``).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from sqlalchemy import bindparam, select, update
from sqlalchemy.exc import InterfaceError, OperationalError

from app.core import dispatch, jobs, outbox, relay, transitions
from app.core.db import session_scope
from app.core.models import (
    DEADLINE_EXCEEDED,
    LANE_PRIORITY,
    Job,
    JobStatus,
    can_transition,
    expire_overdue,
    job_update,
    now,
)
from app.core.settings import Settings
from app.core.transitions import Transition
from workers import metrics
from workers.engines.base import EngineDeadError, EngineRequestError, GenRequest
from workers.intake import Intake
from workers.runner import GenResult, Runner

log = logging.getLogger("inferq.executor")
T = TypeVar("T")


def with_db_retry(fn: Callable[[], T], what: str, stop: threading.Event | None = None) -> T:
    """Run ``fn`` until the database answers: workers pause while it is down."""
    delay = 0.2
    while True:
        try:
            return fn()
        except (OperationalError, InterfaceError) as exc:
            if stop is not None and stop.is_set():
                raise
            log.warning(
                "database unavailable during %s, retrying in %.1fs: %s",
                what,
                delay,
                exc.orig if hasattr(exc, "orig") else exc,
            )
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


@dataclass(frozen=True)
class Claim:
    job_id: str
    token: int
    request: GenRequest
    deadline: float | None
    webhook: bool  # the job has a webhook_url: its end creates an event
    relay: str | None  # a caller waits on app/core/relay.py: "end" or "tokens"
    lane: str
    tenant: str
    attempt: int

    @property
    def created_at(self) -> float:
        return self.request.arrival

    def moved(self, to: str, source: str, error_code: str | None = None) -> Transition:
        return Transition(self.job_id, self.lane, self.tenant, to, source, self.attempt, error_code)


@dataclass(frozen=True)
class Outcome:
    status: str
    result: GenResult | None = None
    error_code: str | None = None
    error_message: str | None = None


def request_id(job_id: str, token: int) -> str:
    """One engine request id per claim: a re-run of the job is a new engine request."""
    return f"{job_id}.{token}"


def request_for(job: Any, token: int) -> GenRequest:
    """The engine request for a job row (an ORM ``Job`` or a row with the same columns)."""
    params: dict[str, Any] = job.params
    return GenRequest(
        request_id=request_id(job.id, token),
        prompt=job.prompt,
        messages=job.messages,
        max_tokens=int(params["max_tokens"]),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        stop=tuple(params.get("stop") or ()),
        seed=params.get("seed"),
        priority=LANE_PRIORITY[job.lane],
        arrival=job.created_at,
    )


def outcome_of(result: GenResult) -> Outcome | None:
    """Map a finished generation to the job's final state (None: write nothing)."""
    reason = result.abort_reason
    if reason is None:
        if result.finish_reason == "abort":
            return Outcome(
                JobStatus.FAILED, result, "engine_aborted", "the engine aborted the request"
            )
        return Outcome(JobStatus.SUCCEEDED, result)
    if reason == "cancelled":
        result.finish_reason = "cancelled"
        return Outcome(JobStatus.CANCELLED, result)
    if reason == "deadline":
        result.finish_reason = "deadline"
        return Outcome(
            JobStatus.EXPIRED,
            result,
            DEADLINE_EXCEEDED,
            "the job's timeout_s passed while it was running",
        )
    return None  # lease lost or shutting down: someone else owns the job now


RECORD_BATCH = 512

# The fenced outcome write, one row per parameter set (see Executor._record_many).
RECORD_STATEMENT = (
    update(Job)
    .where(
        Job.id == bindparam("b_id"),
        Job.lease_token == bindparam("b_token"),
        Job.status == JobStatus.RUNNING,
    )
    .values(
        status=bindparam("b_status"),
        finished_at=bindparam("b_stamp"),
        updated_at=bindparam("b_stamp"),
        lease_expires_at=None,
        error_code=bindparam("b_error_code"),
        error_message=bindparam("b_error_message"),
        result_text=bindparam("b_text"),
        finish_reason=bindparam("b_finish_reason"),
        prompt_tokens=bindparam("b_prompt_tokens"),
        completion_tokens=bindparam("b_completion_tokens"),
        first_token_at=bindparam("b_first_token_at"),
    )
)


def _record_params(claim: Claim, outcome: Outcome, stamp: float) -> dict[str, Any]:
    if not can_transition(JobStatus.RUNNING, outcome.status):
        raise ValueError(f"a job cannot go from running to {outcome.status}")
    r = outcome.result
    return {
        "b_id": claim.job_id,
        "b_token": claim.token,
        "b_status": str(outcome.status),
        "b_stamp": stamp,
        "b_error_code": outcome.error_code,
        "b_error_message": outcome.error_message,
        # PostgreSQL text cannot hold NUL, which a model can emit: store U+FFFD instead.
        "b_text": r.text.replace("\x00", "\ufffd") if r is not None else None,
        "b_finish_reason": r.finish_reason if r is not None else None,
        "b_prompt_tokens": r.prompt_tokens if r is not None else None,
        "b_completion_tokens": r.completion_tokens if r is not None else None,
        "b_first_token_at": r.first_token_at if r is not None else None,
    }


class Recorder:
    """Group commit of outcomes: one thread writes whatever has queued up in one transaction."""

    def __init__(self, write: Callable[[list[tuple[Claim, Outcome]]], list[bool]]) -> None:
        self._write = write
        self._queue: queue.SimpleQueue[tuple[Claim, Outcome, concurrent.futures.Future[bool]]] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="recorder", daemon=True)
        self._thread.start()

    def put(self, claim: Claim, outcome: Outcome) -> concurrent.futures.Future[bool]:
        """Queue an outcome; the future says whether it was written (False: fenced off)."""
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        self._queue.put((claim, outcome, future))
        return future

    def _loop(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < RECORD_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._settle(batch)
            except Exception:
                # One bad row must not take the others down with it: write them one by one.
                log.exception("recording %d outcomes together failed; one by one now", len(batch))
                for item in batch:
                    try:
                        self._settle([item])
                    except Exception as exc:
                        item[2].set_exception(exc)

    def _settle(self, batch: list[tuple[Claim, Outcome, concurrent.futures.Future[bool]]]) -> None:
        items = [(claim, outcome) for claim, outcome, _ in batch]
        written = with_db_retry(partial(self._write, items), "record")
        for (_, _, future), ok in zip(batch, written, strict=True):
            future.set_result(ok)


class Executor:
    def __init__(
        self,
        runner: Runner,
        worker_id: str,
        settings: Settings,
        on_engine_dead: Callable[[], None] = lambda: None,
        intake: Intake | None = None,
    ) -> None:
        self.runner = runner
        self.on_engine_dead = on_engine_dead
        self.worker_id = worker_id
        self.settings = settings
        self.intake = intake or Intake.from_settings(settings)
        self.recorder = Recorder(self._record_many)
        self.announcer = outbox.Announcer()
        self.relay = relay.Publisher(dispatch.redis_client())
        self._lock = threading.Lock()
        # job id -> lease token (None until claimed); membership is set before the claim so
        # that a cancel published right after the claim commits is not missed.
        self._held: dict[str, int | None] = {}
        self._aborts: dict[str, str] = {}

    def held(self) -> dict[str, int]:
        """The leases this worker holds: job id -> token."""
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
        self.intake.take(lane, len(ids), key=message_id)
        slots = len(ids)
        with self._lock:
            for job_id in ids:
                self._held[job_id] = None
        try:
            claims = with_db_retry(lambda: self._claim(ids), "claim")
            ended: Counter[str] = Counter(skipped=len(ids) - len(claims))
            self.intake.give(lane, slots - len(claims))
            slots = len(claims)
            with self._lock:
                for claim in claims:
                    self._held[claim.job_id] = claim.token
            # A message may carry more jobs than the worker has slots (a bulk chunk on a small
            # worker): at most ``slots`` of them are in the engine at once.
            waiting = deque(claims)
            futures: dict[concurrent.futures.Future[GenResult], Claim] = {}
            running = self._start_from(waiting, max(1, self.intake.slots), futures)
            recorded: list[tuple[Claim, Outcome, concurrent.futures.Future[bool]]] = []
            try:
                while running:
                    done, running = concurrent.futures.wait(
                        running, return_when=concurrent.futures.FIRST_COMPLETED
                    )
                    self.intake.give(lane, len(done))
                    slots -= len(done)
                    with self._lock:
                        # Out of the engine: no lease to renew (the outcome write is fenced by
                        # its token), so a heartbeat does not take it for a lost lease.
                        for future in done:
                            self._held[futures[future].job_id] = None
                    for future in done:
                        claim = futures[future]
                        outcome = self._outcome(claim, future)
                        if isinstance(outcome, str):
                            ended[outcome] += 1
                        else:
                            written = self.recorder.put(claim, outcome)
                            if claim.relay is not None:
                                written.add_done_callback(partial(self._relay_end, claim))
                            recorded.append((claim, outcome, written))
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
                status = self._stored(claim, outcome, written)
                if status is None:
                    log.warning(
                        "job %s: lease %d lost; result discarded", claim.job_id, claim.token
                    )
                    status = "fenced"
                ended[status] += 1
            return {k: v for k, v in ended.items() if v}
        finally:
            if slots:
                self.intake.give(lane, slots)
            self.intake.settle(message_id)
            with self._lock:
                for job_id in ids:
                    self._held.pop(job_id, None)
                    self._aborts.pop(job_id, None)

    def _stored(
        self, claim: Claim, outcome: Outcome, written: concurrent.futures.Future[bool]
    ) -> str | None:
        """The status the job was left in (None: fenced off, nothing written).

        An outcome the database refuses fails the job instead of leaving it running.
        """
        try:
            return str(outcome.status) if written.result() else None
        except Exception as exc:
            log.exception("job %s: its outcome could not be stored; failing it", claim.job_id)
            failed = Outcome(
                JobStatus.FAILED,
                None,
                "result_not_stored",
                f"the result could not be stored ({type(exc).__name__})",
            )
            return str(failed.status) if self.recorder.put(claim, failed).result() else None

    def _start_from(
        self,
        waiting: deque[Claim],
        n: int,
        futures: dict[concurrent.futures.Future[GenResult], Claim],
    ) -> set[concurrent.futures.Future[GenResult]]:
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
        return set(started)

    def _relay_pieces(self, claim: Claim) -> Callable[[str, int], None] | None:
        """The engine's output pieces of a streamed job go to its caller (on the loop thread)."""
        if claim.relay != "tokens":
            return None
        job_id, token, publish = claim.job_id, claim.token, self.relay.piece
        return lambda text, _tokens: publish(job_id, token, text) if text else None

    def _relay_end(self, claim: Claim, written: concurrent.futures.Future[bool]) -> None:
        """The outcome is committed (or fenced off): a waiting caller may read the row now."""
        if not written.cancelled() and written.exception() is None and written.result():
            self.relay.end(claim.job_id, claim.token)

    def _outcome(self, claim: Claim, future: concurrent.futures.Future[GenResult]) -> Outcome | str:
        """The outcome to record, or why nothing is recorded (raises EngineDeadError)."""
        try:
            result = future.result()
        except EngineRequestError as exc:
            return Outcome(JobStatus.FAILED, None, exc.code, str(exc))
        except EngineDeadError:
            raise
        except Exception as exc:
            log.exception("job %s failed in the engine", claim.job_id)
            return Outcome(JobStatus.FAILED, None, "engine_error", type(exc).__name__)
        finished = outcome_of(result)
        if finished is None:
            # Stopped by this worker for a reason that leaves the job to someone else.
            if result.abort_reason == "shutdown":
                self._hand_back(claim)
            return result.abort_reason or "dropped"
        return finished

    def _claim(self, job_ids: list[str]) -> list[Claim]:
        """Claim the queued ones among ``job_ids`` in one transaction; expire the overdue."""
        stamp = now()
        with session_scope() as session:
            # Core execution: the ORM's bulk-update bookkeeping costs more than the SQL here.
            connection = session.connection()
            expired = transitions.of_rows(
                connection.execute(expire_overdue(job_ids, stamp)),
                JobStatus.EXPIRED,
                JobStatus.QUEUED,
                DEADLINE_EXCEEDED,
            )
            events: list[str] = []
            if expired:
                events = outbox.record_job_events(connection, job_ids, stamp)
            rows = connection.execute(
                job_update(
                    job_ids,
                    expect=JobStatus.QUEUED,
                    to=JobStatus.RUNNING,
                    lease_token=Job.lease_token + 1,
                    lease_owner=self.worker_id,
                    lease_expires_at=stamp + self.settings.lease_ttl_s,
                    attempts=Job.attempts + 1,
                    started_at=stamp,
                    updated_at=stamp,
                ).returning(
                    Job.id,
                    Job.lease_token,
                    Job.lane,
                    Job.prompt,
                    Job.messages,
                    Job.params,
                    Job.created_at,
                    Job.deadline_at,
                    Job.webhook_url,
                    Job.relay,
                    Job.tenant,
                    Job.attempts,
                )
            ).all()
        self.announcer.put(events)
        order = {job_id: i for i, job_id in enumerate(job_ids)}
        claims = [
            Claim(
                row.id,
                row.lease_token,
                request_for(row, row.lease_token),
                row.deadline_at,
                row.webhook_url is not None,
                row.relay,
                row.lane,
                row.tenant,
                row.attempts,
            )
            for row in sorted(rows, key=lambda row: order[row.id])
        ]
        for claim in claims:
            metrics.QUEUE_WAIT.labels(claim.lane).observe(max(0.0, stamp - claim.created_at))
        transitions.emit(
            expired + [c.moved(JobStatus.RUNNING, JobStatus.QUEUED) for c in claims],
            by="worker",
            worker=self.worker_id,
        )
        return claims

    def _record_many(self, items: list[tuple[Claim, Outcome]]) -> list[bool]:
        """Write outcomes in one transaction; each is fenced by its own lease token.

        One executemany (pipelined by the driver) writes every row whose status and token are
        still ours; a read in the same transaction then tells which rows were written, by their
        token and this write's ``finished_at`` stamp. Per-row round trips made the recorder the
        bottleneck of a busy worker.
        """
        stamp = now()
        params = [_record_params(claim, outcome, stamp) for claim, outcome in items]
        with session_scope() as session:
            connection = session.connection()
            connection.execute(RECORD_STATEMENT, params)
            rows = connection.execute(
                select(Job.id, Job.lease_token, Job.finished_at).where(
                    Job.id.in_([claim.job_id for claim, _ in items])
                )
            ).all()
            mine = {row.id for row in rows if row.finished_at == stamp}
            tokens = {row.id: row.lease_token for row in rows}
            written = [
                claim.job_id in mine and tokens.get(claim.job_id) == claim.token
                for claim, _ in items
            ]
            hooked = [
                c.job_id for (c, _), ok in zip(items, written, strict=True) if ok and c.webhook
            ]
            events = outbox.record_job_events(connection, hooked, stamp)
        self.announcer.put(events)
        self._observe([item for item, ok in zip(items, written, strict=True) if ok], stamp)
        return written

    def _observe(self, recorded: list[tuple[Claim, Outcome]], stamp: float) -> None:
        """Metrics and log lines of committed outcomes."""
        for claim, outcome in recorded:
            r = outcome.result
            if r is not None and r.first_token_at is not None:
                metrics.TTFT.labels(claim.lane).observe(
                    max(0.0, r.first_token_at - claim.created_at)
                )
            if outcome.status == JobStatus.SUCCEEDED:
                metrics.E2E.labels(claim.lane).observe(max(0.0, stamp - claim.created_at))
        transitions.emit(
            [c.moved(o.status, JobStatus.RUNNING, o.error_code) for c, o in recorded],
            by="worker",
            worker=self.worker_id,
        )

    def _hand_back(self, claim: Claim) -> None:
        """Return a job this worker cannot finish to the queue, without waiting for its lease."""

        def release() -> None:
            with session_scope() as session:
                lane = session.execute(
                    job_update(
                        claim.job_id,
                        expect=JobStatus.RUNNING,
                        to=JobStatus.QUEUED,
                        token=claim.token,
                        lease_owner=None,
                        lease_expires_at=None,
                        enqueued_at=None,
                        updated_at=now(),
                    ).returning(Job.lane)
                ).scalar()
                if lane is not None:
                    session.commit()
                    transitions.emit(
                        [claim.moved(JobStatus.QUEUED, JobStatus.RUNNING)],
                        by="worker",
                        worker=self.worker_id,
                        reason="handed_back",
                    )
                    jobs.send(session, [(claim.job_id, lane)])

        with_db_retry(release, "hand back")
