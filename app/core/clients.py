"""This process's connections to Redis, made on first use from the settings, dropped by one reset.

A process holds one synchronous client (thread-safe; its connections come from its pool), one
asyncio client for the API's event loop (the relay's subscription, app/core/relay.py) and the
Celery producer (app/core/broker.py), and keeps for a moment some of what it read through
them (the live models, model cards, tenants' queued jobs and lanes' depths: app/core/catalog.py,
tokens.py, limits.py). They are built from the settings of the moment they are first asked for;
:func:`reset` drops every one of them, so that the next use builds or reads them again (tests
that change ``INFERQ_REDIS_URL`` or ``INFERQ_DATABASE_URL`` call it, after
``get_settings.cache_clear()``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import redis
import redis.asyncio

from app.core.settings import get_settings

T = TypeVar("T")

_lock = threading.RLock()
_held: dict[str, Any] = {}


def held(name: str, build: Callable[[], T]) -> T:
    """This process's ``name``, built by ``build`` at its first use (and after a reset)."""
    with _lock:
        if name not in _held:
            _held[name] = build()
        return cast(T, _held[name])


def reset() -> None:
    """Drop every client and producer; the next use builds them from the settings of then."""
    with _lock:
        _held.clear()


def redis_client() -> redis.Redis:
    """The synchronous client, for every thread of this process."""

    def build() -> redis.Redis:
        settings = get_settings()
        timeout = settings.dependency_timeout_s
        return redis.Redis.from_url(
            settings.redis_url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            health_check_interval=30,
        )

    return held("redis", build)


def async_redis() -> redis.asyncio.Redis:
    """The asyncio client of the API's event loop (no socket timeout: a subscription waits)."""

    def build() -> redis.asyncio.Redis:
        settings = get_settings()
        return redis.asyncio.Redis.from_url(
            settings.redis_url,
            socket_connect_timeout=settings.dependency_timeout_s,
            health_check_interval=30,
        )

    return held("redis-async", build)


def redis_ok() -> bool:
    try:
        return bool(redis_client().ping())
    except redis.RedisError:
        return False
