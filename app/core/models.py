"""SQLAlchemy models, identifiers, lanes and the job status machine; the column types that
store any text byte for byte (:class:`AnyText`, :func:`pg_json_dumps`), what text a request may
carry (:func:`valid_text`) and a choice as ``Job.choices`` holds it (:func:`choice`).

The ``jobs`` row is the source of truth for a job; a Redis message only says that work may
exist. Every status change is a compare-and-set on the row made by
``app/core/lifecycle/transitions.py``, and :data:`TRANSITIONS` lists the changes that are allowed at
all. Times are unix seconds as floats, the same on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    ColumnElement,
    Double,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    TypeDecorator,
    and_,
    any_,
    bindparam,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, QueryableAttribute, mapped_column

# Every JSON column. On PostgreSQL its strings are escaped by the engine's JSON functions
# (pg_json_dumps, pg_json_loads: app/core/db.py), as AnyText escapes text columns.
JSONType = JSON().with_variant(JSONB(), "postgresql")

# Any text, NUL included, stored byte for byte (docs/architecture.md, "Any valid text is
# stored"). SQLite keeps NUL in TEXT as it is. PostgreSQL's text and jsonb refuse it, so there
# NUL is written as ESCAPE + "0" and ESCAPE itself as ESCAPE + ESCAPE, and read back the other
# way. ESCAPE is U+FFFF, a noncharacter (Unicode keeps it for a program's internal use), so
# text that carries it is rare and pays one more character per occurrence; text without NUL or
# ESCAPE, nearly all of it, is stored unchanged and costs one scan to check.
ESCAPE = "\uffff"
_ESCAPED = re.compile("\uffff([\uffff0])")
# In JSON text (pg_json_dumps): NUL as json.dumps writes it, a \u0000 escape after an even
# number of backslashes (an odd one is an escaped backslash followed by "u0000").
_JSON_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")
_ESCAPE_UTF8 = ESCAPE.encode()


def escape(value: str) -> str:
    """``value`` as PostgreSQL stores it: without NUL (see ESCAPE)."""
    if "\x00" in value or ESCAPE in value:
        return value.replace(ESCAPE, ESCAPE + ESCAPE).replace("\x00", ESCAPE + "0")
    return value


def _unescape_one(match: re.Match[str]) -> str:
    return "\x00" if match.group(1) == "0" else ESCAPE


def unescape(value: str) -> str:
    """What :func:`escape` wrote, as it was given."""
    if ESCAPE in value:
        return _ESCAPED.sub(_unescape_one, value)
    return value


def pg_json_dumps(value: Any) -> str:
    """A JSON column's value as PostgreSQL's jsonb stores it: each string escaped as
    :func:`escape` does, done on the JSON text (where U+FFFF can only stand in a string)."""
    out = json.dumps(value, ensure_ascii=False)
    if "\\u0000" in out or ESCAPE in out:
        out = _JSON_NUL.sub("\\1" + ESCAPE + "0", out.replace(ESCAPE, ESCAPE + ESCAPE))
    return out


def _unescape_json_one(match: re.Match[str]) -> str:
    return "\\u0000" if match.group(1) == "0" else ESCAPE


def pg_json_loads(data: bytes | str) -> Any:
    """What :func:`pg_json_dumps` wrote, read from jsonb's text (psycopg hands it as bytes)."""
    if isinstance(data, bytes):
        if _ESCAPE_UTF8 not in data:
            return json.loads(data)
        data = data.decode()
    if ESCAPE in data:
        data = _ESCAPED.sub(_unescape_json_one, data)
    return json.loads(data)


