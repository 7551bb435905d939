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


def scoped(query: Select[T], column: Any, tenant: str | None) -> Select[T]:
    """``query`` for the tenant's rows (every tenant's: ``None``)."""
    return query if tenant is None else query.where(column == tenant)


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
    """Newest first, at most ``limit`` rows after the cursor; (rows, has_more)."""
    if cursor(after) is not None:
        query = query.where(id_column < after)
    rows = list(session.scalars(query.order_by(id_column.desc()).limit(check_limit(limit) + 1)))
    return rows[:limit], len(rows) > limit
