"""Alembic environment: the URL comes from app.core.settings, the schema from app.core.models."""

from __future__ import annotations

from alembic import context

from app.core.db import get_engine
from app.core.models import Base, built_here

target_metadata = Base.metadata


def run_offline() -> None:
    from app.core.settings import get_settings

    context.configure(
        url=get_settings().sqlalchemy_url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    with get_engine().connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=True,  # SQLite needs batch mode to alter tables
            compare_type=True,
            # The indexes of one database only (models.ONE_DATABASE): not drift on the other.
            include_object=built_here(connection.dialect.name),
        )
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
