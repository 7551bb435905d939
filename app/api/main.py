"""The FastAPI application: routers, the error map, the body-size guard and HEAD."""

from __future__ import annotations

import json
import re

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app import __version__
from app.api import console, errors, handlers, watch
from app.api.routes import (
    batches,
    health,
    jobs,
    openai,
    responses,
    status,
    tenants,
    tokenize,
    webhooks,
)
from app.core.settings import get_settings

# Multipart framing around an uploaded file: its size is checked exactly by
# app/core/storage/files.py.
UPLOAD_OVERHEAD = 64 * 1024


class BodyLimit:
    """413 before any parsing: by Content-Length, or while the body streams in.

    ``paths`` gives some paths a limit of their own (file uploads are far larger than JSON).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None) -> None:
        self.app = app
        self.default = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope["path"], self.default)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit():
            if int(length) > limit:
                await self._reject(send, limit)
                return
            # The server reads exactly Content-Length bytes: nothing more can arrive, so the
            # app runs unwrapped (every streamed chunk of an answer passes through ``send``).
            await self.app(scope, receive, send)
            return
        seen = 0
        too_large = False

        async def guarded_receive() -> Message:
            nonlocal seen, too_large
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Stop feeding the app; it sees a disconnect and its answer is dropped.
                    too_large = True
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not too_large:
                await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except Exception:
            if not too_large:
                raise
        if too_large:
            await self._reject(send, limit)

    async def _reject(self, send: Send, limit: int) -> None:
        body = json.dumps(
            errors.error_body(
                413,
                "request_too_large",
                f"request body is larger than {limit} bytes",
                None,
            )
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


class HeadAsGet:
    """HEAD answered as GET, without the body: link checkers and uptime probes send HEAD, and
    FastAPI's routes take only the methods they name (405 otherwise). A file's bytes are left
    out (405 still): a HEAD would read the whole object from the store only to drop it."""

    SKIP = re.compile(r"^/(v1/files/[^/]+/content|console/files/[^/]+)$")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD" or self.SKIP.match(scope["path"]):
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def create_app() -> FastAPI:
    app = FastAPI(
        title="inferq",
        version=__version__,
        description="Durable, prioritised LLM inference jobs in front of vLLM.",
        lifespan=watch.lifespan,
    )
    handlers.install(app)
    app.include_router(health.router)
    app.include_router(jobs.router)
    app.include_router(openai.router)
    app.include_router(tokenize.router)
    app.include_router(responses.router)
    app.include_router(batches.router)
    app.include_router(webhooks.router)
    app.include_router(tenants.router)
    app.include_router(status.router)
    console.install(app)
    settings = get_settings()
    app.add_middleware(HeadAsGet)
    app.add_middleware(
        BodyLimit,
        max_bytes=settings.max_body_bytes,
        paths={"/v1/files": settings.files_max_bytes + UPLOAD_OVERHEAD},
    )
    return app
