"""a list of jobs filtered by status is read in id order from an index (issue 66)

``ix_jobs_status_lane`` (status, lane) becomes ``ix_jobs_status_id`` (status, id), and
``ix_jobs_tenant_status`` (tenant, status) becomes ``ix_jobs_tenant_status_id`` (tenant,
status, id): a page of a status, newest first, is then the index's first rows. Before, SQLite
(no statistics) found the status's rows through the old index and sorted them all for each
page: the console's ``/console/jobs?status=succeeded`` over a million finished jobs took 1.7 s,
now 0.9 ms (docs/benchmarks.md, "Issue 66 ... seventh session"). The lane in the old index
answered nothing the table does not: every statement that filters live jobs by lane also
reads their model from the row. ``ix_jobs_batch_id`` goes: ``ix_jobs_batch_line`` (batch_id,
batch_line) answers the same lookups. Each status change writes the two status indexes, as
before; no index is added.

Built in the migration's transaction, like 0014's: on a large PostgreSQL table that holds off
writes to ``jobs`` while they are built (about a second a million rows here). An operator with
a large table can build them beforehand with ``CREATE INDEX CONCURRENTLY ix_jobs_status_id ON
jobs (status, id)`` and ``CREATE INDEX CONCURRENTLY ix_jobs_tenant_status_id ON jobs (tenant,
status, id)``; this revision then finds them and builds nothing.

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

NEW = {
    "ix_jobs_status_id": ["status", "id"],
    "ix_jobs_tenant_status_id": ["tenant", "status", "id"],
}
OLD = {
    "ix_jobs_status_lane": ["status", "lane"],
    "ix_jobs_tenant_status": ["tenant", "status"],
    "ix_jobs_batch_id": ["batch_id"],
}


def _swap(build: dict[str, list[str]], drop: dict[str, list[str]]) -> None:
    existing = {index["name"] for index in sa.inspect(op.get_bind()).get_indexes("jobs")}
    for name, columns in build.items():
        if name not in existing:
            op.create_index(name, "jobs", columns)
    for name in drop:
        if name in existing:
            op.drop_index(name, table_name="jobs")


def upgrade() -> None:
    _swap(NEW, OLD)


def downgrade() -> None:
    _swap(OLD, NEW)
