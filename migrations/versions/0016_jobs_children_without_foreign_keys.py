"""what hangs on a job is deleted with it by ``transitions.delete_finished``, not by a foreign key

``idempotency_keys``, ``responses`` and ``webhook_events`` referenced ``jobs.id`` with ON DELETE
CASCADE. A cascade runs one statement per deleted job and table inside the DELETE: on
PostgreSQL 44 ms of a 72 ms chunk of 2,000 jobs that retention's sweep deleted
(docs/benchmarks.md, "Issue 66 ... fifth session"). ``delete_finished``, the one place jobs are
deleted, now deletes those rows by ``job_id`` itself, a statement a table for the whole chunk,
and the keys go. Each ``job_id`` keeps its index (0015 and before).

On SQLite a constraint is dropped by rebuilding its table (Alembic's batch mode), with foreign
keys off meanwhile: dropping the old ``webhook_events`` with them on would first delete its
rows, and their ``webhook_attempts`` by that table's own cascade. ``PRAGMA foreign_keys`` is
only read outside a transaction, hence the autocommit blocks (which commit what ran before).
A rebuild copies the table: on a SQLite file with millions of webhook events, expect seconds to
minutes with the database locked; on PostgreSQL a constraint is dropped at once.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("idempotency_keys", "responses", "webhook_events")
# SQLite's keys have no names; batch mode names them by this when it reads the table.
NAMING = {"fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s"}


def _keys_to_jobs(table: str) -> list[str | None]:
    return [
        key["name"]
        for key in sa.inspect(op.get_bind()).get_foreign_keys(table)
        if key["referred_table"] == "jobs" and key["constrained_columns"] == ["job_id"]
    ]


def _sqlite_foreign_keys(on: bool) -> None:
    with op.get_context().autocommit_block():
        op.execute(f"PRAGMA foreign_keys={'ON' if on else 'OFF'}")


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        for table in TABLES:
            for name in _keys_to_jobs(table):
                op.drop_constraint(name, table, type_="foreignkey")
        return
    _sqlite_foreign_keys(False)
    try:
        for table in TABLES:
            if _keys_to_jobs(table):
                with op.batch_alter_table(table, naming_convention=NAMING) as batch:
                    batch.drop_constraint(f"fk_{table}_job_id_jobs", type_="foreignkey")
    finally:
        _sqlite_foreign_keys(True)


def downgrade() -> None:
    # Refused where a row names a job that is gone (none does, if only delete_finished deleted).
    if op.get_bind().dialect.name != "sqlite":
        for table in TABLES:
            op.create_foreign_key(
                f"{table}_job_id_fkey", table, "jobs", ["job_id"], ["id"], ondelete="CASCADE"
            )
        return
    _sqlite_foreign_keys(False)
    try:
        for table in TABLES:
            with op.batch_alter_table(table) as batch:
                batch.create_foreign_key(
                    f"fk_{table}_job_id_jobs", "jobs", ["job_id"], ["id"], ondelete="CASCADE"
                )
    finally:
        _sqlite_foreign_keys(True)
