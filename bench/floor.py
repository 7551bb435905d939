"""The floor of the ``overhead`` scenario: a bare OpenAI-compatible SSE server around the
SIMULATED engine, written for the bench only.

It holds the same simulated engine a worker runs (the same cost model and settings, from
``INFERQ_*``) in its own event loop, the way vLLM's OpenAI server holds its engine: no
database, no queue, no lease, no relay. ``POST /v1/chat/completions`` with ``stream: true``
answers in OpenAI's chunk format, one chunk per engine step, then the usage chunk and
``[DONE]``. What inferq adds on top of this server is the platform's own cost
(docs/benchmarks.md, "overhead").

    python -m bench.floor --port 8123
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import click
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from app.core.settings import get_settings
from workers.engines import create_engine
from workers.engines.base import Engine, GenRequest

REALTIME_PRIORITY = 0


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app() -> Starlette:
    settings = get_settings()
    engine: Engine = create_engine(settings.model_copy(update={"engine": "simulated"}))
    ids = itertools.count()

    async def chat(request: Request) -> Response:
        body = await request.json()
        request_id = f"floor-{next(ids)}"
        created = int(time.time())
        req = GenRequest(
            request_id=request_id,
            messages=body["messages"],
            max_tokens=int(body.get("max_tokens") or 16),
            temperature=float(body.get("temperature", 1.0)),
            priority=REALTIME_PRIORITY,
            arrival=time.time(),
        )
        usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            return {
                "id": request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": body.get("model", engine.model_name),
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }

        async def events() -> AsyncIterator[str]:
            yield _sse(chunk({"role": "assistant", "content": ""}))
            prompt = completion = 0
            async for piece in engine.generate(req):
                completion += piece.num_tokens
                prompt = piece.prompt_tokens or prompt
                if piece.text:
                    yield _sse(chunk({"content": piece.text}))
                if piece.finish_reason is not None:
                    yield _sse(chunk({}, piece.finish_reason))
            if usage:
                total = {"prompt_tokens": prompt, "completion_tokens": completion}
                total["total_tokens"] = prompt + completion
                yield _sse({**chunk({}), "choices": [], "usage": total})
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_request: Request) -> Response:
        return Response("ok")

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await engine.start()
        yield
        await engine.shutdown()

    return Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/health", health),
        ],
        lifespan=lifespan,
    )


@click.command()
@click.option("--host", default="127.0.0.1")
@click.option("--port", type=int, required=True)
def main(host: str, port: int) -> None:
    """Serve the floor (see the module docstring)."""
    uvicorn.run(create_app(), host=host, port=port, log_level="warning")


if __name__ == "__main__":
    main()
