"""pooled jobs: embeddings and scores as jobs, their inputs, their output packed as float32
(never JSON text), and batch jobs that carry several lines (docs/openai.md, "Embeddings,
rerank and score")

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-27 06:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _json() -> sa.types.TypeEngine[object]:
    return sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(
            sa.Column("kind", sa.String(length=8), nullable=False, server_default="generate")
        )
        batch_op.add_column(sa.Column("inputs", _json(), nullable=True))
        batch_op.add_column(sa.Column("lines", _json(), nullable=True))
        batch_op.add_column(
            sa.Column("line_count", sa.Integer(), nullable=False, server_default="1")
        )
        batch_op.add_column(
            sa.Column("failed_lines", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(sa.Column("line_results", _json(), nullable=True))
        batch_op.add_column(sa.Column("pooled", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("pooled_width", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        for column in (
            "pooled_width",
            "pooled",
            "line_results",
            "failed_lines",
            "line_count",
            "lines",
            "inputs",
            "kind",
        ):
            batch_op.drop_column(column)
