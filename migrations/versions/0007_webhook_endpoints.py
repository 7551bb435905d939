"""webhook endpoints: a tenant's URLs for OpenAI-format events, and the event's endpoint
(docs/webhooks.md, "Webhook endpoints")

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26 04:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "webhook_endpoints",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=255), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("event_types", sa.Text(), nullable=False),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("previous_secret", sa.Text(), nullable=True),
        sa.Column("previous_until", sa.Double(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_webhook_endpoints_tenant", "webhook_endpoints", ["tenant"], unique=False)
    with op.batch_alter_table("webhook_events") as batch_op:
        batch_op.add_column(sa.Column("endpoint_id", sa.String(length=40), nullable=True))
        batch_op.create_index("ix_webhook_events_endpoint_id", ["endpoint_id"], unique=False)
        batch_op.create_foreign_key(
            "fk_webhook_events_endpoint_id",
            "webhook_endpoints",
            ["endpoint_id"],
            ["id"],
            ondelete="CASCADE",
        )


def downgrade() -> None:
    with op.batch_alter_table("webhook_events") as batch_op:
        batch_op.drop_constraint("fk_webhook_events_endpoint_id", type_="foreignkey")
        batch_op.drop_index("ix_webhook_events_endpoint_id")
        batch_op.drop_column("endpoint_id")
    op.drop_index("ix_webhook_endpoints_tenant", table_name="webhook_endpoints")
    op.drop_table("webhook_endpoints")
