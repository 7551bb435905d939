"""an index of idempotency keys by job: a job's deletion finds its key without a scan

``idempotency_keys.job_id`` references ``jobs`` with ON DELETE CASCADE, and had no index:
PostgreSQL and SQLite then read the whole table for each job deleted (retention's sweep deletes
a thousand a transaction, DELETE /v1/responses one). Every other cascading key has an index
(tests/integration/test_query_plans.py checks them all).

Built in the migration's transaction, as 0014's: an operator with a large table can build it
beforehand with ``CREATE INDEX CONCURRENTLY ix_idempotency_keys_job_id ON idempotency_keys
(job_id)``; this revision then finds it and builds nothing.

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 09:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

INDEX = "ix_idempotency_keys_job_id"


def upgrade() -> None:
    existing = {i["name"] for i in sa.inspect(op.get_bind()).get_indexes("idempotency_keys")}
    if INDEX not in existing:
        op.create_index(INDEX, "idempotency_keys", ["job_id"])


def downgrade() -> None:
    op.drop_index(INDEX, table_name="idempotency_keys")
