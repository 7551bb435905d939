"""INFERQ_REDIS_URL in its Sentinel form: parsed once, at settings time, with a clear error for
a URL that cannot work, and turned into kombu's form for the broker."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.core.settings import Sentinel, Settings


def test_a_sentinel_url_names_the_sentinels_the_master_and_the_database() -> None:
    url = "sentinel://:s%40cret@10.0.0.1:26379,10.0.0.2:26380,[::1]:26381/2?master_name=mymaster"
    found = Settings(redis_url=url).redis_sentinel
    assert found == Sentinel(
        sentinels=[("10.0.0.1", 26379), ("10.0.0.2", 26380), ("::1", 26381)],
        master="mymaster",
        db=2,
        password="s@cret",
    )
    assert found.kombu_url() == (
        "sentinel://:s%40cret@10.0.0.1:26379/2;sentinel://:s%40cret@10.0.0.2:26380/2;"
        "sentinel://:s%40cret@[::1]:26381/2"
    )


def test_a_plain_redis_url_has_no_sentinels() -> None:
    assert Settings(redis_url="redis://127.0.0.1:6379/0").redis_sentinel is None


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sentinel://h1:26379,h2:26379/0", "names no master"),
        ("sentinel://h1,h2:26379/0?master_name=m", "each sentinel is host:port"),
        ("sentinel://h1:26379/zero?master_name=m", "the database is a number"),
    ],
)
def test_a_sentinel_url_that_cannot_work_is_refused_at_start(url: str, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Settings(redis_url=url)
