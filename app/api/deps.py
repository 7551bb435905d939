"""FastAPI dependencies shared by the routes: the request's database session."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

from app.core.db import new_session


def get_session() -> Iterator[Session]:
    """One session per request; the service layer commits."""
    session = new_session()
    try:
        yield session
    finally:
        session.close()


# A route's parameter type for the request's session.
SessionDep = Annotated[Session, Depends(get_session)]
