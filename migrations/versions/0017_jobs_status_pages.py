"""SQLite: a list of jobs filtered by status is read in id order from an index (issue 66)

On SQLite, ``ix_jobs_status_lane`` (status, lane) becomes ``ix_jobs_status_id`` (status, id),
and ``ix_jobs_tenant_status`` (tenant, status) becomes ``ix_jobs_tenant_status_id`` (tenant,
status, id): a page of a status, newest first, is then the index's first rows. Before, SQLite
(no statistics) found the status's rows through the old index and sorted them all for each page:
the console's ``/console/jobs?status=succeeded`` over a million finished jobs took 1.7 s, now
under a millisecond (docs/benchmarks.md, "Issue 66 ... seventh session"). The lane in the old
index answered nothing the row does not (every statement that filters live jobs by lane reads
their model from the row too).

PostgreSQL keeps its two: its planner, with statistics, finds such a page without the id, and
the id made each status change dearer (``ceiling`` about 5 % lower, the indexes 1.8 times the
size). ``app.core.models.ONE_DATABASE`` names the indexes of one database only.

On both, ``ix_jobs_batch_id`` goes: ``ix_jobs_batch_line`` (batch_id, batch_line) answers the
same lookups, and every row version written (on PostgreSQL each status change) no longer adds
an entry to it.

The SQLite indexes are built in the migration's transaction (about a second a million jobs);
SQLite's writers wait meanwhile.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen here, as this revision built them (the models may change later).
SQLITE_NEW = {
    "ix_jobs_status_id": ["status", "id"],
    "ix_jobs_tenant_status_id": ["tenant", "status", "id"],
}
SQLITE_OLD = {
    "ix_jobs_status_lane": ["status", "lane"],
    "ix_jobs_tenant_status": ["tenant", "status"],
}
BATCH = {"ix_jobs_batch_id": ["batch_id"]}


def _swap(build: dict[str, list[str]], drop: dict[str, list[str]]) -> None:
    existing = {index["name"] for index in sa.inspect(op.get_bind()).get_indexes("jobs")}
    for name, columns in build.items():
        if name not in existing:
            op.create_index(name, "jobs", columns)
    for name in drop:
        if name in existing:
            op.drop_index(name, table_name="jobs")


def _sqlite() -> bool:
    return op.get_bind().dialect.name == "sqlite"


def upgrade() -> None:
    _swap({}, BATCH)
    if _sqlite():
        _swap(SQLITE_NEW, SQLITE_OLD)


def downgrade() -> None:
    _swap(BATCH, {})
    if _sqlite():
        _swap(SQLITE_OLD, SQLITE_NEW)
