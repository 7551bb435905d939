"""fair share: a key's weight, a job's cost, charge and prompt prefix, and the dispatcher's
backlog index (docs/architecture.md, "Fair share")

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24 05:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNSENT = sa.text("status = 'queued' AND enqueued_at IS NULL")


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Double(), nullable=True))
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("cost", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(sa.Column("charged", sa.Integer(), nullable=False, server_default="0"))
        batch_op.add_column(
            sa.Column("prefix", sa.String(length=16), nullable=False, server_default="")
        )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.alter_column("cost", server_default=None)
        batch_op.alter_column("charged", server_default=None)
        batch_op.alter_column("prefix", server_default=None)
        batch_op.create_index(
            "ix_jobs_unsent",
            ["lane", "model", "tenant", "deadline_at", "prefix", "id"],
            unique=False,
            postgresql_where=UNSENT,
            sqlite_where=UNSENT,
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_unsent")
        batch_op.drop_column("prefix")
        batch_op.drop_column("charged")
        batch_op.drop_column("cost")
    with op.batch_alter_table("api_keys") as batch_op:
        batch_op.drop_column("weight")
