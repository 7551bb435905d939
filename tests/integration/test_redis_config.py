"""At start every process warns when Redis can lose a message (docs/reliability.md, "Redis in
production"): checked
against redis-servers of their own, configured each way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.core.messaging.clients import durability_warnings
from tests.chaos.servers import RedisServer


@contextlib.contextmanager
def server(directory: Path, *extra: str) -> Iterator[RedisServer]:
    found = RedisServer(directory, extra=extra)
    try:
        found.start()
        yield found
    finally:
        found.close()


def test_the_durable_configuration_says_nothing(tmp_path: Path) -> None:
    with server(tmp_path) as redis_server:  # inferq up's: AOF every second, noeviction
        assert durability_warnings(redis_server.client()) == []


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (("--maxmemory-policy", "allkeys-lru"), ["maxmemory-policy is allkeys-lru"]),
        (("--appendonly", "no"), ["keeps nothing on disk"]),
        (
            ("--appendonly", "no", "--maxmemory-policy", "volatile-lru"),
            ["maxmemory-policy is volatile-lru", "keeps nothing on disk"],
        ),
    ],
)
def test_eviction_or_no_persistence_is_said(
    tmp_path: Path, extra: tuple[str, ...], says: list[str]
) -> None:
    with server(tmp_path, *extra) as redis_server:
        found = durability_warnings(redis_server.client())
    assert len(found) == len(says)
    for line, words in zip(found, says, strict=True):
        assert words in line


def test_a_redis_that_refuses_config_says_nothing(tmp_path: Path) -> None:
    # Managed Redis services refuse CONFIG: nothing can be checked, nothing is claimed.
    with server(tmp_path, "--rename-command", "CONFIG", "") as redis_server:
        assert durability_warnings(redis_server.client()) == []
