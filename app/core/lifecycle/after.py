"""What follows a committed change, as data: :class:`After`, and the job log lines and counters.

The owners of state (app/core/lifecycle/transitions.py for jobs, app/batches/transitions.py for
batches) write in the caller's transaction (:class:`Tx`) and add to its :class:`After` what must
happen once that transaction has committed: one JSON log line and the job counters for every change,
the webhook events to announce, the tenants' charges to charge or settle
(app/core/scheduling/fairshare.py), the queues whose dispatcher must send jobs (or the one job the
API sends itself), the batches to start and the running jobs whose workers must abort them.
Nothing here runs them: only the construct that commits does, after the commit
(app/core/lifecycle/changes.py), so an effect is never forgotten and never runs for a change that
rolled back.

The log lines go to the ``inferq.jobs`` logger, one JSON object each whatever the format of
the process's other logs::

    {"ts": "2026-11-22T10:00:00.123Z", "event": "job.running", "job_id": "job_...",
     "lane": "standard", "tenant": "default", "from": "queued", "to": "running",
     "by": "worker", "worker": "worker-host-1234-ab12", "attempt": 1}
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter as TallyCounter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from prometheus_client import Counter
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from app.core.models import TERMINAL, JobStatus
from app.core.scheduling import fairshare

log = logging.getLogger("inferq.jobs")

By = Literal["api", "worker", "reaper", "ops", "dispatcher"]

# Every kind of process counts what it changed; names and labels are those of the metrics table of
# docs/observability.md.
JOBS_SUBMITTED = Counter(
    "inferq_jobs_submitted", "Jobs accepted (committed), by lane and model.", ["lane", "model"]
)
JOBS_FINISHED = Counter(
    "inferq_jobs_finished",
    "Jobs that reached a terminal status, counted by the process that wrote it.",
    ["lane", "model", "status"],
)


def _install_log() -> None:
    """The lines are the message alone: a handler of their own, not the process's format."""
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


_install_log()


@dataclass(frozen=True, slots=True)
class Transition:
    """One committed change of one job's status (``source`` None: a new job)."""

    job_id: str
    lane: str
    model: str
    tenant: str
    to: str
    source: str | None = None
    attempt: int | None = None
    error_code: str | None = None


@dataclass(frozen=True)
class Charge:
    """What one dispatcher refill charged a queue's tenants: tokens each, and what the counters
    of the tenants that joined were lifted by (``fairshare.charge``)."""

    lane: str
    model: str
    spent: dict[str, int]
    raised: dict[str, int]


@dataclass
class After:
    """What follows a transaction of changes once it has committed."""

    by: By
    moved: list[Transition] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # webhook events to announce
    # (job id, queue) to enqueue now: a new job the API sends itself (its queue was empty)
    send: list[tuple[str, str]] = field(default_factory=list)
    wake: set[str] = field(default_factory=set)  # queues with jobs for the dispatcher to send
    usage: list[fairshare.Usage] = field(default_factory=list)  # tenant charges to settle
    charges: list[Charge] = field(default_factory=list)  # a refill's charges
    start: list[str] = field(default_factory=list)  # batches the ops worker must start
    # batches none of whose jobs is left to run: the ops worker finalizes them now, not at its
    # next sweep
    finalize: set[str] = field(default_factory=set)
    abort: list[str] = field(default_factory=list)  # running jobs their workers must stop
    worker: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # added to every log line

    def count(self, to: str, source: str | None = None) -> int:
        return sum(1 for t in self.moved if t.to == to and (source is None or t.source == source))


@dataclass
class Tx:
    """One transaction of changes: its connection (and the ORM session it belongs to, when the
    caller's session holds it), and what follows once it commits. Made only by
    ``app.core.lifecycle.changes.changes``, which commits it and then runs its :class:`After`."""

    connection: Connection
    after: After
    session: Session | None = None

    @property
    def postgresql(self) -> bool:
        """Whether it runs on PostgreSQL (``app.core.models.among`` writes id lists for it)."""
        return self.connection.dialect.name == "postgresql"


def emit(after: After) -> None:
    """One log line and the job counters for every change ``after`` records."""
    _emit(after.moved, by=after.by, worker=after.worker, **after.fields)


def _emit(transitions: Iterable[Transition], *, by: By, worker: str | None, **fields: Any) -> None:
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    enabled = log.isEnabledFor(logging.INFO)
    submitted: TallyCounter[tuple[str, str]] = TallyCounter()
    finished: TallyCounter[tuple[str, str, str]] = TallyCounter()
    lines: list[str] = []
    for t in transitions:
        if t.source is None and t.to == JobStatus.QUEUED:
            submitted[t.lane, t.model] += 1
        elif t.to in TERMINAL:
            finished[t.lane, t.model, t.to] += 1
        if not enabled:
            continue
        line: dict[str, Any] = {
            "ts": stamp,
            "event": f"job.{t.to}",
            "job_id": t.job_id,
            "lane": t.lane,
            "model": t.model,
            "tenant": t.tenant,
            "from": t.source,
            "to": t.to,
            "by": by,
            "worker": worker,
        }
        if t.attempt is not None:
            line["attempt"] = t.attempt
        if t.error_code is not None:
            line["error_code"] = t.error_code
        line.update(fields)
        lines.append(json.dumps(line, separators=(",", ":")))
    for (lane, model), n in submitted.items():
        JOBS_SUBMITTED.labels(lane, model).inc(n)
    for (lane, model, status), n in finished.items():
        JOBS_FINISHED.labels(lane, model, status).inc(n)
    if lines:
        # One record for the transaction's lines: the handler writes the message alone, so
        # the output is the same lines, one JSON object each; a record per line (LogRecord,
        # handler lock, write) was a tenth of the API's CPU on a bulk submission
        # (docs/benchmarks.md, "ceiling").
        log.info("\n".join(lines))
