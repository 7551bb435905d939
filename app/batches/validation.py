"""Reading a batch's input file and starting its jobs (ops worker).

The file is read once, streaming, never whole (:func:`start`). Every line is checked: JSON, a
unique ``custom_id``, ``method`` POST, ``url`` equal to the batch's endpoint, and a body the
endpoint itself would accept (:func:`parse`, the same request model as the realtime endpoint,
its model resolved once a pass), its prompt within the model's context, at most
``batch_max_lines``. While no line has failed, each line's bulk job is made as it is read
(``jobs.new_job`` with the line's place in the batch) and the jobs are committed a chunk at a
time (``STREAM_LINES`` lines first, then twice as many each time), so the first lines run while
the rest of the file is read (issue 65: a 50,000-line file took 10 s to read and check before
its first line could start); the batch stays ``validating`` meanwhile, and each chunk's
transaction holds the batch under this ops worker's lease (``batch_transitions.hold``), so a
cancel stops what went in and nothing goes in after it. The last chunk and the move to
``in_progress`` commit together. A bad line stops the inserts and the rest is only checked: the
batch fails with line-numbered ``errors`` and the lines that started are stopped
(``batch_failed``), their work thrown away, as OpenAI's failed batch has no output
(docs/architecture.md, "Batches": why lines start before the file is checked). An ops worker
that dies mid-file leaves its chunks committed; the next one to take the batch reads the file
again from the start (the custom_ids and the count need every line) and inserts only the lines
after the last committed one (:func:`_committed_through`). Every line's deadline is the
batch's ``expires_at``.

Embedding lines are grouped instead: consecutive lines of one model and the same options
share a job of at most ``INFERQ_BATCH_EMBED_GROUP`` inputs, whose ``lines`` say which inputs
are whose (docs/openai.md, "Batches of embeddings"). An embedding takes a GPU a fraction of a
millisecond, so a job per one-input line would leave the platform, not the engine, setting the
pace. A pooled job keeps each line's custom_id and response options (``encoding_format``;
``top_n``, ``return_documents``) in ``lines``, which finalization reads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import orjson
from pydantic import ValidationError
from sqlalchemy import select

from app.batches import transitions as batch_transitions
from app.core.contract.jobs import JobCreate
from app.core.contract.pooling import input_count
from app.core.db import session_scope
from app.core.errors import DomainError, Kind, named, pydantic_error
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import clients
from app.core.models import Batch, BatchStatus, Job, JobKind, JobStatus, NewJob, now, valid_text
from app.core.openai import openai_format, pooling_format
from app.core.openai.pooling_format import EmbeddingRequest, RerankRequest
from app.core.scheduling import catalog, tokens
from app.core.settings import get_settings
from app.core.storage import store

log = logging.getLogger("inferq.batches")

# The body each endpoint's lines are read with: the endpoint's own request model; and the task
# its model must have.
REQUEST_TYPES: dict[str, Any] = {**openai_format.REQUEST_TYPES, **pooling_format.REQUEST_TYPES}
KINDS = {
    **dict.fromkeys(openai_format.ENDPOINTS, JobKind.GENERATE),
    pooling_format.EMBEDDINGS: JobKind.EMBED,
    pooling_format.RERANK: JobKind.SCORE,
    pooling_format.SCORE: JobKind.SCORE,
}
MAX_ERRORS = 100  # validation stops after this many bad lines
# Lines the first chunk commits, so that the first lines run while the rest is read (module
# docstring); each chunk after it holds twice as many, up to STREAM_LINES_MOST: a transaction
# and a wake-up every 500 lines made a 50,000-line embedding batch 7 % slower in all than one
# transaction (docs/benchmarks.md, "Issue 65").
STREAM_LINES = 500
STREAM_LINES_MOST = 8192
MAX_CUSTOM_ID = 512


# --- lines: pure, no database and no Redis ------------------------------------------------------


def lines(source: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number, bytes) of the non-blank lines; bytes None for a line over ``limit``."""
    number = 0
    while True:
        raw = source.readline(limit + 1)
        if not raw:
            return
        number += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            while (rest := source.readline(limit)) and not rest.endswith(b"\n"):
                pass  # skip the rest of an over-long line
            yield number, None
            continue
        if raw.strip():
            yield number, raw


def _bad(code: str, message: str, param: str | None = None) -> DomainError:
    return DomainError(Kind.INVALID, code, message, param=param)


