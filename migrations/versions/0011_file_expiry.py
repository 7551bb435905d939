"""file expiry: when the ops worker deletes a file (OpenAI's expires_at; docs/files.md)

Files stored before this revision keep expires_at NULL: never deleted by the sweep, as they
were promised when they were uploaded.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch_op:
        batch_op.add_column(sa.Column("expires_at", sa.Double(), nullable=True))
        batch_op.create_index("ix_files_expires_at", ["expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("files") as batch_op:
        batch_op.drop_index("ix_files_expires_at")
        batch_op.drop_column("expires_at")
