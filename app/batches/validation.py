"""Reading a batch's input file and starting its jobs (ops worker).

The file is read twice, streaming, never whole. The first pass (:func:`validate`) checks every
line: JSON, a unique ``custom_id``, ``method`` POST, ``url`` equal to the batch's endpoint, and a
body the endpoint itself would accept (:func:`parse`, the same request model as the realtime
endpoint, its model resolved once), its prompt within the model's context, at most
``batch_max_lines``; any error fails the batch with line-numbered ``errors`` and nothing is
enqueued. The second pass (:func:`start`) inserts one bulk job per line
(``jobs.new_job`` with the line's place in the batch) and moves the batch to ``in_progress``
in the same transaction, so the jobs exist exactly when the batch says so; the dispatcher is
woken for them after the commit. Every line's deadline is the batch's ``expires_at``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any, BinaryIO

from pydantic import ValidationError

from app.batches import transitions as batch_transitions
from app.core import catalog, clients, jobs, storage, tokens, transitions
from app.core.changes import changes
from app.core.db import session_scope
from app.core.errors import DomainError, Kind, named, pydantic_error
from app.core.models import Batch, BatchStatus, NewJob, now
from app.core.openai_format import REQUEST_TYPES
from app.core.schemas import JobCreate, storable
from app.core.settings import get_settings

log = logging.getLogger("inferq.batches")

MAX_ERRORS = 100  # validation stops after this many bad lines
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


def parse(raw: bytes | None, endpoint: str, limit: int) -> tuple[str, JobCreate, str]:
    """One line's custom_id, job body and model (resolved); raises DomainError naming what is
    wrong."""
    if raw is None:
        raise _bad("line_too_long", f"the line is longer than {limit} bytes")
    try:
        line = json.loads(raw)
    except ValueError as exc:
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
        or not storable(custom_id)
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
    try:
        job = REQUEST_TYPES[endpoint].model_validate(body).job()
        model = catalog.resolve(job.model)
    except ValidationError as exc:
        code, param, message = pydantic_error(exc.errors()[0])
        param = f"body.{param}" if param else "body"
        raise _bad(code, named(param, message), param) from None
    except DomainError as exc:
        raise _in_body(exc) from None
    return custom_id, job, model


def _in_body(exc: DomainError) -> DomainError:
    return _bad(exc.code, f"body: {exc.message}", f"body.{exc.param}" if exc.param else "body")


# --- the two passes ---------------------------------------------------------------------------


def validate(batch: Batch) -> tuple[list[dict[str, Any]], int]:
    """First pass over the input: (errors, number of requests)."""
    settings = get_settings()
    limit, most = settings.max_body_bytes, settings.batch_max_lines
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    count = 0
    try:
        source = storage.open_file(batch.input_file_id)
    except FileNotFoundError:
        return [_error("file_not_found", f"file {batch.input_file_id} was deleted", None, None)], 0
    with source:
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
                custom_id, job, model = parse(raw, batch.endpoint, limit)
                _check_context(job, model)
                if custom_id in seen:
                    raise _bad(
                        "duplicate_custom_id",
                        f"custom_id {custom_id!r} is used by an earlier line",
                        "custom_id",
                    )
                seen.add(custom_id)
            except DomainError as exc:
                errors.append(_error(exc.code, exc.message, exc.param, number))
                if len(errors) >= MAX_ERRORS:
                    break
    if not errors and count == 0:
        errors.append(_error("empty_file", "the input file has no requests", None, None))
    return errors, count


def _check_context(job: JobCreate, model: str) -> None:
    """The prompt within the model's context (the second pass need not tokenize it again)."""
    try:
        tokens.check(clients.redis_client(), [model], [job])
    except DomainError as exc:
        raise _in_body(exc) from None


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
    errors, count = validate(batch)
    stamp = now()
    if errors:
        with changes("ops", batch_id=batch_id) as tx:
            failed = batch_transitions.fail(tx, batch_id, held, stamp, errors)
            if not failed:
                batch_transitions.release(tx, batch_id, held)  # cancelled meanwhile
        if not failed:
            return "cancelled while validating"  # the sweep finalizes it
        log.info("batch %s failed validation (%d errors)", batch_id, len(errors))
        return "failed"
    if not _insert_jobs(batch, count, stamp, held):
        with changes("ops", batch_id=batch_id) as tx:
            batch_transitions.release(tx, batch_id, held)
        return "cancelled while validating"
    log.info("batch %s in progress: %d requests", batch_id, count)
    return "in_progress"


class _Cancelled(Exception):
    """The batch moved on while its jobs were inserted: the transaction rolls back."""


def _insert_jobs(batch: Batch, count: int, stamp: float, held: float) -> bool:
    """Second pass: one bulk job per line, and the batch in_progress, in one transaction; False
    (nothing written) if it was cancelled meanwhile."""
    limit = get_settings().max_body_bytes
    try:
        with changes("ops", batch_id=batch.id) as tx:
            new: list[NewJob] = []
            with storage.open_file(batch.input_file_id) as source:
                for number, raw in lines(source, limit):
                    custom_id, body, model = parse(raw, batch.endpoint, limit)
                    line = jobs.BatchLine(batch.id, custom_id, number, batch.expires_at)
                    new.append(jobs.new_job(batch.tenant, body, model, created=stamp, line=line))
                    if len(new) == transitions.INSERT_CHUNK:
                        transitions.create(tx, new)
                        new = []
            transitions.create(tx, new)
            if not batch_transitions.start(tx, batch.id, held, stamp, total=count):
                raise _Cancelled  # no job was ever visible
    except _Cancelled:
        return False
    return True