@dataclass(frozen=True)
class Line:
    """One line, validated: its custom_id, model (resolved), its body as the endpoint's request
    model, and its job's body; an embedding line has none of its own (``job`` None): its
    inputs go into a group's job (:class:`_Group`)."""

    custom_id: str
    model: str
    request: Any
    job: JobCreate | None


class Models:
    """The models a batch's lines name, resolved and held to the endpoint's task once a pass,
    with the counter of each one's tokens (per line, they were a third of a line's cost)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._seen: dict[str | None, str] = {}
        self._counters: dict[str, tokens.Counter | None] = {}

    def resolve(self, requested: str | None) -> str:
        found = self._seen.get(requested)
        if found is None:
            found = catalog.resolve(requested)
            catalog.check_task(found, self.kind)
            self._seen[requested] = found
        return found

    def counter(self, model: str) -> tokens.Counter | None:
        """The counter of ``model``'s card (None: no card, the engine checks)."""
        if model not in self._counters:
            base = get_settings().base_of(model)
            self._counters[model] = tokens.counter(clients.redis_client(), base)
        return self._counters[model]


def parse(raw: bytes | None, endpoint: str, limit: int, models: Models | None = None) -> Line:
    """One line, validated; raises DomainError naming what is wrong. ``models``: the pass's
    resolved models (a fresh memo when not given)."""
    if raw is None:
        raise _bad("line_too_long", f"the line is longer than {limit} bytes")
    try:
        line = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad("invalid_json", f"the line is not valid JSON: {exc}") from None
    if not isinstance(line, dict):
        raise _bad("invalid_line", "each line must be a JSON object")
    extra = set(line) - {"custom_id", "method", "url", "body"}
    if extra:
        raise _bad("invalid_line", f"unknown key {sorted(extra)[0]!r}", sorted(extra)[0])
    custom_id = line.get("custom_id")
    if (
        not isinstance(custom_id, str)
        or not 0 < len(custom_id) <= MAX_CUSTOM_ID
        or not valid_text(custom_id)
    ):
        raise _bad(
            "invalid_custom_id",
            f"custom_id must be a string of 1 to {MAX_CUSTOM_ID} characters",
            "custom_id",
        )
    if line.get("method") != "POST":
        raise _bad("invalid_method", "method must be POST", "method")
    if line.get("url") != endpoint:
        raise _bad(
            "mismatched_url",
            f"url must be the batch's endpoint {endpoint} (got {line.get('url')!r})",
            "url",
        )
    body = line.get("body")
    if not isinstance(body, dict):
        raise _bad("invalid_body", "body must be a JSON object", "body")
    if body.get("stream"):
        raise _bad("invalid_body", "stream is not supported in a batch", "body.stream")
    models = models or Models(KINDS[endpoint])
    try:
        request = REQUEST_TYPES[endpoint].model_validate(body)
        job = None if isinstance(request, EmbeddingRequest) else request.job()
        model = models.resolve(request.model)
    except ValidationError as exc:
        code, param, message = pydantic_error(exc.errors()[0])
        param = f"body.{param}" if param else "body"
        raise _bad(code, named(param, message), param) from None
    except DomainError as exc:
        raise _in_body(exc) from None
    return Line(custom_id, model, request, job)


def shape_of(request: Any) -> dict[str, Any]:
    """What a pooled line's response is shaped by, beside its job's output."""
    if isinstance(request, EmbeddingRequest):
        return {"encoding_format": request.encoding_format}
    if isinstance(request, RerankRequest):
        return {"top_n": request.top_n, "return_documents": request.return_documents}
    return {}


def _in_body(exc: DomainError) -> DomainError:
    return _bad(exc.code, f"body: {exc.message}", f"body.{exc.param}" if exc.param else "body")


# --- the two passes ---------------------------------------------------------------------------


def _check_context(line: Line, models: Models) -> int | None:
    """The prompt (every prompt of a line with several; a pooled line's inputs) within the
    model's context; returns a line's own job's prompt tokens, as its model counts them (an
    estimate without its card), which its job is charged in the fair share as the realtime
    endpoint's is (None for a grouped line)."""
    try:
        if line.job is not None:
            return tokens.check(clients.redis_client(), [line.model], [line.job])[0]
        if (counter := models.counter(line.model)) is not None:
            counter.check_inputs(line.request.items(), line.request.pooling_options(), "input")
    except DomainError as exc:
        raise _in_body(exc) from None
    return None


