"""This process's connections to Redis, made on first use from the settings, dropped by one reset.

A process holds one synchronous client (thread-safe; its connections come from its pool), one
asyncio client for the API's event loop (the relay's subscription, app/core/messaging/relay.py) and
the Celery producer (app/core/messaging/broker.py), and keeps for a moment some of what it read
through them (the live models, model cards, tenants' queued jobs and lanes' depths:
app/core/scheduling/catalog.py, tokens.py, limits.py). They are built from the settings of the
moment they are first asked for; :func:`reset` drops every one of them, so that the next use builds
or reads them again (tests that change ``INFERQ_REDIS_URL`` or ``INFERQ_DATABASE_URL`` call it,
after ``get_settings.cache_clear()``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar, cast

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel

from app.core.settings import Sentinel, get_settings

_log = logging.getLogger("inferq.redis")

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


def _connect(url: str, kind: Any, sentinels: Any, options: dict[str, Any]) -> Any:
    """A client of the Redis at ``url`` (``kind``: redis-py's sync or asyncio class, with its
    ``Sentinel``). Through Sentinel, each new connection asks the sentinels for the master:
    after a failover the next command reaches the new one, with no restart (docs/reliability.md,
    "Redis in production")."""
    sentinel = Sentinel.of(url)
    if sentinel is None:
        return kind.from_url(url, **options)
    timeout = options.get("socket_connect_timeout")
    found = sentinels(sentinel.sentinels, socket_connect_timeout=timeout, socket_timeout=timeout)
    return found.master_for(sentinel.master, db=sentinel.db, password=sentinel.password, **options)


def connect(url: str, **options: Any) -> redis.Redis:
    """A new synchronous client of the Redis at ``url`` (``redis://`` or ``sentinel://``)."""
    client: redis.Redis = _connect(url, redis.Redis, redis.sentinel.Sentinel, options)
    return client


def redis_client() -> redis.Redis:
    """The synchronous client, for every thread of this process."""

    def build() -> redis.Redis:
        settings = get_settings()
        timeout = settings.dependency_timeout_s
        return connect(
            settings.redis_url,
            socket_connect_timeout=timeout,
            socket_timeout=timeout,
            health_check_interval=30,
        )

    return held("redis", build)


def async_redis() -> redis.asyncio.Redis:
    """The asyncio client of the API's event loop. No socket timeout is set here: the reply
    subscription reads with none of its own (``relay.Replies``: a quiet channel is a normal
    one), and other commands keep redis-py's default (5 s from redis-py 8, none before)."""

    def build() -> redis.asyncio.Redis:
        settings = get_settings()
        options = {
            "socket_connect_timeout": settings.dependency_timeout_s,
            "health_check_interval": 30,
        }
        client: redis.asyncio.Redis = _connect(
            settings.redis_url, redis.asyncio.Redis, redis.asyncio.sentinel.Sentinel, options
        )
        return client

    return held("redis-async", build)


def redis_ok() -> bool:
    try:
        return bool(redis_client().ping())
    except redis.RedisError:
        return False


def durability_warnings(client: redis.Redis) -> list[str]:
    """What in Redis's configuration can lose a message: an eviction policy (an evicted list
    is a queue gone) or no persistence at all (a restart empties every list). Either way the
    database keeps every job and the reaper sends them again, but only after its grace
    (docs/reliability.md, "Redis in production"). Nothing is said where CONFIG is refused (managed
    Redis services)."""
    try:
        config = {
            **client.config_get("maxmemory-policy"),
            **client.config_get("appendonly"),
            **client.config_get("save"),
        }
    except redis.RedisError:
        return []
    found = []
    policy = config.get("maxmemory-policy", "noeviction")
    if policy != "noeviction":
        found.append(
            f"Redis's maxmemory-policy is {policy}, not noeviction: under memory pressure it "
            "drops queued messages, whose jobs then wait for the reaper"
        )
    if config.get("appendonly", "no") != "yes" and not config.get("save"):
        found.append(
            "Redis keeps nothing on disk (appendonly no, save empty): a restart loses every "
            "queued message, whose jobs then wait for the reaper; set appendonly yes"
        )
    return found


def warn_if_not_durable() -> None:
    """Log :func:`durability_warnings` once, at a process's start."""
    for line in durability_warnings(redis_client()):
        _log.warning("%s", line)
