"""What follows a committed change of a job's status: one JSON log line, and the job counters.

Every place that changes a job's status (the API's submit and cancel, a worker's claim, result
and hand-back, the reaper, a batch's start, cancel and expiry) calls :func:`emit` *after* its
transaction committed, with the rows it changed, so a rolled-back change is never logged or
counted. The lines go to the ``inferq.jobs`` logger, one JSON object each, whatever the format
of the process's other logs, so they can be shipped and queried as they are::

    {"ts": "2026-11-22T10:00:00.123Z", "event": "job.running", "job_id": "job_...",
     "lane": "standard", "tenant": "default", "from": "queued", "to": "running",
     "by": "worker", "worker": "worker-host-1234-ab12", "attempt": 1}
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from app.api.metrics import JOBS_FINISHED, JOBS_SUBMITTED
from app.core.models import TERMINAL, JobStatus

log = logging.getLogger("inferq.jobs")

By = Literal["api", "worker", "reaper", "ops"]


def _install() -> None:
    """The lines are the message alone: a handler of their own, not the process's format."""
    if log.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


_install()


@dataclass(frozen=True)
class Transition:
    job_id: str
    lane: str
    tenant: str
    to: str
    source: str | None = None  # the status it left; None for a new job
    attempt: int | None = None
    error_code: str | None = None


def of_rows(
    rows: Iterable[Any], to: str, source: str, error_code: str | None = None
) -> list[Transition]:
    """The transitions of rows an UPDATE returned: ``id``, ``lane``, ``tenant`` and, where it
    was returned, ``attempts``."""
    return [
        Transition(r.id, r.lane, r.tenant, to, source, getattr(r, "attempts", None), error_code)
        for r in rows
    ]


def emit(
    transitions: Iterable[Transition], *, by: By, worker: str | None = None, **fields: Any
) -> None:
    """Log and count committed transitions; ``fields`` are added to every line."""
    stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    enabled = log.isEnabledFor(logging.INFO)
    for t in transitions:
        if t.source is None and t.to == JobStatus.QUEUED:
            JOBS_SUBMITTED.labels(t.lane).inc()
        elif t.to in TERMINAL:
            JOBS_FINISHED.labels(t.lane, t.to).inc()
        if not enabled:
            continue
        line: dict[str, Any] = {
            "ts": stamp,
            "event": f"job.{t.to}",
            "job_id": t.job_id,
            "lane": t.lane,
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
        log.info(json.dumps(line, separators=(",", ":")))
