"""What a claimed job is, as the inference worker holds it, and how it ends: pure functions of
a claimed row and of what the engine returned, with no database, Redis or engine behind them.

- :class:`Claim`: a job this worker claimed (its lease, its engine request, who waits on it);
- :func:`request_for`: the engine request of a claimed row (``transitions.CLAIMED``);
- :func:`ending_of`: the outcome (or release) of a generation that left the engine;
- :func:`echo_of`: what an ``echo`` request's output starts with.

The executor (workers/inference/executor.py) and the recorder (recorder.py) both use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core.models import LANE_PRIORITY, JobStatus
from app.core.settings import Settings
from app.core.transitions import DEADLINE_EXCEEDED, Lease, Outcome
from workers.engines.base import GenRequest
from workers.inference.runner import GenResult


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