def _error(code: str, message: str, param: str | None, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def start(batch_id: str) -> str:
    """Validate a ``validating`` batch and start its jobs, or fail it (ops worker)."""
    held = now()
    with changes("ops", batch_id=batch_id) as tx:
        taken = batch_transitions.take(tx, batch_id, BatchStatus.VALIDATING, held)
    if not taken:
        return "not validating, or another ops worker has it"
    with session_scope() as session:
        batch = session.get(Batch, batch_id)
        assert batch is not None
        session.expunge(batch)
    try:
        count = _read(batch, now(), held)
    except _Failed as failure:
        stamp = now()
        with changes("ops", batch_id=batch_id) as tx:
            failed = batch_transitions.fail(tx, batch_id, held, stamp, failure.errors)
            if failed:  # the lines that started before the bad one was read
                transitions.stop_batch(
                    tx, batch_id, stamp, to=JobStatus.CANCELLED, code="batch_failed"
                )
            else:
                batch_transitions.release(tx, batch_id, held)  # cancelled meanwhile
        if not failed:
            return "cancelled while validating"  # the sweep finalizes it
        log.info("batch %s failed validation (%d errors)", batch_id, len(failure.errors))
        return "failed"
    except _Cancelled:
        with changes("ops", batch_id=batch_id) as tx:
            batch_transitions.release(tx, batch_id, held)
        return "cancelled while validating"
    except DomainError as exc:
        if exc.kind != Kind.UNAVAILABLE:
            raise
        # The file store is down: the chunks already in stay, and the sweep starts the batch
        # again, going on after them (docs/files.md, "When the store is down").
        with changes("ops", batch_id=batch_id) as tx:
            batch_transitions.release(tx, batch_id, held)
        log.warning("batch %s waits for the file store: %s", batch_id, exc.message)
        return "file store unavailable"
    log.info("batch %s in progress: %d requests", batch_id, count)
    return "in_progress"


class _Cancelled(Exception):
    """The batch was cancelled (or its lease moved on) while its file was read: the chunk at
    hand rolls back; the cancel stopped the chunks before it."""


class _Failed(Exception):
    """Lines failed: the transaction rolls back, and the batch fails with ``errors``."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__(f"{len(errors)} bad line(s)")
        self.errors = errors


def _read(batch: Batch, stamp: float, held: float) -> int:
    """The one pass: check every line and, while none has failed, insert its job (or its
    group's), a chunk of lines a transaction (``STREAM_LINES``, doubling); the last chunk
    moves the batch to ``in_progress``. Returns the number of requests; raises _Failed
    (line-numbered errors, at most MAX_ERRORS; the chunks committed before stay, for the caller
    to stop) or _Cancelled."""
    settings = get_settings()
    limit, most = settings.max_body_bytes, settings.batch_max_lines
    most_inputs = settings.batch_max_embedding_inputs
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = inputs = 0
    models = Models(KINDS[batch.endpoint])
    group = _Group(batch, stamp)
    try:
        source = store.open_file(batch.input_file_id)
    except FileNotFoundError:
        error = _error("file_not_found", f"file {batch.input_file_id} was deleted", None, None)
        raise _Failed([error]) from None
    done = _committed_through(batch.id)  # an earlier attempt's chunks are in
    with source:
        new: list[NewJob] = []
        read = 0  # lines made into jobs since the last chunk
        chunk = STREAM_LINES
        for number, raw in lines(source, limit):
            count += 1
            if count > most:
                errors.append(
                    _error(
                        "too_many_requests", f"a batch holds at most {most} requests", None, number
                    )
                )
                break
            try:
                line = parse(raw, batch.endpoint, limit, models)
                counted = _check_context(line, models)
                if isinstance(line.request, EmbeddingRequest):
                    inputs += len(line.request.items())
                    if inputs > most_inputs:
                        raise _bad(
                            "too_many_inputs",
                            f"a batch embeds at most {most_inputs} inputs, list items counted "
                            f"(this line brings the count to {inputs})",
                            "body.input",
                        )
                if line.custom_id in seen:
                    raise _bad(
                        "duplicate_custom_id",
                        f"custom_id {line.custom_id!r} is used by an earlier line",
                        "custom_id",
                    )
                seen.add(line.custom_id)
            except DomainError as exc:
                errors.append(_error(exc.code, exc.message, exc.param, number))
                if len(errors) >= MAX_ERRORS:
                    break
                continue
            if errors or number <= done:
                continue  # nothing more is written after a bad line; a committed line is in
            new += (
                group.add(number, line) if line.job is None else [group.one(number, line, counted)]
            )
            read += 1
            if read >= chunk:
                _insert(batch.id, held, new + group.close())  # a group ends with its chunk
                new, read, chunk = [], 0, min(2 * chunk, STREAM_LINES_MOST)
        if not errors and count == 0:
            errors.append(_error("empty_file", "the input file has no requests", None, None))
        if errors:
            raise _Failed(errors)
        with changes("ops", batch_id=batch.id) as tx:
            transitions.create(tx, new + group.close())
            # in_progress_at is the move's own time: the read may have taken seconds (a job's
            # created_at is the read's start, when the first was built).
            if not batch_transitions.start(tx, batch.id, held, now(), total=count):
                raise _Cancelled  # cancelled meanwhile: the cancel stopped what went in
            # Its lines may all have ended while the file was read: finalize it now.
            tx.after.finalize |= transitions.batches_done(tx, {batch.id})
    return count


def _insert(batch_id: str, held: float, new: list[NewJob]) -> None:
    """Commit a chunk of the batch's jobs while it is still validating under our lease."""
    with changes("ops", batch_id=batch_id) as tx:
        if not batch_transitions.hold(tx, batch_id, held, now()):
            raise _Cancelled
        transitions.create(tx, new)


def _committed_through(batch_id: str) -> int:
    """The last line whose job an earlier attempt committed (0: none). Lines go in in file
    order, a chunk at a time, and a chunk closes its group, so the job of the highest first
    line holds the last line committed (a group's is its last line's)."""
    with session_scope() as session:
        last = session.execute(
            select(Job.batch_line, Job.lines)
            .where(Job.batch_id == batch_id, Job.batch_line.is_not(None))
            .order_by(Job.batch_line.desc())
            .limit(1)
        ).first()
    if last is None:
        return 0
    first, grouped = last
    return max([int(first), *(int(entry["line"]) for entry in grouped or [])])


class _Group:
    """Embedding lines gathered into jobs: consecutive lines of one model, the same options and
    the same kind of input (texts or token ids) share a job of at most
    ``INFERQ_BATCH_EMBED_GROUP`` inputs (a line with more has a job of its own). A grouped
    line's own ``metadata`` and ``user`` are not kept: its job's are its group's first line's."""

    def __init__(self, batch: Batch, stamp: float) -> None:
        settings = get_settings()
        self.batch = batch
        self.stamp = stamp
        self.most = min(settings.batch_embed_group, settings.pool_max_inputs)
        self._key: tuple[Any, ...] | None = None
        self._first: tuple[int, Line] | None = None
        self._inputs: list[Any] = []
        self._lines: list[dict[str, Any]] = []

    def one(self, number: int, line: Line, prompt_tokens: int | None = None) -> NewJob:
        """A line's own job, charged ``prompt_tokens`` (as counted) and what it may generate;
        a pooled one keeps its custom_id and response options."""
        assert line.job is not None
        place = jobs.BatchLine(self.batch.id, line.custom_id, number, self.batch.expires_at)
        job = jobs.new_job(
            self.batch.tenant,
            line.job,
            line.model,
            created=self.stamp,
            line=place,
            prompt_tokens=prompt_tokens,
        )
        if line.job.kind == JobKind.GENERATE:
            return job
        inputs = input_count(line.job.pooled_inputs())
        meta = {"line": number, "custom_id": line.custom_id, "inputs": inputs}
        return dataclasses.replace(job, lines=[{**meta, **shape_of(line.request)}])

    def add(self, number: int, line: Line) -> list[NewJob]:
        """Gather an embedding line; returns the job of the group it closed, if any."""
        request = line.request
        items = request.items()
        options = tuple(sorted(request.pooling_options().items()))
        key = (line.model, options, isinstance(items[0], str))
        done: list[NewJob] = []
        if self._key != key or len(self._inputs) + len(items) > self.most:
            done = self.close()
            self._key, self._first = key, (number, line)
        self._inputs += items
        meta = {"line": number, "custom_id": line.custom_id, "inputs": len(items)}
        self._lines.append({**meta, **shape_of(request)})
        return done

    def close(self) -> list[NewJob]:
        """The job of the lines gathered so far (none: nothing gathered)."""
        if self._first is None:
            return []
        number, first = self._first
        body = first.request.job(self._inputs)  # validated once for the group
        place = jobs.BatchLine(self.batch.id, None, number, self.batch.expires_at)
        job = jobs.new_job(self.batch.tenant, body, first.model, created=self.stamp, line=place)
        job = dataclasses.replace(job, lines=self._lines, line_count=len(self._lines))
        self._key = self._first = None
        self._inputs, self._lines = [], []
        return [job]
