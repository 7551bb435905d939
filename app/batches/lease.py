"""An ops worker's hold on a batch it validates or finalizes, so overlapping sweeps and several
ops workers never do the same batch's work twice (docs/architecture.md, batch leases)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.models import Batch

LEASE_S = 300.0  # an ops worker's hold on a batch it validates or finalizes


def take(session: Session, batch_id: str, expect: str, stamp: float, **values: Any) -> bool:
    """Take the batch while it is ``expect`` and nobody holds it; ``stamp`` is the lease."""
    taken = session.execute(
        update(Batch)
        .where(
            Batch.id == batch_id,
            Batch.status == expect,
            or_(Batch.claimed_at.is_(None), Batch.claimed_at < stamp - LEASE_S),
        )
        .values(claimed_at=stamp, updated_at=stamp, **values)
    ).rowcount  # type: ignore[attr-defined]
    return bool(taken)


def release(batch_id: str, stamp: float) -> None:
    """Give the batch back (the lease taken at ``stamp``) without changing it."""
    with session_scope() as session:
        session.execute(
            update(Batch)
            .where(Batch.id == batch_id, Batch.claimed_at == stamp)
            .values(claimed_at=None)
        )
