"""retention: finished jobs deleted after their tenant's retention (issue 66)

A table of what a deployment keeps about a tenant beyond its keys (its own retention, how far
retention has deleted), and an index of jobs by when they finished, which the sweep walks
oldest first (app/core/lifecycle/retention.py).

The index is built in the migration's transaction: on a large PostgreSQL table that holds off
writes to ``jobs`` while it is built (minutes per ten million rows). An operator with such a
table can build it beforehand with ``CREATE INDEX CONCURRENTLY ix_jobs_finished_at ON jobs
(finished_at)``; this revision then finds it and builds nothing.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-03 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("tenant", sa.String(64), primary_key=True),
        sa.Column("job_retention_s", sa.Integer(), nullable=True),
        sa.Column("swept_through", sa.String(40), nullable=True),
        sa.Column("swept_at", sa.Double(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
    )
    existing = {index["name"] for index in sa.inspect(op.get_bind()).get_indexes("jobs")}
    if "ix_jobs_finished_at" not in existing:
        op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
    op.drop_table("tenants")
