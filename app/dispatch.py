"""The only place the API touches Celery and Redis: enqueue by task name, signal workers.

Messages carry job ids, never payloads: the row is the truth. Queue declarations and broker
options are defined here once and reused by ``workers/celery_app.py`` so that producer and
consumers cannot disagree about them.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable
from typing import Any

import redis
from celery import Celery
from kombu import Exchange, Queue

from app.settings import LANES, Settings, get_settings

log = logging.getLogger("inferq.dispatch")

RUN_JOB_TASK = "inferq.run_job"
CONTROL_CHANNEL = "inferq:control"
WORKERS_KEY_PREFIX = "inferq:worker:"

_lock = threading.Lock()
_producer: Celery | None = None
_redis: redis.Redis | None = None


def task_queues(names: Iterable[str] = LANES) -> list[Queue]:
    """Queues in strict priority order: a worker polls them in exactly this order."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in names]


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        # BRPOP the queues in the order they were declared: strict lane priority,
        # instead of kombu's default round robin.
        "queue_order_strategy": "priority",
        "priority_steps": [0],
        "socket_connect_timeout": settings.dependency_timeout_s,
        "socket_timeout": max(30.0, settings.dependency_timeout_s),
    }


def _celery() -> Celery:
    global _producer
    with _lock:
        if _producer is None:
            settings = get_settings()
            app = Celery("inferq-api", broker=settings.redis_url, set_as_current=False)
            app.conf.update(
                task_queues=task_queues(),
                broker_transport_options=broker_transport_options(settings),
                broker_connection_timeout=settings.dependency_timeout_s,
                task_publish_retry_policy={
                    "max_retries": 2,
                    "interval_start": 0.1,
                    "interval_step": 0.2,
                    "interval_max": 0.5,
                },
            )
            _producer = app
        return _producer


def redis_client() -> redis.Redis:
    global _redis
    with _lock:
        if _redis is None:
            timeout = get_settings().dependency_timeout_s
            _redis = redis.Redis.from_url(
                get_settings().redis_url,
                socket_connect_timeout=timeout,
                socket_timeout=timeout,
                health_check_interval=30,
            )
        return _redis


def redis_ok() -> bool:
    try:
        return bool(redis_client().ping())
    except redis.RedisError:
        return False


def enqueue(jobs: Iterable[tuple[str, str]]) -> list[str]:
    """Send ``run_job`` for each (job id, lane). Returns the ids that could not be sent.

    A failure here never loses a job: the row is committed first and the reaper re-enqueues
    queued rows whose message went missing.
    """
    app = _celery()
    failed: list[str] = []
    with app.producer_or_acquire() as producer:
        for job_id, lane in jobs:
            try:
                # A direct queue is published through the anonymous exchange (LPUSH onto the
                # lane's list), so delivery does not depend on kombu's binding keys in Redis.
                app.send_task(RUN_JOB_TASK, args=[job_id], queue=lane, producer=producer)
            except Exception:  # kombu raises several connection error types
                log.exception("could not enqueue %s on %s", job_id, lane)
                failed.append(job_id)
    return failed


def publish_control(action: str, **fields: Any) -> int:
    """Broadcast a control message (e.g. cancel a running job) to every worker."""
    message = json.dumps({"action": action, **fields})
    return int(redis_client().publish(CONTROL_CHANNEL, message))
