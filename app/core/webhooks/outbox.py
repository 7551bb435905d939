"""Webhook events as an outbox: written in the transaction of the change that causes them.

Every transition that ends a job (app/core/lifecycle/transitions.py) runs :func:`record_job_events`
in the same transaction, with the ``finished_at`` stamp it wrote: an event exists if and only if
the transition committed, and a write that was fenced off creates none. After the commit the
events are announced to the ops worker (:func:`announce`); an announcement that fails is made
by the ops worker's sweep instead, like a job whose enqueue failed. A batch's end writes its
``batch.<status>`` events the same way (:func:`record_batch_event`): one to its own
``webhook_url``, and one to each of its tenant's endpoints that lists the type
(app/core/webhooks/endpoints.py).

A job ends once, so it has at most one event; its id (the ``webhook-id``) is derived from the
job id, which makes the insert a single ``INSERT ... SELECT`` on SQLite and PostgreSQL. An
endpoint's event gets a new id of its own.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Collection
from typing import Any

from sqlalchemy import Insert, Select, String, func, insert, literal, select, update
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.messaging import broker
from app.core.models import (
    BATCH_TERMINAL,
    TERMINAL,
    Batch,
    Job,
    JobStatus,
    StoredResponse,
    WebhookAttempt,
    WebhookEndpoint,
    WebhookEvent,
    WebhookStatus,
    among,
    new_id,
    now,
    status_is,
)
from app.core.webhooks import rules
from app.core.webhooks.rules import BATCH_EVENT_PREFIX, JOB_EVENT_PREFIX

log = logging.getLogger("inferq.outbox")

EVENT_PREFIX = "msg_"
ENDPOINT_EVENT_PREFIX = "evt"  # an endpoint's events: new ids, as OpenAI's ("evt_...")
SWEEP_BATCH = 1000  # most events announced at once


def event_id_for_job(job_id: str) -> str:
    return EVENT_PREFIX + job_id.removeprefix("job_")


def job_events(job_ids: Collection[str], stamp: float, *, postgresql: bool) -> Insert:
    """Insert the events of the jobs among ``job_ids`` that this transaction finished.

    "This transaction" is told by ``finished_at == stamp``; jobs without a webhook_url get
    none. Returns the new event ids.
    """
    suffix = func.substr(Job.id, len("job_") + 1)
    source = select(
        literal(EVENT_PREFIX, String) + suffix,
        Job.tenant,
        literal(JOB_EVENT_PREFIX, String) + Job.status,
        Job.id,
        Job.webhook_url,
        Job.finished_at,
        literal(str(WebhookStatus.PENDING), String),
        literal(0),
        literal(0),
        Job.finished_at,
        Job.finished_at,
        Job.finished_at,
    ).where(
        among(Job.id, job_ids, postgresql=postgresql),
        Job.webhook_url.is_not(None),
        status_is(*TERMINAL),
        Job.finished_at == stamp,
    )
    return _insert_events("job_id", source)


def _insert_events(owner: str, source: Select[*tuple[Any, ...]]) -> Insert:
    """INSERT ... SELECT of event rows; ``source`` yields the columns below, in order."""
    columns = [
        "id",
        "tenant",
        "type",
        owner,
        "url",
        "occurred_at",
        "status",
        "attempts",
        "round_attempts",
        "next_attempt_at",
        "created_at",
        "updated_at",
    ]
    return insert(WebhookEvent).from_select(columns, source).returning(WebhookEvent.id)


def record_job_events(
    connection: Connection,
    job_ids: Collection[str],
    stamp: float,
    *,
    hooked: Collection[str] | None = None,
    responses: Collection[str] | None = None,
) -> list[str]:
    """The events of the jobs among ``job_ids`` that this transaction ended: ``job.<status>``
    to a job's webhook_url, and ``response.<status>`` to the tenant's endpoints for a
    background response. ``hooked``: the ones known to have a webhook_url, ``responses``: the
    ones that may be background responses (a worker's leases say both), to spare each look for
    the others: on the realtime path the response look was a tenth of a worker's CPU
    (docs/benchmarks.md, "CPU per realtime call")."""
    if not job_ids:
        return []
    postgresql = connection.dialect.name == "postgresql"  # id lists as arrays: models.among
    with_url = job_ids if hooked is None else hooked
    written = (
        list(connection.execute(job_events(with_url, stamp, postgresql=postgresql)).scalars())
        if with_url
        else []
    )
    maybe = job_ids if responses is None else responses
    return written + (_response_events(connection, maybe, stamp, postgresql) if maybe else [])


def response_event_type(status: str, finish_reason: str | None) -> str:
    """OpenAI's event for a background response whose job ended ``status``."""
    if status == JobStatus.SUCCEEDED:
        return "response.incomplete" if finish_reason == "length" else "response.completed"
    if status == JobStatus.CANCELLED:
        return "response.cancelled"
    return "response.failed"  # failed, expired


def _response_events(
    connection: Connection, job_ids: Collection[str], stamp: float, postgresql: bool
) -> list[str]:
    """One ``response.<status>`` event per endpoint of the tenant that lists it, for each
    background response among the jobs this transaction ended (one query: an indexed look-up
    that finds nothing for jobs that are not responses)."""
    # The background responses among the ids first, by their unique index (nearly always
    # none), then their jobs: a planner left to choose started from the jobs that finished at
    # ``stamp`` on ix_jobs_finished_at, a walk of the whole write for every write, and with a
    # month of history behind the table it made that choice (docs/benchmarks.md, "Issue 66").
    responses = (
        select(StoredResponse.id, StoredResponse.job_id)
        .where(
            among(StoredResponse.job_id, job_ids, postgresql=postgresql),
            StoredResponse.background.is_(True),
        )
        .cte("background")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    found = connection.execute(
        select(
            responses.c.id,
            Job.tenant,
            Job.status,
            Job.finish_reason,
            WebhookEndpoint.id.label("endpoint_id"),
            WebhookEndpoint.url,
            WebhookEndpoint.event_types,
        )
        .select_from(responses)
        .join(Job, Job.id == responses.c.job_id)
        .join(WebhookEndpoint, WebhookEndpoint.tenant == Job.tenant)
        .where(Job.finished_at == stamp)
    ).all()
    rows = []
    for r in found:
        event_type = response_event_type(r.status, r.finish_reason)
        if _lists(r.event_types, event_type):
            # Not tied to the job's row: the event outlives a response deleted before it is
            # delivered.
            rows.append(_endpoint_event(r.tenant, event_type, r.id, r.endpoint_id, r.url, stamp))
    if rows:
        connection.execute(insert(WebhookEvent), rows)
    return [row["id"] for row in rows]


def _endpoint_event(
    tenant: str, event_type: str, about: str, endpoint_id: str, url: str, stamp: float
) -> dict[str, Any]:
    """A new event row for a registered endpoint, about the batch or response ``about``, with
    its body in OpenAI's shape written now (every attempt sends these bytes)."""
    event_id = new_id(ENDPOINT_EVENT_PREFIX)
    return {
        "id": event_id,
        "tenant": tenant,
        "type": event_type,
        "endpoint_id": endpoint_id,
        "url": url,
        "body": rules.render_openai(event_id, event_type, stamp, about),
        "occurred_at": stamp,
        "status": str(WebhookStatus.PENDING),
        "attempts": 0,
        "round_attempts": 0,
        "next_attempt_at": stamp,
        "created_at": stamp,
        "updated_at": stamp,
    }


def record_batch_event(connection: Connection, batch_id: str, stamp: float) -> list[str]:
    """The events of a batch that has just ended: ``batch.<status>`` to its own webhook_url (if
    it has one) and to each of its tenant's endpoints that lists that type."""
    source = select(
        literal(EVENT_PREFIX, String) + Batch.id,
        Batch.tenant,
        literal(BATCH_EVENT_PREFIX, String) + Batch.status,
        Batch.id,
        Batch.webhook_url,
        literal(stamp),
        literal(str(WebhookStatus.PENDING), String),
        literal(0),
        literal(0),
        literal(stamp),
        literal(stamp),
        literal(stamp),
    ).where(
        Batch.id == batch_id,
        Batch.webhook_url.is_not(None),
        Batch.status.in_(list(BATCH_TERMINAL)),
    )
    written = list(connection.execute(_insert_events("batch_id", source)).scalars())
    ended = connection.execute(
        select(Batch.tenant, Batch.status).where(
            Batch.id == batch_id, Batch.status.in_(list(BATCH_TERMINAL))
        )
    ).first()
    if ended is not None:
        event_type = BATCH_EVENT_PREFIX + ended.status
        rows = [
            {
                **_endpoint_event(ended.tenant, event_type, batch_id, endpoint_id, url, stamp),
                "batch_id": batch_id,
            }
            for endpoint_id, url in _subscribed(connection, ended.tenant, event_type)
        ]
        if rows:
            connection.execute(insert(WebhookEvent), rows)
            written += [row["id"] for row in rows]
    return written


def _subscribed(connection: Connection, tenant: str, event_type: str) -> list[tuple[str, str]]:
    """(id, url) of the tenant's endpoints that list ``event_type``
    (app/core/webhooks/endpoints.py)."""
    rows = connection.execute(
        select(WebhookEndpoint.id, WebhookEndpoint.url, WebhookEndpoint.event_types).where(
            WebhookEndpoint.tenant == tenant
        )
    )
    return [(r.id, r.url) for r in rows if _lists(r.event_types, event_type)]


def _lists(event_types: str, event_type: str) -> bool:
    """Whether an endpoint's ``event_types`` (comma-separated, as stored) has ``event_type``."""
    return event_type in event_types.split(",")


def announce(event_ids: list[str]) -> None:
    """Tell the ops worker about committed events, and stamp the ones that went out.

    Never raises for a broker or database failure: the sweep finds what was not stamped.
    """
    if not event_ids:
        return
    try:
        failed = set(broker.send_webhooks(event_ids))
        sent = [event_id for event_id in event_ids if event_id not in failed]
        if sent:
            with session_scope() as session:
                session.execute(
                    update(WebhookEvent)
                    .where(WebhookEvent.id.in_(sent))
                    .values(dispatched_at=now())
                )
    except Exception:
        log.exception("announcing %d webhook event(s) failed; the sweep will", len(event_ids))


class Announcer:
    """Announces events from a thread of its own, so the caller never waits on the broker.

    The inference worker's result writer uses it: a slow or absent Redis must not hold up
    the recording of job outcomes.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="announcer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, event_ids: list[str]) -> None:
        if event_ids:
            self._queue.put(event_ids)

    def _loop(self) -> None:
        while True:
            ids = self._queue.get()
            with contextlib.suppress(queue.Empty):
                while len(ids) < SWEEP_BATCH:
                    ids += self._queue.get_nowait()
            announce(ids)


def job_event(session: Session, job: Job) -> WebhookEvent | None:
    """The event of the job's own webhook_url (not an endpoint's)."""
    query = select(WebhookEvent).where(
        WebhookEvent.job_id == job.id, WebhookEvent.endpoint_id.is_(None)
    )
    return session.scalars(query).first()


def attempts(session: Session, event: WebhookEvent) -> list[WebhookAttempt]:
    query = select(WebhookAttempt).where(WebhookAttempt.event_id == event.id)
    return list(session.scalars(query.order_by(WebhookAttempt.number, WebhookAttempt.started_at)))
