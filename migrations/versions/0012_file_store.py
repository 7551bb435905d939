"""file store: which object store holds a file's bytes (docs/files.md, "Switching stores")

Files stored before this revision keep store NULL: taken to be in the current store, as
everything was until a switch could be told apart.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("files") as batch_op:
        batch_op.add_column(sa.Column("store", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("files") as batch_op:
        batch_op.drop_column("store")
