"""files, batches and job relay columns

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-21 22:54:36.567933
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("endpoint", sa.String(length=64), nullable=False),
        sa.Column("input_file_id", sa.String(length=40), nullable=False),
        sa.Column("completion_window", sa.String(length=16), nullable=False),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("output_file_id", sa.String(length=40), nullable=True),
        sa.Column("error_file_id", sa.String(length=40), nullable=True),
        sa.Column(
            "errors",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=True,
        ),
        sa.Column(
            "metadata",
            sa.JSON().with_variant(postgresql.JSONB(astext_type=sa.Text()), "postgresql"),
            nullable=False,
        ),
        sa.Column("webhook_url", sa.Text(), nullable=True),
        sa.Column("request_total", sa.Integer(), nullable=False),
        sa.Column("request_completed", sa.Integer(), nullable=False),
        sa.Column("request_failed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("expires_at", sa.Double(), nullable=False),
        sa.Column("in_progress_at", sa.Double(), nullable=True),
        sa.Column("finalizing_at", sa.Double(), nullable=True),
        sa.Column("completed_at", sa.Double(), nullable=True),
        sa.Column("failed_at", sa.Double(), nullable=True),
        sa.Column("expired_at", sa.Double(), nullable=True),
        sa.Column("cancelling_at", sa.Double(), nullable=True),
        sa.Column("cancelled_at", sa.Double(), nullable=True),
        sa.Column("claimed_at", sa.Double(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.create_index("ix_batches_status", ["status"], unique=False)
        batch_op.create_index("ix_batches_tenant_id", ["tenant", "id"], unique=False)

    op.create_table(
        "files",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("purpose", sa.String(length=32), nullable=False),
        sa.Column("filename", sa.String(length=255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.create_index("ix_files_tenant_id", ["tenant", "id"], unique=False)

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("custom_id", sa.String(length=512), nullable=True))
        batch_op.add_column(sa.Column("batch_line", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("relay", sa.String(length=8), nullable=True))
        batch_op.create_index("ix_jobs_batch_line", ["batch_id", "batch_line"], unique=False)
        batch_op.create_index("ix_jobs_tenant_status", ["tenant", "status"], unique=False)

    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("requests_per_minute", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("tokens_per_minute", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_queued", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_column("max_queued")
        batch_op.drop_column("tokens_per_minute")
        batch_op.drop_column("requests_per_minute")

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_tenant_status")
        batch_op.drop_index("ix_jobs_batch_line")
        batch_op.drop_column("relay")
        batch_op.drop_column("batch_line")
        batch_op.drop_column("custom_id")

    with op.batch_alter_table("files", schema=None) as batch_op:
        batch_op.drop_index("ix_files_tenant_id")

    op.drop_table("files")
    with op.batch_alter_table("batches", schema=None) as batch_op:
        batch_op.drop_index("ix_batches_tenant_id")
        batch_op.drop_index("ix_batches_status")

    op.drop_table("batches")
