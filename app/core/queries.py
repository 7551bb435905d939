"""Reads every tenant-owned resource shares (jobs, files, batches): one row, and a page.

Another tenant's row is "not found", never "forbidden", so existence is not leaked. Ids sort by
creation time (``new_id``), which makes ``after`` (the last id of the previous page) a stable
cursor for newest-first pages. A read is scoped to one tenant; ``None`` reads every tenant's
rows, which only the console's operator does (docs/console.md).
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select
from sqlalchemy.orm import Session

from app.core.errors import DomainError, Kind
from app.core.models import storable
from app.core.settings import get_settings

T = TypeVar("T")


def owned(session: Session, model: type[T], tenant: str | None, row_id: str, what: str) -> T:
    """The tenant's ``model`` row ``row_id`` (any tenant's: ``None``), else 404
    ``<what>_not_found``."""
    row: Any = session.get(model, row_id) if storable(row_id) else None
    if row is None or (tenant is not None and row.tenant != tenant):
        param = "id" if what == "job" else f"{what}_id"
        raise DomainError(Kind.NOT_FOUND, f"{what}_not_found", f"no {what} {row_id!r}", param=param)
    result: T = row
    return result


def scoped(session: Session, query: Select[T], column: Any, tenant: str | None) -> Select[T]:
    """``query`` for the tenant's rows (every tenant's: ``None``), in the tenant's order: a
    page (:func:`page`) sorts by the tenant, then the id, as the table's ``(tenant, id)`` index
    holds them, and reads its own rows and no others.

    On PostgreSQL the tenant is a range of one value, not ``tenant = :t``: with an equality it
    drops the tenant from the order as a constant and may walk the primary key backwards,
    filtering, from a share of the newest rows it estimates from the tenant's share of all of
    them. With another tenant's 3,000 queued jobs newer than a tenant's history, its page of 21
    read 3,201 rows (tests/integration/test_query_plans.py); a bulk backlog of millions would be
    read whole. SQLite keeps the equality: it takes the ``(tenant, id)`` index for it and the
    id's order, while a range it weighs below another filter's equality (a page of a status
    sorted every job of that status: 0.1 ms became 396 ms on 1,000,000)."""
    if tenant is None:
        return query
    if session.get_bind().dialect.name != "postgresql":
        return query.where(column == tenant)
    return query.where(column >= tenant, column <= tenant).order_by(column.desc())


def check_limit(limit: int) -> int:
    top = get_settings().list_max_limit
    if limit > top:
        raise DomainError(
            Kind.INVALID, "limit_too_large", f"limit must be at most {top}", param="limit"
        )
    return limit


def cursor(after: str | None) -> str | None:
    """``after`` when it can be an id (a page's cursor), else 400 ``invalid_cursor``."""
    if after is not None and not storable(after):
        raise DomainError(Kind.INVALID, "invalid_cursor", "after is not an id", param="after")
    return after


def page(
    session: Session, query: Select[T], id_column: Any, limit: int, after: str | None
) -> tuple[list[T], bool]:
    """Newest first, at most ``limit`` rows after the cursor; (rows, has_more). The id orders
    what ``query`` has not (a :func:`scoped` query is in its tenant's order first)."""
    if cursor(after) is not None:
        query = query.where(id_column < after)
    rows = list(session.scalars(query.order_by(id_column.desc()).limit(check_limit(limit) + 1)))
    return rows[:limit], len(rows) > limit
