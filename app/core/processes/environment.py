"""A process's settings read again: what it built from them dropped (the settings, its Redis
clients, its database engine), so that the next use builds them from the environment as it is
now (docs/architecture.md, "Settings": one accessor, and the functions made to reset it).

For a process that changes its own environment on purpose: the fast test layer (a database and
a Redis of each test's own) and the ``history`` benchmark (the ops worker's sweep run in the
bench's process against a stack's database).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from app.core import db
from app.core.messaging import clients
from app.core.settings import Settings, get_settings


def forget() -> None:
    """Drop what this process built from its settings."""
    get_settings.cache_clear()
    clients.reset()
    db.dispose()


@contextlib.contextmanager
def environment(**values: str) -> Iterator[Settings]:
    """``INFERQ_<NAME>=value`` for each of ``values`` while the block runs, with everything
    built from the settings before dropped on the way in and out."""
    saved = {}
    for name, value in values.items():
        key = f"INFERQ_{name.upper()}"
        saved[key] = os.environ.get(key)
        os.environ[key] = value
    forget()
    try:
        yield get_settings()
    finally:
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old
        forget()
