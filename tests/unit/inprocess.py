"""The API and an inference worker in this process, for the fast layer: the real app called over
``httpx.ASGITransport``, and the real executor, recorder and relay on a simulated engine fed
from the real Redis lists (the part Celery's consumer plays in a worker process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx

from app.api.main import create_app
from app.core.messaging import broker, clients, names
from app.core.processes.presence import Presence
from app.core.scheduling import tokens
from app.core.settings import LANES, Settings
from workers.engines.simulated import CostModel, SimulatedEngine
from workers.inference.main import build_executor
from workers.inference.runner import Runner

T = TypeVar("T")
BASE_URL = "http://inferq.test"


def run(scenario: Callable[[httpx.AsyncClient], Awaitable[T]]) -> T:
    """Run ``scenario`` against a fresh app in an event loop of its own."""

    async def main() -> T:
        transport = httpx.ASGITransport(app=create_app())
        async with httpx.AsyncClient(transport=transport, base_url=BASE_URL) as client:
            return await scenario(client)

    try:
        return asyncio.run(main())
    finally:
        # The reply channel's reader lives in the loop that made it, and this loop is gone: the
        # next call's loop subscribes afresh. (An API has one loop for its life; here each call
        # has its own, and a reader the old loop could not finish would otherwise look alive
        # and leave the next call's pieces unread.)
        clients._held.pop("replies", None)


def call(method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One request to the API, in process."""

    async def scenario(client: httpx.AsyncClient) -> httpx.Response:
        return await client.request(method, path, **kwargs)

    return run(scenario)


def create_batch(lines: list[bytes], endpoint: str) -> str:
    """Upload ``lines`` as a batch input file and create a batch of ``endpoint`` on it (left
    ``validating``, for the test to start as the ops worker does); its id."""
    upload = call(
        "POST",
        "/v1/files",
        data={"purpose": "batch"},
        files={"file": ("in.jsonl", b"\n".join(lines) + b"\n")},
    )
    assert upload.status_code == 200, upload.text
    body = {"input_file_id": upload.json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    made = call("POST", "/v1/batches", json=body)
    assert made.status_code == 200, made.text
    return str(made.json()["id"])


class Worker:
    """An inference worker's executor on a simulated engine (SIMULATED), announced like a
    worker, taking its model's messages from Redis in lane order on a thread of its own."""

    def __init__(
        self,
        settings: Settings,
        max_model_len: int = 131_072,
        *,
        model: str | None = None,
        task: str = "generate",
    ) -> None:
        """``model`` (default the settings') served for ``task``: generate, or a pooling
        model's embed or score."""
        name = model or settings.model_name
        engine = SimulatedEngine(
            CostModel.from_settings(settings, pooling=task != "generate", base_ms=1.0),
            model_name=name,
            max_model_len=max_model_len,
            task=task,
            embed_dim=settings.sim_embed_dim,
        )
        self.runner = Runner(engine)
        self.executor = build_executor(self.runner, f"in-process-{name}", settings)
        self.queues = [names.queue_of(lane, name) for lane in LANES]
        record = {"model": name, "lanes": list(LANES), "concurrency": 16, "task": task}
        self.presence = Presence("inference", f"in-process-{name}", 60, lambda: record)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="in-process-worker", daemon=True)

    def __enter__(self) -> Worker:
        self.runner.start()
        self.executor.start()
        engine = self.runner.engine
        # What a worker publishes for the API to count prompt tokens with (its model card).
        tokens.publish(
            clients.redis_client(),
            engine.model_name,
            engine.max_model_len,
            engine.tokenizer_json(),
            engine.tool_parser,
            engine.task,
            engine.embed_dim,
            engine.matryoshka,
            engine.chat_template(),
        )
        self.presence.announce()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.presence.withdraw()
        self.runner.shutdown()

    def _loop(self) -> None:
        client = clients.redis_client()
        while not self._stop.is_set():
            popped = client.brpop(self.queues, timeout=0.1)
            if popped is None:
                continue
            message = broker.RunJobs.of_stored(popped[1])
            self.executor.execute(message.job_ids, message.lane)
