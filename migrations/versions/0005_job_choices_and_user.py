"""job choices, user and tools: every choice of a job that asked for several or for logprobs
(with its tool calls), the caller's end-user id (OpenAI's ``user``), recorded, and a chat's
tools (docs/openai.md, "vLLM's fields")

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23 20:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(
            sa.Column(
                "choices",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=True,
            )
        )
        batch_op.add_column(sa.Column("end_user", sa.String(length=256), nullable=True))
        batch_op.add_column(
            sa.Column(
                "tools",
                sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
                nullable=True,
            )
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("tools")
        batch_op.drop_column("end_user")
        batch_op.drop_column("choices")
