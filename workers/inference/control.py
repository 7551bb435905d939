"""Control messages from the API (Redis pub/sub): cancel a running job within a second.

Every worker hears every message and acts only on jobs it holds. A message missed while Redis
was unreachable is caught by the heartbeat, which also reads cancel requests from the database.
"""

from __future__ import annotations

import json
import logging
import threading

import redis

from app.core.messaging.names import CONTROL_CHANNEL
from workers.inference.executor import Executor

log = logging.getLogger("inferq.control")


class ControlListener:
    def __init__(self, executor: Executor, client: redis.Redis) -> None:
        self.executor = executor
        self.client = client
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="control", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                pubsub.subscribe(CONTROL_CHANNEL)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None:
                        self.handle(message["data"])
                pubsub.close()
            except redis.RedisError as exc:
                log.warning("control channel lost (%s); reconnecting", exc)
                self._stop.wait(1.0)

    def handle(self, data: bytes | str) -> None:
        try:
            message = json.loads(data)
        except ValueError:
            log.warning("ignoring malformed control message %r", data)
            return
        job_id = message.get("job_id")
        if (
            message.get("action") == "cancel"
            and isinstance(job_id, str)
            and self.executor.request_abort(job_id, "cancelled")
        ):
            log.info("cancel: aborting %s", job_id)
