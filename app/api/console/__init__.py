"""The console: pages for jobs, batches, lanes and tenants, served by the API at /console
(docs/console.md)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from app.api.console.routes import STATIC, router


def install(app: FastAPI) -> None:
    """The console's routes and its own static files (no page loads anything from elsewhere)."""
    app.include_router(router)
    app.mount("/console/static", StaticFiles(directory=STATIC), name="console-static")
