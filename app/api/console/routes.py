"""/console: the console's pages and actions (docs/console.md).

Thin routes: who is looking comes from the session (app/api/console/sessions.py), what a page
shows from app/api/console/views.py, and each action is the call its /v1 route makes
(``jobs.cancel``, ``deliveries.redeliver_job_event``, ``batches.cancel``), under the viewer's tenant
scope, after the session's CSRF token is checked. Every page's live part is also served alone
(``?live=1``), which console.js fetches every few seconds in place: the pages update without a
reload and say the time of their data.

Every answer carries a Content-Security-Policy that allows scripts, styles and connections to
this origin only, no inline script or style, and no framing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Form, Query, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from starlette.concurrency import run_in_threadpool

from app.api import downloads
from app.api.console import sessions, views
from app.api.console.sessions import Viewer
from app.batches import service as batches
from app.core.db import session_scope
from app.core.errors import DomainError, Kind
from app.core.lifecycle import deliveries, jobs
from app.core.settings import get_settings
from app.core.status_codes import status_of
from app.core.storage import files

HERE = Path(__file__).parent
STATIC = HERE / "static"
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.globals["urlencode"] = urlencode
templates.env.globals["inf"] = float("inf")
LIVE_EVERY_MS = 2000

POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)

router = APIRouter(prefix="/console", include_in_schema=False)


def _secure(response: Response) -> Response:
    response.headers["Content-Security-Policy"] = POLICY
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"
    response.headers.setdefault("Cache-Control", "no-store")
    return response


def _set_cookie(request: Request, response: Response, session_id: str) -> None:
    response.set_cookie(
        sessions.COOKIE,
        session_id,
        max_age=int(get_settings().console_session_s),
        path="/console",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _viewer(request: Request) -> tuple[Viewer | None, str | None]:
    """The signed-in viewer (None: nobody), and a new session's id to set as the cookie (keys
    off: the first page signs in as the operator)."""
    viewer = sessions.viewer_of(request.cookies.get(sessions.COOKIE))
    if viewer is None and not get_settings().require_auth:
        session_id, viewer = sessions.open_session()
        return viewer, session_id
    return viewer, None


def _page(
    request: Request,
    name: str,
    build: Callable[[Viewer, float], dict[str, Any]],
    *,
    operator_only: bool = False,
) -> Response:
    """A page (or, with ``?live=1``, its live part alone) for the signed-in viewer; the sign-in
    page for nobody; an error page for a refusal (404 for another tenant's rows)."""
    try:
        viewer, new_session = _viewer(request)
    except DomainError as exc:  # Redis away: no session can be read
        return _refused(request, None, exc)
    live = request.query_params.get("live") == "1"
    if viewer is None:
        if live:  # console.js goes to the sign-in page on a 401
            return _secure(Response(status_code=401))
        return _secure(RedirectResponse("/console/login", status_code=303))
    try:
        if operator_only and not viewer.operator:
            raise DomainError(Kind.NOT_FOUND, "not_found", "no such page")
        context = build(viewer, time.time())
    except DomainError as exc:
        return _refused(request, viewer, exc)
    context.update(viewer=viewer, live_every=LIVE_EVERY_MS, page=name)
    template = f"{name}_live.html" if live else f"{name}.html"
    response = templates.TemplateResponse(request, template, context)
    if new_session is not None:
        _set_cookie(request, response, new_session)
    return _secure(response)


def _refused(request: Request, viewer: Viewer | None, exc: DomainError) -> Response:
    """The error page of a refusal, with its status (404 for another tenant's rows)."""
    context = {"error": exc.message, "code": exc.code, "viewer": viewer, "page": "error"}
    return _secure(
        templates.TemplateResponse(request, "error.html", context, status_code=status_of(exc))
    )


def _act(request: Request, csrf: str | None, action: Callable[[Viewer], str]) -> Response:
    """An action: refused without the session's CSRF token (403); done, it goes back to the
    page ``action`` names (303)."""
    viewer = None
    try:
        viewer, _ = _viewer(request)
        if viewer is None:
            raise DomainError(Kind.UNAUTHENTICATED, "unauthenticated", "sign in first")
        sessions.check_csrf(viewer, csrf or request.headers.get(sessions.CSRF_HEADER))
        back = action(viewer)
    except DomainError as exc:
        return _refused(request, viewer, exc)
    return _secure(RedirectResponse(back, status_code=303))


# --- signing in -------------------------------------------------------------------------------


@router.get("/login")
def login_page(request: Request) -> Response:
    if not get_settings().require_auth:
        return _page(request, "overview", _overview)
    return _secure(templates.TemplateResponse(request, "login.html", {"viewer": None}))


@router.post("/login")
def login(request: Request, key: Annotated[str, Form(max_length=200)]) -> Response:
    try:
        session_id, _ = sessions.sign_in(key)
    except DomainError as exc:
        # 401 for a wrong key; 503 while Redis, where sessions live, is away
        context = {"viewer": None, "error": exc.message}
        status = status_of(exc)
        return _secure(
            templates.TemplateResponse(request, "login.html", context, status_code=status)
        )
    response = RedirectResponse("/console", status_code=303)
    _set_cookie(request, response, session_id)
    return _secure(response)


@router.post("/logout")
def logout(request: Request, csrf: Annotated[str | None, Form()] = None) -> Response:
    def out(_: Viewer) -> str:
        sessions.sign_out(request.cookies.get(sessions.COOKIE))
        return "/console/login"

    response = _act(request, csrf, out)
    response.delete_cookie(sessions.COOKIE, path="/console")
    return response


# --- pages ------------------------------------------------------------------------------------


def _overview(viewer: Viewer, now: float) -> dict[str, Any]:
    with session_scope() as session:
        return views.overview(session, viewer, now)


@router.get("")
def overview(request: Request) -> Response:
    return _page(request, "overview", _overview)


@router.get("/jobs")
def jobs_list(
    request: Request,
    status: str | None = None,
    lane: str | None = None,
    model: str | None = None,
    tenant: str | None = None,
    batch: str | None = None,
    q: Annotated[str | None, Query(max_length=200)] = None,
    after: str | None = None,
) -> Response:
    filters = views.JobFilters(status, lane, model, tenant, batch, q, after)

    def build(viewer: Viewer, now: float) -> dict[str, Any]:
        with session_scope() as session:
            return views.jobs_page(session, viewer, filters, now)

    return _page(request, "jobs", build)


@router.get("/jobs/{job_id}")
def job(request: Request, job_id: str) -> Response:
    def build(viewer: Viewer, now: float) -> dict[str, Any]:
        with session_scope() as session:
            return views.job_page(session, viewer, job_id, now)

    return _page(request, "job", build)


@router.get("/batches")
def batch_list(request: Request, after: str | None = None) -> Response:
    def build(viewer: Viewer, now: float) -> dict[str, Any]:
        with session_scope() as session:
            return views.batches_page(session, viewer, after, now)

    return _page(request, "batches", build)


@router.get("/tenants")
def tenants(request: Request) -> Response:
    def build(_: Viewer, now: float) -> dict[str, Any]:
        with session_scope() as session:
            return views.tenants_page(session, now)

    return _page(request, "tenants", build, operator_only=True)


@router.get("/files/{file_id}")
async def file_content(request: Request, file_id: str) -> Response:
    """A file's bytes, as ``GET /v1/files/{id}/content`` serves them, for the signed-in
    viewer."""
    viewer = None
    try:
        viewer, _ = await run_in_threadpool(_viewer, request)
        if viewer is None:
            return _secure(RedirectResponse("/console/login", status_code=303))
        row = await run_in_threadpool(files.find, viewer.scope, file_id)
        answer = await downloads.response(row.id, row.bytes, row.filename, None)
    except DomainError as exc:
        context = {"error": exc.message, "code": exc.code, "viewer": viewer, "page": "error"}
        return _secure(
            templates.TemplateResponse(request, "error.html", context, status_code=status_of(exc))
        )
    return _secure(answer)


# --- actions: the calls of their /v1 routes ---------------------------------------------------


@router.post("/jobs/{job_id}/cancel")
def cancel_job(
    request: Request, job_id: str, csrf: Annotated[str | None, Form()] = None
) -> Response:
    def cancel(viewer: Viewer) -> str:
        with session_scope() as session:
            jobs.cancel(session, viewer.scope, job_id)
        return f"/console/jobs/{job_id}"

    return _act(request, csrf, cancel)


@router.post("/jobs/{job_id}/redeliver")
def redeliver(
    request: Request, job_id: str, csrf: Annotated[str | None, Form()] = None
) -> Response:
    def send(viewer: Viewer) -> str:
        with session_scope() as session:
            deliveries.redeliver_job_event(session, jobs.get(session, viewer.scope, job_id))
        return f"/console/jobs/{job_id}"

    return _act(request, csrf, send)


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(
    request: Request, batch_id: str, csrf: Annotated[str | None, Form()] = None
) -> Response:
    def cancel(viewer: Viewer) -> str:
        with session_scope() as session:
            batches.cancel(session, viewer.scope, batch_id)
        return "/console/batches"

    return _act(request, csrf, cancel)
