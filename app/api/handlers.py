"""The API's exception handlers: every failure answers in the error envelope of app/api/errors.py.

Domain errors, request validation, unknown routes and a database that is down are translated
here, so no route builds an error response by hand.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.errors import body_of, error_body, headers_of
from app.core.errors import DomainError, named, pydantic_error
from app.core.status_codes import status_of

log = logging.getLogger("inferq.api")


def _respond(
    status: int,
    code: str | None,
    message: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, code, message, param), status, headers=headers)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": "invalid"}
    if first.get("type") in ("json_invalid", "json_type"):
        return _respond(400, "invalid_json", f"request body is not valid JSON: {first['msg']}")
    code, param, message = pydantic_error(first)
    message = named(param, message)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return _respond(422, code, message, param)


async def _domain_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DomainError)
    return JSONResponse(body_of(exc), status_of(exc), headers=headers_of(exc))


# What FastAPI raises for a body it could not decode, where json.loads found no syntax error:
# a JSON body that is not UTF-8 (RFC 8259), or a form it could not parse.
_UNPARSED = "There was an error parsing the body"


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    json = "json" in request.headers.get("content-type", "")
    if exc.status_code == 400 and exc.detail == _UNPARSED and json:
        return _respond(400, "invalid_json", "request body is not valid JSON: not UTF-8 text")
    codes = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
    return _respond(
        exc.status_code,
        codes.get(exc.status_code, "http_error"),
        str(exc.detail),
        headers=dict(exc.headers or {}),
    )


async def _database_down(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", exc)
    return _respond(
        503,
        "database_unavailable",
        "the database is unavailable; retry later",
        None,
        {"Retry-After": "5"},
    )


async def _internal(_request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error", exc_info=exc)
    return _respond(500, "internal_error", "internal server error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(DomainError, _domain_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(OperationalError, _database_down)
    app.add_exception_handler(InterfaceError, _database_down)
    app.add_exception_handler(Exception, _internal)
