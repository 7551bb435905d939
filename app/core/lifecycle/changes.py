"""Commit, then run what follows: the one construct every change of a job or a batch goes through.

::

    with changes("api") as tx:                  # a transaction (or the caller's session's)
        transitions.cancel(tx, job_id, now())   # writes in it, adds to tx.after
    # committed: tx.after has run (log lines, counters, events, sends, wake-ups, aborts)

The owners of state write in the transaction and add what must follow to its ``After``
(app/core/lifecycle/after.py); this construct commits and only then runs it, in this order:
one JSON log line and the job counters per change, announce the webhook events, settle and
charge tenants' shares, send what the API sends itself, wake the dispatcher for the rest, start
batches, finalize the batches whose last jobs ended, and broadcast the aborts of running jobs.
A block that raises rolls back and runs nothing, so an effect can neither be forgotten nor run
for a change that did not commit. Nothing else runs an ``After``
(tests/unit/test_one_status_writer.py checks it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis
from sqlalchemy.orm import Session

from app.core.db import transaction
from app.core.lifecycle import transitions
from app.core.lifecycle.after import After, By, Tx, emit
from app.core.messaging import broker, clients
from app.core.scheduling import fairshare
from app.core.webhooks import outbox

log = logging.getLogger("inferq.changes")

Announce = Callable[[list[str]], None]


@contextmanager
def changes(
    by: By,
    *,
    session: Session | None = None,
    worker: str | None = None,
    announce: Announce | None = None,
    **fields: Any,
) -> Iterator[Tx]:
    """One transaction of changes by ``by``: a transaction of its own, or ``session``'s (which
    is committed, or rolled back if the block raises); once it has committed, what the changes
    added to ``tx.after`` runs. ``worker`` and ``fields`` go into the log lines; ``announce``
    is the caller's own announcer of webhook events (a worker's thread), else
    ``outbox.announce``."""
    after = After(by, worker=worker, fields=fields)
    if session is None:
        with transaction() as connection:
            tx = Tx(connection, after)
            yield tx
    else:
        tx = Tx(session.connection(), after, session)
        try:
            yield tx
            session.commit()
        except BaseException:
            session.rollback()
            raise
    _run(tx.after, announce or outbox.announce)


def _run(after: After, announce: Announce) -> None:
    emit(after)
    announce(after.events)
    if after.usage:
        fairshare.settle(after.usage)
    for charge in after.charges:
        try:
            fairshare.charge(
                clients.redis_client(), charge.lane, charge.model, charge.spent, charge.raised
            )
        except redis.RedisError as exc:
            log.warning("could not charge %s:%s's tenants: %s", charge.lane, charge.model, exc)
    if after.send:
        _send(after.send)
    if after.wake:
        broker.wake(after.wake)
    for batch_id in after.start:
        broker.send_start_batch(batch_id)
    for batch_id in sorted(after.finalize):
        broker.send_finalize_batch(batch_id)
    for job_id in after.abort:
        try:
            broker.publish_control("cancel", job_id=job_id)
        except redis.RedisError as exc:
            # The workers' heartbeats read cancel_requested_at: the abort comes later.
            log.warning("could not broadcast the abort of %s: %s", job_id, exc)


def _send(jobs: list[tuple[str, str]]) -> None:
    """Send committed jobs whose rows say they are sent already (the API's own sends,
    ``transitions.create(direct=True)``), one message a job; a job whose message could not go
    out is unsent again, for the dispatcher. If that fails too, the reaper finds the job
    queued with no message and unsends it (workers/ops/reaper.py)."""
    failed = broker.send_jobs([(name, [job_id]) for job_id, name in jobs])
    if not failed:
        return
    try:
        with changes("api") as tx:
            transitions.send_failed(tx, failed)
    except Exception as exc:
        log.warning("could not mark %d unsent job(s); the reaper will: %s", len(failed), exc)
        broker.wake({name for _, name in jobs})
