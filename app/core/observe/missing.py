"""What the deployment lacks: a part whose work waits with no live process to do it.

A job, a webhook or a batch never waits silently (docs/architecture.md, "No silent waits").
Each rule is the work that waits, and the presence records (app/core/processes/presence.py, the
dispatcher's too) of the processes that would do it::

    dispatcher   jobs wait to be sent (queued, never sent)        and no dispatcher is alive
    ops          webhook events are due, or batches are open       and no ops worker is alive
    worker(m)    model m has queued jobs                           and no worker of m is alive
                 (an adapter's jobs are its base model's)
    files        every file's bytes                                and the file store does not
                                                                   answer or refuses us

Read afresh at each call, like app/core/observe/snapshot.py, so `/readyz`, `/metrics`, `inferq
status` and the API's log say the same thing at the same moment.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.messaging import clients
from app.core.models import BATCH_TERMINAL, UNSENT, Batch, File, Job, JobStatus, WebhookEvent, live
from app.core.models import WebhookStatus as Hook
from app.core.processes import presence
from app.core.scheduling import catalog
from app.core.settings import Settings, get_settings
from app.core.storage import store

PARTS = ("dispatcher", "ops", "worker", "files")


@dataclass(frozen=True)
class Missing:
    """One part that is missing, what waits for it, and for which model (workers)."""

    part: str
    waiting: int
    what: str
    model: str | None = None
    reason: str | None = None

    def message(self) -> str:
        if self.part == "files":
            return (
                f"the file store is unavailable ({self.reason}): {self.waiting} {self.what} "
                "cannot be read or written (INFERQ_FILES_URL, docs/files.md)"
            )
        if self.part == "worker":
            return f"{self.waiting} {self.what} of model {self.model} wait and no worker serves it"
        runs = "an ops worker or inferq dispatch" if self.part == "dispatcher" else "inferq ops"
        return f"{self.waiting} {self.what} wait and no {self.part} is alive (start {runs})"

    def as_dict(self) -> dict[str, object]:
        found: dict[str, object] = {"part": self.part, "waiting": self.waiting}
        if self.model is not None:
            found["model"] = self.model
        return {**found, "message": self.message()}


def find(db: Session | Connection, client: redis.Redis, settings: Settings) -> list[Missing]:
    """Every missing part, dispatcher first, then ops, then each model's workers, then the
    file store."""
    found: list[Missing] = []
    unsent = db.execute(select(func.count()).select_from(Job).where(UNSENT)).scalar_one()
    if unsent and not presence.dispatchers(client):
        found.append(Missing("dispatcher", int(unsent), "jobs"))
    if not presence.ops_workers(client):
        hooks = db.execute(
            select(func.count())
            .select_from(WebhookEvent)
            .where(WebhookEvent.status == Hook.PENDING)
        ).scalar_one()
        batches = db.execute(
            select(func.count()).select_from(Batch).where(Batch.status.not_in(BATCH_TERMINAL))
        ).scalar_one()
        if hooks:
            found.append(Missing("ops", int(hooks), "webhook events"))
        if batches:
            found.append(Missing("ops", int(batches), "batches"))
    serving = catalog.counts(presence.workers(client))
    queued: dict[str, int] = {}
    rows = db.execute(
        select(Job.model, func.count()).where(live(JobStatus.QUEUED)).group_by(Job.model)
    ).all()
    for model, count in rows:
        base = settings.base_of(model)
        queued[base] = queued.get(base, 0) + int(count)
    for model, count in sorted(queued.items()):
        if not serving.get(model):
            found.append(Missing("worker", count, "jobs", model))
    reason = store.check()
    if reason is not None:
        stored = db.execute(select(func.count()).select_from(File)).scalar_one()
        found.append(Missing("files", int(stored), "files", reason=reason))
    return found


def current() -> list[Missing]:
    """:func:`find` now, with this process's clients (``/readyz``, the API's /metrics and its
    log)."""
    with session_scope() as session:
        return find(session, clients.redis_client(), get_settings())
