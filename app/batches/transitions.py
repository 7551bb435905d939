"""The one owner of a batch's status, and of the ops worker's lease on it: every write of
``batches.status`` and ``batches.claimed_at`` is in this module.

A batch's life (``models.BATCH_TRANSITIONS``; docs/architecture.md, "Batches")::

    create ──► validating ──start──► in_progress ──take(finalizing)──► finalizing ──finish──►
                 │   │                    │                             completed | expired
                 │   └──fail──► failed    └──cancel──► cancelling ──finish──► cancelled
                 └──cancel──► cancelling

An ops worker that validates or finalizes a batch holds it first (:func:`take`: a lease of
``LEASE_S`` on ``claimed_at``), so overlapping sweeps and several ops workers never do the same
batch's work twice; the move out of ``validating`` and the final one are fenced by that lease.
Like the jobs' owner (app/core/lifecycle/transitions.py), each function is a compare-and-set in the
caller's transaction (``app.core.lifecycle.changes.changes``) and adds to its ``After`` what follows
the commit: the ``batch.<status>`` webhook event of a batch that ended, the start of a new one.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, update

from app.core.lifecycle.after import Tx
from app.core.models import Batch, BatchStatus, can_batch_transition
from app.core.webhooks import outbox

LEASE_S = 300.0  # an ops worker's hold on a batch it validates or finalizes

# The column each status stamps when a batch enters it.
ENTERED_AT = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.EXPIRED: "expired_at",
}


def create(tx: Tx, batch_id: str, stamp: float, **values: Any) -> Batch:
    """A new batch, ``validating``, in the caller's session (the API answers with it as it was
    committed); the ops worker is asked to start it after the commit."""
    if tx.session is None:
        raise ValueError("a batch is created in the API's session: changes(session=...)")
    batch = Batch(
        id=batch_id,
        status=BatchStatus.VALIDATING,
        request_total=0,
        request_completed=0,
        request_failed=0,
        created_at=stamp,
        updated_at=stamp,
        **values,
    )
    tx.session.add(batch)
    tx.after.start.append(batch_id)
    return batch


def _move(
    tx: Tx,
    batch_id: str,
    expect: str,
    to: str,
    stamp: float,
    *,
    held: float | None = None,
    **values: Any,
) -> bool:
    """``expect`` → ``to`` (an allowed transition), stamping ``to``'s time; with ``held``, only
    under that lease, which it releases. False if the batch moved on (or the lease did)."""
    if not can_batch_transition(expect, to):
        raise ValueError(f"a batch cannot go from {expect} to {to}")
    statement = update(Batch).where(Batch.id == batch_id, Batch.status == expect)
    if held is not None:
        statement = statement.where(Batch.claimed_at == held)
        values["claimed_at"] = None
    values.setdefault(ENTERED_AT[BatchStatus(to)], stamp)
    moved = tx.connection.execute(statement.values(status=to, updated_at=stamp, **values))
    return bool(moved.rowcount)  # type: ignore[attr-defined]


def _ended(tx: Tx, batch_id: str, stamp: float) -> None:
    """The batch has just ended: its ``batch.<status>`` event (if it has a webhook_url)."""
    tx.after.events += outbox.record_batch_event(tx.connection, batch_id, stamp)


# --- the ops worker's lease -------------------------------------------------------------------


def take(tx: Tx, batch_id: str, expect: str, stamp: float, *, to: str | None = None) -> bool:
    """Hold the batch (lease ``stamp``) while it is ``expect`` and nobody else holds it; with
    ``to``, move it there too (``in_progress`` → ``finalizing``)."""
    values: dict[str, Any] = {"claimed_at": stamp, "updated_at": stamp}
    if to is not None:
        if not can_batch_transition(expect, to):
            raise ValueError(f"a batch cannot go from {expect} to {to}")
        values.update(status=to, **{ENTERED_AT[BatchStatus(to)]: stamp})
    taken = tx.connection.execute(
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status == expect,
            or_(Batch.claimed_at.is_(None), Batch.claimed_at < stamp - LEASE_S),
        )
        .values(**values)
    ).rowcount  # type: ignore[attr-defined]
    return bool(taken)


def release(tx: Tx, batch_id: str, held: float) -> None:
    """Give the batch back (the lease taken at ``held``) without changing it."""
    tx.connection.execute(
        update(Batch).where(Batch.id == batch_id, Batch.claimed_at == held).values(claimed_at=None)
    )


# --- out of validating ------------------------------------------------------------------------


def hold(tx: Tx, batch_id: str, held: float, stamp: float) -> bool:
    """The batch is still ``validating`` under this lease: a chunk of its lines may go in with
    this transaction (the row is locked until it commits, so a cancel either sees the chunk's
    jobs to stop or is seen here). False if it was cancelled or the lease moved on."""
    kept = tx.connection.execute(
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status == BatchStatus.VALIDATING,
            Batch.claimed_at == held,
        )
        .values(updated_at=stamp)
    ).rowcount  # type: ignore[attr-defined]
    return bool(kept)


def start(tx: Tx, batch_id: str, held: float, stamp: float, *, total: int) -> bool:
    """Its last lines are inserted (in this transaction), the file read to its end:
    ``validating`` → ``in_progress``."""
    return _move(
        tx,
        batch_id,
        BatchStatus.VALIDATING,
        BatchStatus.IN_PROGRESS,
        stamp,
        held=held,
        request_total=total,
    )


def fail(tx: Tx, batch_id: str, held: float, stamp: float, errors: list[dict[str, Any]]) -> bool:
    """Its input file is invalid: ``validating`` → ``failed``, with the line-numbered errors
    (the lines that started before the bad one was read are the caller's to stop:
    ``transitions.stop_batch``)."""
    failed = _move(
        tx, batch_id, BatchStatus.VALIDATING, BatchStatus.FAILED, stamp, held=held, errors=errors
    )
    if failed:
        _ended(tx, batch_id, stamp)
    return failed


# --- cancelled, expired, finished -------------------------------------------------------------


def cancel(tx: Tx, batch_id: str, expect: str, stamp: float) -> bool:
    """``validating`` or ``in_progress`` → ``cancelling`` (its lines are the caller's to stop:
    ``transitions.stop_batch``); False if it moved on meanwhile."""
    return _move(tx, batch_id, expect, BatchStatus.CANCELLING, stamp)


def mark_expired(tx: Tx, batch_id: str, stamp: float) -> bool:
    """The window of an ``in_progress`` batch passed with lines left: it is stamped expired
    (its lines are the caller's to stop) and ends ``expired`` when it is finished. False if it
    was stamped already or moved on."""
    marked = tx.connection.execute(
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status == BatchStatus.IN_PROGRESS,
            Batch.expired_at.is_(None),
        )
        .values(expired_at=stamp, updated_at=stamp)
    ).rowcount  # type: ignore[attr-defined]
    return bool(marked)


def finish(
    tx: Tx,
    batch_id: str,
    expect: str,
    final: str,
    held: float,
    stamp: float,
    *,
    ended_at: float,
    **outputs: Any,
) -> bool:
    """A batch none of whose lines is left to run ends ``final`` (``completed``, ``expired`` or
    ``cancelled``) at ``ended_at``, with its ``outputs`` (file ids, frozen request counts),
    under the lease ``held``; its event is written. False if the lease was taken over."""
    done = _move(
        tx,
        batch_id,
        expect,
        final,
        stamp,
        held=held,
        **{ENTERED_AT[BatchStatus(final)]: ended_at},
        **outputs,
    )
    if done:
        _ended(tx, batch_id, stamp)
    return done
