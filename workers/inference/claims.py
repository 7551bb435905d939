"""What a claimed job is, as the inference worker holds it, and how it ends: pure functions of
a claimed row and of what the engine returned, with no database, Redis or engine behind them.

- :class:`Claim`: a job this worker claimed (its lease, its engine request, who waits on it);
- :func:`request_for`: the engine request of a claimed row (``transitions.CLAIMED``), a
  generation or, for a pooled job, its inputs to embed or score;
- :func:`ending_of`: the outcome (or release) of a generation that left the engine (an
  ``echo``'s prompt in front of each choice), and :func:`pooled_ending_of` of a pooled job (a
  grouped batch job's inputs fail by line).

The executor (workers/inference/executor.py) and the recorder (recorder.py) both use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.core.lifecycle.transitions import DEADLINE_EXCEEDED, Lease, Outcome
from app.core.models import LANE_PRIORITY, JobKind, JobStatus
from app.core.settings import Settings
from workers.engines.base import GenRequest, PoolRequest, PoolResult
from workers.inference.runner import GenResult


@dataclass(frozen=True)
class Claim:
    """A job this worker claimed: its lease, its engine request and what its caller awaits."""

    lease: Lease
    request: GenRequest | PoolRequest
    deadline: float | None
    relay: str | None  # a caller waits (app/core/messaging/relay.py): "end" or "tokens"
    reply_to: str | None  # where the relay goes
    # A grouped batch job's lines (Job.lines): an input's error fails its line only.
    lines: list[dict[str, Any]] | None = None

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


# The sampling options GenRequest has fields of its own for; the rest travel in ``options``.
_OWN_FIELDS = frozenset({"max_tokens", "temperature", "top_p", "stop", "seed", "echo"})


def _options(params: dict[str, Any]) -> dict[str, Any]:
    """The options the engine gets: an ``echo`` with ``logprobs`` asks for the prompt's too
    (vLLM's rule: ``prompt_logprobs`` defaults to ``logprobs`` then)."""
    options = {k: v for k, v in params.items() if k not in _OWN_FIELDS}
    if params.get("echo") and "logprobs" in params and "prompt_logprobs" not in params:
        options["prompt_logprobs"] = params["logprobs"]
    return options


def request_for(job: Any, token: int, settings: Settings) -> GenRequest | PoolRequest:
    """The engine request for a claimed row (``transitions.CLAIMED``) or an ORM ``Job``, on a
    worker of ``settings.model_name``: a job naming another model names one of its adapters."""
    params: dict[str, Any] = job.params
    if job.kind != JobKind.GENERATE:
        inputs = job.inputs
        pairs: list[tuple[str, str]] = []
        if job.kind == JobKind.SCORE:
            queries, documents = inputs["queries"], inputs["documents"]
            if len(queries) == 1:
                queries = queries * len(documents)
            pairs = list(zip(queries, documents, strict=True))
        return PoolRequest(
            request_id=request_id(job.id, token),
            task=job.kind,
            inputs=inputs if job.kind == JobKind.EMBED else (),
            pairs=pairs,
            options=params,
            priority=LANE_PRIORITY[job.lane],
            arrival=job.created_at,
        )
    adapter = None if job.model == settings.model_name else job.model
    mine = adapter in settings.adapters_of(settings.model_name)
    # A completion's prompt other than one text (token ids, several prompts) is in ``inputs``.
    prompts: list[Any] = job.inputs or []
    return GenRequest(
        adapter=adapter,
        adapter_path=settings.adapters[adapter].path if adapter and mine else None,
        request_id=request_id(job.id, token),
        prompt=prompts[0] if len(prompts) == 1 else job.prompt,
        prompts=prompts if len(prompts) > 1 else (),
        echo=bool(params.get("echo")),
        messages=job.messages,
        max_tokens=int(params["max_tokens"]),
        temperature=float(params.get("temperature", 1.0)),
        top_p=float(params.get("top_p", 1.0)),
        stop=tuple(params.get("stop") or ()),
        seed=params.get("seed"),
        priority=LANE_PRIORITY[job.lane],
        arrival=job.created_at,
        options=_options(params),
        tools=job.tools,
    )


def ending_of(result: GenResult) -> Outcome | Released:
    """How a generation that left the engine ends its job: an ``echo``'s prompt (and its
    logprobs) in front of each choice."""
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
    echoes = result.echoes
    if choices is not None:
        # A job stopped while running ends every choice as it ends (the runner says "abort").
        stopped = {} if result.abort_reason is None else {"finish_reason": finish}
        choices = [{**c, **_echoed(c, echoes.get(c["index"])), **stopped} for c in choices]
    return Outcome(
        status,
        error_code=error[0],
        error_message=error[1],
        text=echoes.get(0, ("", None))[0] + result.text,
        finish_reason=finish,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        first_token_at=result.first_token_at,
        choices=choices,
    )


def _echoed(
    choice: dict[str, Any], echo: tuple[str, list[dict[str, Any]] | None] | None
) -> dict[str, Any]:
    """A choice's text (and logprobs) with its echo in front."""
    if echo is None:
        return {}
    text, logprobs = echo
    changed: dict[str, Any] = {"text": text + choice["text"]}
    if logprobs is not None and choice["logprobs"] is not None:
        changed["logprobs"] = logprobs + choice["logprobs"]
    return changed


def pooled_ending_of(result: PoolResult, lines: list[dict[str, Any]] | None) -> Outcome | Released:
    """How a pooled job that left the engine ends. An input the engine refused fails the whole
    job, as OpenAI answers a request with one bad input; in a batch job (``lines``) it fails
    its line only (``line_results``: each line's prompt tokens, or its error), and the job
    fails when every line did."""
    match result.abort_reason:
        case None:
            pass
        case "cancelled":
            return Outcome(JobStatus.CANCELLED, finish_reason="cancelled")
        case "deadline":
            return Outcome(
                JobStatus.EXPIRED,
                error_code=DEADLINE_EXCEEDED,
                error_message="the job's timeout_s passed while it was running",
            )
        case reason:
            return Released(reason)
    errors = result.errors
    if errors and lines is None:
        index, (code, message) = min(errors.items())
        return Outcome(JobStatus.FAILED, error_code=code, error_message=f"input {index}: {message}")
    results: dict[str, dict[str, Any]] = {}
    failed = 0
    start = 0
    for line in lines or ():
        mine = range(start, start + line["inputs"])
        refused = [i for i in mine if i in errors]
        if refused:
            code, message = errors[refused[0]]
            results[str(line["line"])] = {
                "error": {"code": code, "message": f"input {refused[0] - start}: {message}"}
            }
            failed += 1
        else:
            results[str(line["line"])] = {"prompt_tokens": sum(result.counts[i] for i in mine)}
        start += line["inputs"]
    if lines and failed == len(lines):
        error = results[str(lines[0]["line"])]["error"]
        return Outcome(
            JobStatus.FAILED,
            error_code=error["code"],
            error_message=f"every line failed; line {lines[0]['line']}: {error['message']}",
            line_results=results,
        )
    return Outcome(
        JobStatus.SUCCEEDED,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=0,
        first_token_at=result.finished_at,
        pooled=result.data,
        pooled_width=result.width,
        failed_lines=failed,
        line_results=results or None,
    )