class _Escaped(TypeDecorator[str]):
    """Text escaped on PostgreSQL (:func:`escape`); as its plain type elsewhere."""

    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Any:
        if dialect.name != "postgresql":
            return self.impl_instance.bind_processor(dialect)
        return super().bind_processor(dialect)

    def result_processor(self, dialect: Dialect, coltype: Any) -> Any:
        if dialect.name != "postgresql":
            return self.impl_instance.result_processor(dialect, coltype)
        return super().result_processor(dialect, coltype)

    def process_bind_param(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else escape(value)

    def process_result_value(self, value: str | None, dialect: Dialect) -> str | None:
        return None if value is None else unescape(value)


class AnyText(_Escaped):
    """``Text`` that holds any text, NUL included (see ESCAPE)."""

    impl = Text
    cache_ok = True


class AnyString(_Escaped):
    """``String(n)`` that holds any text: a TEXT column on PostgreSQL, where escaping may
    lengthen a value past n (the API bounds its length in characters)."""

    impl = String
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> Any:
        return Text() if dialect.name == "postgresql" else self.impl_instance


def among(
    column: ColumnElement[Any] | QueryableAttribute[Any],
    values: Collection[Any] | str,
    *,
    postgresql: bool,
) -> ColumnElement[bool]:
    """``column IN values`` (``values``: the values, or the name of a parameter bound at each
    execution), written ``column = ANY(:array)`` on PostgreSQL.

    An IN of n values is n bound parameters, a statement of its own for each n, and psycopg
    prepares a statement it has run five times: PostgreSQL then plans it once for any values
    (a generic plan), and for a claim of 256 ids that plan cost the server 9 times the CPU of
    the array's (0.42 against 0.047 ms a job; docs/benchmarks.md, "Issue 65"). An array is one
    parameter: one statement and one plan for every length. SQLite has no arrays: an IN there.
    """
    if postgresql:
        array = ARRAY(column.type)
        bound = (
            bindparam(values, type_=array)
            if isinstance(values, str)
            else bindparam(None, list(values), type_=array)
        )
        return column == any_(bound)
    if isinstance(values, str):
        return column.in_(bindparam(values, expanding=True))
    return column.in_(list(values))


class Base(DeclarativeBase):
    pass


class Lane(StrEnum):
    REALTIME = "realtime"
    STANDARD = "standard"
    BULK = "bulk"


# vLLM's priority scheduler runs lower values first.
LANE_PRIORITY: dict[str, int] = {Lane.REALTIME: 0, Lane.STANDARD: 1, Lane.BULK: 2}


class JobKind(StrEnum):
    """What a job asks of its model, which has one task (docs/openai.md, "Embeddings, rerank
    and score"): generate text, embed inputs into vectors, or score pairs of texts."""

    GENERATE = "generate"
    EMBED = "embed"
    SCORE = "score"


# A pooled job's output (``Job.pooled``): little-endian float32, row by row, ``pooled_width``
# values a row (a vector's dimensions; 1 for a score).
POOLED_DTYPE = "<f4"


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


TERMINAL: frozenset[str] = frozenset(
    {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED, JobStatus.EXPIRED}
)

TRANSITIONS: dict[str, frozenset[str]] = {
    JobStatus.QUEUED: frozenset(
        {JobStatus.RUNNING, JobStatus.CANCELLED, JobStatus.EXPIRED, JobStatus.FAILED}
    ),
    # running -> queued is the reaper handing an abandoned job back (lease expired).
    JobStatus.RUNNING: frozenset(
        {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.CANCELLED,
            JobStatus.EXPIRED,
            JobStatus.QUEUED,
        }
    ),
    **{status: frozenset() for status in TERMINAL},
}


# A job the dispatcher has still to send (app/dispatcher): queued, with no message out.
UNSENT = text("status = 'queued' AND enqueued_at IS NULL")
# The jobs not finished, written out (``live``): see there why a literal.
LIVE = text("status IN ('queued', 'running')")

# The jobs table's indexes that one database has and the other not (migrations/versions/0017):
# name -> (dialect, columns). SQLite keeps no statistics: for a list filtered by a status it
# found the status's rows and sorted them all for each page (1.7 s for the operator's succeeded
# jobs over a million), so its status indexes hold the id, and the page is their first rows.
# PostgreSQL's planner knows a common status from a rare one and finds the page either way; on
# it the id cost every status change more than the page gained (``ceiling`` about 5 % lower,
# its indexes 1.8 times the size: docs/benchmarks.md, "Issue 66 ... seventh session").
ONE_DATABASE: dict[str, tuple[str, tuple[str, ...]]] = {
    "ix_jobs_status_id": ("sqlite", ("status", "id")),
    "ix_jobs_tenant_status_id": ("sqlite", ("tenant", "status", "id")),
    "ix_jobs_status_lane": ("postgresql", ("status", "lane")),
    "ix_jobs_tenant_status": ("postgresql", ("tenant", "status")),
}


def built_here(dialect: str) -> Callable[..., bool]:
    """Alembic's ``include_object`` for a database of ``dialect``: every object but the indexes
    of ``ONE_DATABASE`` that it does not have (what autogenerate and the drift tests compare)."""
    skipped = {name for name, (only, _) in ONE_DATABASE.items() if only != dialect}

    def include(_object: Any, name: str | None, type_: str, *_: Any) -> bool:
        return not (type_ == "index" and name in skipped)

    return include


def can_transition(current: str, new: str) -> bool:
    return new in TRANSITIONS.get(current, frozenset())


_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


def new_id(prefix: str, at: float | None = None) -> str:
    """A time-ordered id (48-bit milliseconds + 80 random bits, Crockford base32), made now
    or ``at`` (unix seconds: the rows of history the ``history`` benchmark writes).

    Sorting ids sorts by creation time, which is what cursor pagination relies on.
    """
    value = (int((time.time() if at is None else at) * 1000) << 80) | secrets.randbits(80)
    chars = []
    for _ in range(26):
        value, rem = divmod(value, 32)
        chars.append(_CROCKFORD[rem])
    return f"{prefix}_{''.join(reversed(chars)).lower()}"


def response_id_of(job_id: str) -> str:
    """A stored response's id: its job's with another prefix (``job_X`` runs ``resp_X``)."""
    return "resp_" + job_id.removeprefix("job_")


def now() -> float:
    return time.time()


def valid_text(text: str) -> bool:
    """Valid Unicode (no lone surrogate, which JSON's \\ud800 can carry): what a request's text
    must be. Any such text is stored as it is (ESCAPE), NUL included."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def storable(text: str) -> bool:
    """Text an id or key column, which is not escaped, can hold and a lookup can search for:
    valid Unicode without NUL. An id or cursor that is not is no row's (not found)."""
    return "\x00" not in text and valid_text(text)


def choice(
    index: int, text: str, finish_reason: str | None, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One choice as ``Job.choices`` holds it (a worker may add ``tool_calls`` and
    ``content``: workers/inference/tools.py)."""
    return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(String(128), default="")
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[float] = mapped_column(Double)
    revoked_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # Per-key overrides of the tenant limits (None: the setting's default; 0: no limit).
    requests_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_queued: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The tenant's weight in every lane's fair share (None: 1; docs/architecture.md, "Fair
    # share"). A tenant with several keys weighs as its heaviest live key.
    weight: Mapped[float | None] = mapped_column(Double, nullable=True)
    # An operator's key: the console shows it every tenant (docs/console.md). On /v1 it is a
    # key of its tenant like any other.
    operator: Mapped[bool] = mapped_column(Boolean, default=False)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    lane: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(256))
    prompt: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
    params: Mapped[dict[str, Any]] = mapped_column(JSONType)
    # A chat's tools, tool_choice and parallel_tool_calls (contract.chat.ToolUse.tool_spec); None
    # without tools.
    tools: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)
    webhook_url: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    meta: Mapped[dict[str, str]] = mapped_column("metadata", JSONType)
    batch_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # A batch line's custom_id and its line number in the input file (1-based).
    custom_id: Mapped[str | None] = mapped_column(AnyString(512), nullable=True)
    batch_line: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # What the worker relays through Redis while the job runs (app/core/messaging/relay.py): None,
    # "end" (a caller waits for the outcome) or "tokens" (a caller streams the output), and where
    # to.
    relay: Mapped[str | None] = mapped_column(String(8), nullable=True)
    reply_to: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # OpenAI's ``user``: the caller's id for its own end user, recorded and shown, never used.
    end_user: Mapped[str | None] = mapped_column(AnyString(256), nullable=True)
    # What the job asks of its model (:class:`JobKind`). A pooled job (embed, score) has
    # ``inputs`` in place of a prompt: the texts (or token ids) to embed, or {"queries": [...],
    # "documents": [...]} to score, a query per document or one for all.
    kind: Mapped[str] = mapped_column(String(8), default=JobKind.GENERATE)
    inputs: Mapped[Any] = mapped_column(JSONType, nullable=True)
    # A pooled batch job's lines (embedding lines are grouped, a job per group: docs/openai.md,
    # "Batches of embeddings"): each line's number, custom_id, how many of ``inputs`` are its
    # own, and how its response is shaped (encoding_format; top_n, return_documents).
    # ``line_count``: the lines a job carries (1 for any other batch job); once it has run,
    # ``line_results`` says how each line went (line number -> its prompt tokens, or its
    # error) and ``failed_lines`` how many of a succeeded job's lines failed on their own.
    lines: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
    line_count: Mapped[int] = mapped_column(Integer, default=1)
    failed_lines: Mapped[int] = mapped_column(Integer, default=0)
    line_results: Mapped[dict[str, Any] | None] = mapped_column(JSONType, nullable=True)

    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Fencing: every claim increments the token; result writes must present the current one.
    lease_token: Mapped[int] = mapped_column(Integer, default=0)
    lease_owner: Mapped[str | None] = mapped_column(String(128), nullable=True)
    lease_expires_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    cancel_requested_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    timeout_s: Mapped[float | None] = mapped_column(Double, nullable=True)
    deadline_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # Fair share (docs/architecture.md, "Fair share"): what the job is expected to cost in
    # tokens (prompt + expected output), what the dispatcher charged its tenant when it sent
    # it (0: sent straight from the API, charged at its end), and the hash of its prompt's
    # shared prefix ('' : none), by which the dispatcher sends jobs of one prefix together.
    cost: Mapped[int] = mapped_column(Integer, default=0)
    charged: Mapped[int] = mapped_column(Integer, default=0)
    prefix: Mapped[str] = mapped_column(String(16), default="")

    created_at: Mapped[float] = mapped_column(Double)
    enqueued_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    started_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    first_token_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    updated_at: Mapped[float] = mapped_column(Double)

    result_text: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    finish_reason: Mapped[str | None] = mapped_column(String(32), nullable=True)
    # Every choice (index, text, finish_reason, logprobs) of a job that asked for more than one
    # (``n``) or for logprobs; None otherwise. Choice 0 is also result_text/finish_reason.
    choices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completion_tokens: Mapped[int | None] = mapped_column(Integer, nullable=True)
    error_code: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_message: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    # A pooled job's vectors or scores, packed (POOLED_DTYPE), never JSON text: 4 bytes a value.
    pooled: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    pooled_width: Mapped[int | None] = mapped_column(Integer, nullable=True)

    __table_args__ = (
        Index("ix_jobs_tenant_id", "tenant", "id"),
        # A status's jobs, the operator's and a tenant's: what a list's status filter and the
        # live counts' status test read. Not the same on both databases (ONE_DATABASE).
        *(
            Index(name, *columns).ddl_if(dialect=dialect)
            for name, (dialect, columns) in ONE_DATABASE.items()
        ),
        # A batch's jobs (batch_id alone is its prefix).
        Index("ix_jobs_batch_line", "batch_id", "batch_line"),
        # Retention's sweep: the oldest finished jobs first (app/core/lifecycle/retention.py).
        Index("ix_jobs_finished_at", "finished_at"),
        # The dispatcher's backlog: queued jobs not yet sent, in the order it picks them
        # (a tenant's earliest deadline first, one prefix together). Partial: a job enters it
        # at submission and leaves it when it is sent, so it stays the size of the backlog.
        Index(
            "ix_jobs_unsent",
            "lane",
            "model",
            "tenant",
            "deadline_at",
            "prefix",
            "id",
            postgresql_where=UNSENT,
            sqlite_where=UNSENT,
        ),
    )


def live(*statuses: str) -> ColumnElement[bool]:
    """The status test of a statement that finds live jobs by their status (``queued``,
    ``running``): ``LIVE``, a literal, then the statuses asked for.

    psycopg prepares a statement on its fifth run, and PostgreSQL may then plan it once for
    every value (a generic plan: docs/architecture.md, "Plans on a growing table"). For
    ``status = $1`` that plan cannot know that the value is a rare one, and it read every job,
    history and all (a sequential scan of 100,000 finished jobs in
    tests/integration/test_query_plans.py); the literal lets it estimate the live jobs from the
    statistics and take a status index (``ONE_DATABASE``).
    """
    values = [str(s) for s in statuses]
    if not values or not set(values) <= {JobStatus.QUEUED, JobStatus.RUNNING}:
        raise ValueError(f"not live statuses: {values}")
    return and_(LIVE, Job.status == values[0] if len(values) == 1 else Job.status.in_(values))


def status_is(*statuses: str) -> ColumnElement[bool]:
    """The status test of a statement that finds its jobs another way (by id, by batch):
    ``status || '' = …``, which PostgreSQL cannot answer from ``ix_jobs_status_lane``.

    Where history is large the planner's statistics say that almost no job is queued or
    running (a burst of 20,000 queued jobs is 2 % of a million finished ones, and autovacuum
    analyzes after 10 %): it estimated one row for ``status = 'queued'``, found that index
    cheaper than the primary key, and a claim of 256 ids walked the whole backlog (20,000 rows:
    7 to 180 ms), an outcome write every running job (docs/benchmarks.md, "Issue 66"). The
    index stays for what is found by status: the reaper's, the counts' and the limits' live
    jobs.
    """
    unindexed = Job.status.concat("")
    values = [str(s) for s in statuses]
    return unindexed == values[0] if len(values) == 1 else unindexed.in_(values)


@dataclass(frozen=True, slots=True)
class NewJob:
    """The row of a job about to be inserted (``transitions.create``): the columns a request
    sets, made from it once (``app.core.lifecycle.jobs.new_job``). The columns nothing has written
    yet read as a new job has them (the class attributes below), so the API answers a submission
    from this row as from a stored :class:`Job`."""

    id: str
    tenant: str
    lane: str
    model: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    params: dict[str, Any]
    tools: dict[str, Any] | None
    webhook_url: str | None
    meta: dict[str, str]
    end_user: str | None
    relay: str | None
    reply_to: str | None
    timeout_s: float | None
    deadline_at: float | None
    cost: int
    prefix: str
    created_at: float
    batch_id: str | None = None
    custom_id: str | None = None
    batch_line: int | None = None
    kind: str = JobKind.GENERATE
    inputs: Any = None
    lines: list[dict[str, Any]] | None = None
    line_count: int = 1

    # What a queued job that never ran has.
    status = str(JobStatus.QUEUED)
    attempts = 0
    lease_token = 0
    started_at = first_token_at = finished_at = None
    result_text = finish_reason = choices = None
    prompt_tokens = completion_tokens = None
    error_code = error_message = None
    pooled = pooled_width = line_results = None
    failed_lines = 0

    def row(self) -> dict[str, Any]:
        """The row ``transitions.create`` inserts: column -> value (``meta`` is "metadata")."""
        row = {column: getattr(self, name) for name, column in _NEW_JOB_COLUMNS}
        row.update(
            status=self.status,
            attempts=self.attempts,
            lease_token=self.lease_token,
            updated_at=self.created_at,
        )
        return row


# (attribute, column) of each field: the ORM's attribute names are the fields' names.
_NEW_JOB_COLUMNS = tuple((f.name, Job.__mapper__.columns[f.name].name) for f in fields(NewJob))


class Tenant(Base):
    """What a deployment keeps about a tenant beyond its keys: its own retention of finished
    jobs (None: ``INFERQ_JOB_RETENTION_S``; 0: kept forever) and how far retention has deleted
    (``swept_through``: the newest job id deleted; ids sort by time). A tenant has a row once
    either is set (app/core/lifecycle/retention.py)."""

    __tablename__ = "tenants"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_retention_s: Mapped[int | None] = mapped_column(Integer, nullable=True)
    swept_through: Mapped[str | None] = mapped_column(String(40), nullable=True)
    swept_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    updated_at: Mapped[float] = mapped_column(Double)


class IdempotencyKey(Base):
    """A submission's Idempotency-Key, written in the same transaction as its job."""

    __tablename__ = "idempotency_keys"

    tenant: Mapped[str] = mapped_column(String(64), primary_key=True)
    key: Mapped[str] = mapped_column(String(255), primary_key=True)
    request_hash: Mapped[str] = mapped_column(String(64))
    # Deleted with its job by this column (``transitions.delete_finished``; no foreign key:
    # migration 0016), which without an index read the whole table once per job (0015).
    job_id: Mapped[str] = mapped_column(String(40), index=True)
    created_at: Mapped[float] = mapped_column(Double)
    expires_at: Mapped[float] = mapped_column(Double, index=True)


class WebhookStatus(StrEnum):
    PENDING = "pending"  # an attempt is due at next_attempt_at (or under way)
    DELIVERED = "delivered"
    FAILED = "failed"  # the last attempt of the schedule failed


class StoredResponse(Base):
    """A stored response of OpenAI's Responses API (app/core/openai/responses.py): its job runs it
    and holds its outcome; this row holds what the Response object repeats of the request, the
    input items, and the conversation a next response continues (``previous_response_id``).
    Its id is its job's with another prefix (``resp_X`` runs as ``job_X``)."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(String(40), unique=True)  # deleted with its job (0016)
    previous_response_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # JSON: the request's fields the Response object repeats (responses_format.echo).
    request: Mapped[str] = mapped_column(AnyText)
    # JSON: the input items as OpenAI's input_items lists them.
    input: Mapped[str] = mapped_column(AnyText)
    # JSON: the chat messages of the conversation up to and with this input, without the
    # instructions (which are not carried on); a next response adds this one's output.
    context: Mapped[str] = mapped_column(AnyText)
    service_tier: Mapped[str] = mapped_column(String(16))
    # A background response's end is an event for the tenant's endpoints (response.*).
    background: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[float] = mapped_column(Double)


class WebhookEndpoint(Base):
    """A tenant's URL for OpenAI-format events of the types it lists
    (app/core/webhooks/endpoints.py).

    Each has its own signing secret, shown when it is made or rotated: the OpenAI SDK's
    ``webhooks.unwrap`` verifies its deliveries with it. After a rotation that keeps the old
    one, both sign every delivery until ``previous_until``.
    """

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    name: Mapped[str] = mapped_column(AnyString(255))
    url: Mapped[str] = mapped_column(AnyText)
    # Event types, comma-separated (app/core/webhooks/endpoints.py, EVENT_TYPES).
    event_types: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(Text)
    previous_secret: Mapped[str | None] = mapped_column(Text, nullable=True)
    previous_until: Mapped[float | None] = mapped_column(Double, nullable=True)
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)


class WebhookEvent(Base):
    """One event to one URL (the outbox row), written in the transaction that caused it.

    ``id`` is the ``webhook-id`` header: the same on every attempt and redelivery. An event for
    a registered endpoint (``endpoint_id``) has OpenAI's body and the endpoint's secret; one for
    a job's or batch's own ``webhook_url`` has inferq's body and the deployment's secret.
    ``next_attempt_at`` doubles as the attempt lease: a delivery moves it past its own timeout
    before it sends, so a sweep re-sends an attempt whose ops worker died.
    """

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    type: Mapped[str] = mapped_column(String(32))
    # Deleted with its job (``transitions.delete_finished``; no foreign key: migration 0016),
    # its attempts with it (theirs cascades).
    job_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    batch_id: Mapped[str | None] = mapped_column(String(40), nullable=True, index=True)
    # Deleting an endpoint drops its events: nothing more is sent to a URL its tenant removed.
    endpoint_id: Mapped[str | None] = mapped_column(
        String(40),
        ForeignKey("webhook_endpoints.id", ondelete="CASCADE"),
        nullable=True,
        index=True,
    )
    url: Mapped[str] = mapped_column(AnyText)
    occurred_at: Mapped[float] = mapped_column(Double)
    # The exact bytes sent, fixed at the first attempt so that every retry is identical.
    body: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    status: Mapped[str] = mapped_column(String(16))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # Attempts made in the current round of the schedule (a redelivery starts a new round).
    round_attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    dispatched_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    created_at: Mapped[float] = mapped_column(Double)
    updated_at: Mapped[float] = mapped_column(Double)

    __table_args__ = (Index("ix_webhook_events_due", "status", "next_attempt_at"),)


class WebhookAttempt(Base):
    """One HTTP attempt to deliver an event, whatever its outcome."""

    __tablename__ = "webhook_attempts"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    event_id: Mapped[str] = mapped_column(
        String(40), ForeignKey("webhook_events.id", ondelete="CASCADE"), index=True
    )
    number: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))  # scheduled | redelivery
    url: Mapped[str] = mapped_column(AnyText)
    address: Mapped[str | None] = mapped_column(String(64), nullable=True)
    started_at: Mapped[float] = mapped_column(Double)
    latency_ms: Mapped[float | None] = mapped_column(Double, nullable=True)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    ok: Mapped[bool] = mapped_column(Boolean)
    error: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    response_body: Mapped[str | None] = mapped_column(AnyText, nullable=True)


# What hangs on a job by its id and is deleted with it (``transitions.delete_finished``), by
# this column of each table: no foreign key, whose ON DELETE CASCADE ran a statement per job and
# table (migration 0016). Each is indexed (tests/integration/test_query_plans.py).
HANGING_ON_A_JOB = (IdempotencyKey.job_id, StoredResponse.job_id, WebhookEvent.job_id)


class File(Base):
    """An uploaded batch input or a generated batch output (bytes: app/core/storage/store.py)."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    purpose: Mapped[str] = mapped_column(String(32))  # batch | batch_output
    filename: Mapped[str] = mapped_column(AnyString(255))
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[float] = mapped_column(Double)
    # When the ops worker deletes it (row and bytes); None: never (files before expiry existed).
    expires_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # Which store holds its bytes (app/core/storage/store.describe, no credentials), so a file
    # stored before INFERQ_FILES_URL was switched is told apart; None: stored before this was
    # recorded (migration 0012), taken to be the current store.
    store: Mapped[str | None] = mapped_column(Text, nullable=True)

    __table_args__ = (
        Index("ix_files_tenant_id", "tenant", "id"),
        Index("ix_files_expires_at", "expires_at"),
    )


class BatchStatus(StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


BATCH_TERMINAL: frozenset[str] = frozenset(
    {BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED, BatchStatus.CANCELLED}
)

# Every change of a batch's status is one of these, made by app/batches/transitions.py.
BATCH_TRANSITIONS: dict[str, frozenset[str]] = {
    BatchStatus.VALIDATING: frozenset(
        {BatchStatus.IN_PROGRESS, BatchStatus.FAILED, BatchStatus.CANCELLING}
    ),
    BatchStatus.IN_PROGRESS: frozenset({BatchStatus.FINALIZING, BatchStatus.CANCELLING}),
    BatchStatus.FINALIZING: frozenset({BatchStatus.COMPLETED, BatchStatus.EXPIRED}),
    BatchStatus.CANCELLING: frozenset({BatchStatus.CANCELLED}),
    **{status: frozenset() for status in BATCH_TERMINAL},
}


def can_batch_transition(current: str, new: str) -> bool:
    return new in BATCH_TRANSITIONS.get(current, frozenset())


class Batch(Base):
    """An OpenAI-style batch: one input file whose lines run as bulk jobs (``jobs.batch_id``)."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(40))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(40), nullable=True)
    # Validation errors of the input file: [{"code", "message", "param", "line"}].
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType, nullable=True)
    meta: Mapped[dict[str, str]] = mapped_column("metadata", JSONType)
    webhook_url: Mapped[str | None] = mapped_column(AnyText, nullable=True)
    # Counts are kept live from the jobs while the batch runs and frozen when it ends.
    request_total: Mapped[int] = mapped_column(Integer, default=0)
    request_completed: Mapped[int] = mapped_column(Integer, default=0)
    request_failed: Mapped[int] = mapped_column(Integer, default=0)

    created_at: Mapped[float] = mapped_column(Double)
    expires_at: Mapped[float] = mapped_column(Double)
    in_progress_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    finalizing_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    completed_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    failed_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    expired_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    cancelling_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    cancelled_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    # An ops worker validating or finalizing the batch holds it from this time (a lease).
    claimed_at: Mapped[float | None] = mapped_column(Double, nullable=True)
    updated_at: Mapped[float] = mapped_column(Double)

    __table_args__ = (
        Index("ix_batches_tenant_id", "tenant", "id"),
        Index("ix_batches_status", "status"),
    )
