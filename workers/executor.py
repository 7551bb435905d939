"""Running one job: claim it under a lease, generate, record the outcome behind the fence.

- A claim is a compare-and-set from ``queued`` to ``running`` that increments the fencing token.
  A redelivered message for a job that is running, finished or cancelled claims nothing, so
  jobs cancelled while queued never run.
- The outcome is written ``WHERE lease_token = <ours> AND status = 'running'``: a worker that
  lost its lease (paused, partitioned, presumed dead) changes nothing.
- No DB transaction is open while the engine works. Database errors are retried with backoff
  and the Celery message is acknowledged only after the outcome is committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.exc import InterfaceError, OperationalError

from app import jobs
from app.db import session_scope
from app.models import LANE_PRIORITY, Job, JobStatus, job_update, now
from app.settings import Settings
from workers.engines.base import EngineDeadError, EngineRequestError, GenRequest
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


@dataclass(frozen=True)
class Outcome:
    status: str
    result: GenResult | None = None
    error_code: str | None = None
    error_message: str | None = None


def request_id(job_id: str, token: int) -> str:
    """One engine request id per claim: a re-run of the job is a new engine request."""
    return f"{job_id}.{token}"


def request_for(job: Job, token: int) -> GenRequest:
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
            "deadline_exceeded",
            "the job's timeout_s passed while it was running",
        )
    return None  # lease lost or shutting down: someone else owns the job now


class Executor:
    def __init__(
        self,
        runner: Runner,
        worker_id: str,
        settings: Settings,
        on_engine_dead: Callable[[], None] = lambda: None,
    ) -> None:
        self.runner = runner
        self.on_engine_dead = on_engine_dead
        self.worker_id = worker_id
        self.settings = settings
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

    def execute(self, job_id: str) -> str:
        with self._lock:
            self._held[job_id] = None
        try:
            claim = with_db_retry(lambda: self._claim(job_id), "claim")
            if claim is None:
                return "skipped"
            return self._run(claim)
        finally:
            with self._lock:
                self._held.pop(job_id, None)
                self._aborts.pop(job_id, None)

    def _run(self, claim: Claim) -> str:
        with self._lock:
            self._held[claim.job_id] = claim.token
            pending_abort = self._aborts.get(claim.job_id)
        future = self.runner.submit(claim.request, deadline=claim.deadline)
        if pending_abort is not None:
            self.runner.abort(claim.request.request_id, pending_abort)
        try:
            result = future.result()
        except EngineRequestError as exc:
            outcome = Outcome(JobStatus.FAILED, None, exc.code, str(exc))
        except EngineDeadError:
            log.critical("engine died while running %s; handing the job back", claim.job_id)
            self._hand_back(claim)
            self.on_engine_dead()
            raise
        except Exception as exc:
            log.exception("job %s failed in the engine", claim.job_id)
            outcome = Outcome(JobStatus.FAILED, None, "engine_error", type(exc).__name__)
        else:
            finished = outcome_of(result)
            if finished is None:
                # Stopped by this worker for a reason that leaves the job to someone else.
                if result.abort_reason == "shutdown":
                    self._hand_back(claim)
                return result.abort_reason or "dropped"
            outcome = finished
        written = with_db_retry(lambda: self._record(claim, outcome), "record")
        if not written:
            log.warning("job %s: lease %d lost; result discarded", claim.job_id, claim.token)
            return "fenced"
        return str(outcome.status)

    def _claim(self, job_id: str) -> Claim | None:
        with session_scope() as session:
            job = session.get(Job, job_id)
            if job is None:
                log.warning("message for unknown job %s dropped", job_id)
                return None
            if job.status != JobStatus.QUEUED:
                return None
            stamp = now()
            if job.deadline_at is not None and job.deadline_at <= stamp:
                session.execute(
                    job_update(
                        job_id,
                        expect=JobStatus.QUEUED,
                        to=JobStatus.EXPIRED,
                        finished_at=stamp,
                        updated_at=stamp,
                        error_code="deadline_exceeded",
                        error_message="the job's timeout_s passed before it started",
                    )
                )
                return None
            token = session.execute(
                job_update(
                    job_id,
                    expect=JobStatus.QUEUED,
                    to=JobStatus.RUNNING,
                    lease_token=Job.lease_token + 1,
                    lease_owner=self.worker_id,
                    lease_expires_at=stamp + self.settings.lease_ttl_s,
                    attempts=Job.attempts + 1,
                    started_at=stamp,
                    updated_at=stamp,
                ).returning(Job.lease_token)
            ).scalar()
            if token is None:
                return None
            return Claim(job_id, int(token), request_for(job, int(token)), job.deadline_at)

    def _record(self, claim: Claim, outcome: Outcome) -> bool:
        stamp = now()
        values: dict[str, Any] = {
            "finished_at": stamp,
            "updated_at": stamp,
            "lease_expires_at": None,
            "error_code": outcome.error_code,
            "error_message": outcome.error_message,
        }
        if outcome.result is not None:
            r = outcome.result
            values.update(
                result_text=r.text,
                finish_reason=r.finish_reason,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                first_token_at=r.first_token_at,
            )
        with session_scope() as session:
            done = session.execute(
                job_update(
                    claim.job_id,
                    expect=JobStatus.RUNNING,
                    to=outcome.status,
                    token=claim.token,
                    **values,
                )
            )
            return bool(done.rowcount)  # type: ignore[attr-defined]

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
                    jobs.send(session, [(claim.job_id, lane)])

        with_db_retry(release, "hand back")
