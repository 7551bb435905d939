"""Running a message's jobs: claim them under a lease, generate, hand the outcomes to the recorder.

- A claim (``transitions.claim``) moves a message's jobs (one, or a bulk chunk) from ``queued``
  to ``running`` in one transaction and gives each a new fencing token. A redelivered message
  for jobs that are running, finished or cancelled claims nothing, so jobs cancelled while
  queued never run.
- The jobs go into the engine at once, at most the worker's slots at a time; each outcome goes
  to the recorder (``workers/recorder.py``) as soon as its job leaves the engine.
- No DB transaction is open while the engine works. Database errors are retried with backoff
  and the Celery message is acknowledged only after every outcome is committed.
- Job slots are taken from the lane intake when the message arrives and given back as each job
  leaves the engine (``workers/intake.py``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from app.core import dispatch, outbox, relay, transitions
from app.core.db import transaction, with_db_retry
from app.core.models import LANE_PRIORITY, JobStatus, now
from app.core.settings import Settings
from app.core.transitions import DEADLINE_EXCEEDED, Lease, Outcome
from workers import metrics, tools
from workers.engines.base import EngineDeadError, EngineRequestError, GenRequest
from workers.intake import Intake
from workers.recorder import Recorder
from workers.runner import GenResult, Runner

log = logging.getLogger("inferq.executor")


@dataclass(frozen=True)
class Claim:
    """A job this worker claimed: its lease, its engine request and what its caller awaits."""

    lease: Lease
    request: GenRequest
    deadline: float | None
    relay: str | None  # a caller waits (app/core/relay.py): "end" or "tokens"
    reply_to: str | None  # where the relay goes
    echo: str = ""  # what the output starts with (``echo``: see echo_of)

    @property
    def job_id(self) -> str:
        return self.lease.job_id

    @property
    def token(self) -> int:
        return self.lease.token

    @property
    def created_at(self) -> float:
        return self.request.arrival


@dataclass(frozen=True)
class Released:
    """A job that left this worker without an outcome: someone else owns it now.

    ``reason``: the runner's abort reason, ``shutdown`` (handed back to the queue) or
    ``lease_lost`` (reclaimed by the reaper).
    """

    reason: str


def request_id(job_id: str, token: int) -> str:
    """One engine request id per claim: a re-run of the job is a new engine request."""
    return f"{job_id}.{token}"


# The sampling options GenRequest has fields of its own for, and ``echo``, which the executor
# applies itself (echo_of); the rest travel in ``options``.
_OWN_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "stop", "seed", "echo"})


def echo_of(job: Any) -> str:
    """What a job with ``echo`` shows before its output, as vLLM's server does: the prompt of a
    completion; of a chat, the last message's content if it is the assistant's (the reply
    continues it), else nothing."""
    if not job.params.get("echo"):
        return ""
    if job.messages is None:
        return str(job.prompt or "")
    last = job.messages[-1] if job.messages else {}
    return str(last.get("content") or "") if last.get("role") == "assistant" else ""


def request_for(job: Any, token: int, settings: Settings) -> GenRequest:
    """The engine request for a claimed row (``transitions.CLAIMED``) or an ORM ``Job``, on a
    worker of ``settings.model_name``: a job naming another model names one of its adapters."""
    params: dict[str, Any] = job.params
    adapter = None if job.model == settings.model_name else job.model
    mine = adapter in settings.adapters_of(settings.model_name)
    return GenRequest(
        adapter=adapter,
        adapter_path=settings.adapters[adapter].path if adapter and mine else None,
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
        options={k: v for k, v in params.items() if k not in _OWN_FIELDS},
        tools=job.tools,
    )


def ending_of(result: GenResult, echo: str = "") -> Outcome | Released:
    """How a generation that left the engine ends its job (``echo``: see echo_of)."""
    error: tuple[str | None, str | None] = (None, None)
    finish: str | None
    match result.abort_reason:
        case None if result.finish_reason == "abort":
            status, finish = JobStatus.FAILED, "abort"
            error = ("engine_aborted", "the engine aborted the request")
        case None:
            status, finish = JobStatus.SUCCEEDED, result.finish_reason
        case "cancelled":
            status, finish = JobStatus.CANCELLED, "cancelled"
        case "deadline":
            status, finish = JobStatus.EXPIRED, "deadline"
            error = (DEADLINE_EXCEEDED, "the job's timeout_s passed while it was running")
        case reason:
            return Released(reason)
    choices = result.choices
    if choices is not None:
        # A job stopped while running ends every choice as it ends (the runner says "abort").
        stopped = {} if result.abort_reason is None else {"finish_reason": finish}
        choices = [{**c, "text": echo + c["text"], **stopped} for c in choices]
    return Outcome(
        status,
        error_code=error[0],
        error_message=error[1],
        text=echo + result.text,
        finish_reason=finish,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        first_token_at=result.first_token_at,
        choices=choices,
    )


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
        self.announcer = outbox.Announcer()
        publisher = relay.Publisher(dispatch.redis_client())
        self.recorder = Recorder(worker_id, publisher, self.announcer)
        self._lock = threading.Lock()
        # job id -> lease token (None until claimed, and again once out of the engine);
        # membership is set before the claim so that a cancel published right after the claim
        # commits is not missed.
        self._held: dict[str, int | None] = {}
        self._aborts: dict[str, str] = {}

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
        if claim.relay != "tokens" or claim.reply_to is None:
            return None
        reply_to, token, publish = claim.reply_to, claim.token, self.recorder.relay.piece
        if claim.echo:  # the caller's first piece is what the output starts with
            publish(reply_to, token, claim.echo)
        return lambda text, _tokens: publish(reply_to, token, text) if text else None

    def _ending(
        self, claim: Claim, future: concurrent.futures.Future[GenResult]
    ) -> Outcome | Released:
        """How the job left the engine (raises EngineDeadError)."""
        try:
            result = future.result()
            if claim.request.tools is not None:
                result = tools.with_calls(result, claim.request.tools, self.runner.engine)
            return ending_of(result, claim.echo)
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
        with transaction() as connection:
            rows, after = transitions.claim(
                connection,
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
                echo=echo_of(row),
            )
            for row in rows
        ]
        for claim in claims:
            metrics.QUEUE_WAIT.labels(claim.lease.lane).observe(max(0.0, stamp - claim.created_at))
        after.run(announce=self.announcer.put)
        return claims

    def _hand_back(self, claim: Claim) -> None:
        """Return a job this worker cannot finish to the queue, without waiting for its lease."""

        def release() -> None:
            with transaction() as connection:
                after = transitions.hand_back(connection, claim.lease, now(), worker=self.worker_id)
            after.run()

        with_db_retry(release, "hand back")
