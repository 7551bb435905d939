"""The parts of files that need no server: the upload's counter (its limits across chunk
boundaries), the one byte range a download serves, expires_after, and the store's all-or-
nothing writes on the local directory (docs/files.md)."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.api.downloads import Unsatisfiable, span
from app.core.errors import DomainError
from app.core.storage import files, store
from tests.unit.conftest import environment


class Refused(Exception):
    """What a caller's source raises midway (the upload route's checks raise theirs)."""


LIMITS = {"files_max_bytes": "100", "batch_max_lines": "3", "max_body_bytes": "2048"}


def counted(*chunks: bytes) -> files.Counter:
    with environment(**LIMITS) as settings:
        counter = files.Counter(settings)
        for chunk in chunks:
            counter.feed(chunk)
        counter.finish()
        return counter


def refused(*chunks: bytes, **limits: str) -> str:
    with environment(**{**LIMITS, **limits}) as settings, pytest.raises(DomainError) as exc:
        counter = files.Counter(settings)
        for chunk in chunks:
            counter.feed(chunk)
        counter.finish()
    return exc.value.code


def test_lines_are_counted_across_chunks_and_blank_ones_are_not() -> None:
    counter = counted(b'{"a"', b": 1}\n\n  \n{}", b"\n{}")
    assert (counter.bytes, counter.lines) == (18, 3)
    assert refused(b"{}\n{}\n{}\n{}") == "too_many_lines"
    assert refused(b"{}\n{}\n", b"{}\n", b"\n", b"{}\n") == "too_many_lines"


def test_size_length_and_emptiness() -> None:
    assert refused(b"{}\n" * 34) == "file_too_large"  # 102 bytes
    assert counted(b"x" * 98 + b"\n").bytes == 99
    assert refused(b"x" * 30, b"x" * 30, max_body_bytes="50") == "line_too_long"
    assert refused(b"\n \n") == "empty_file"


def test_expires_after() -> None:
    with environment() as settings:
        assert files.expires_in({}, settings) == 30 * 24 * 3600
        fields = {"expires_after[anchor]": "created_at", "expires_after[seconds]": "7200"}
        assert files.expires_in(fields, settings) == 7200
        for bad in ({**fields, "expires_after[seconds]": "60"}, {"expires_after[anchor]": "x"}):
            with pytest.raises(DomainError) as exc:
                files.expires_in(bad, settings)
            assert exc.value.code == "invalid_expires_after"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("bytes=0-9", (0, 10)),
        ("bytes=5-", (5, 100)),
        ("bytes=-10", (90, 100)),
        ("bytes=-500", (0, 100)),
        ("bytes=90-500", (90, 100)),
        ("bytes=0-1,4-5", None),  # several spans: the whole file
        ("items=0-9", None),
        ("bytes=9-3", None),  # invalid: ignored
        ("bytes=x-", None),
    ],
)
def test_one_byte_range(header: str | None, expected: tuple[int, int] | None) -> None:
    assert span(header, 100) == expected


@pytest.mark.parametrize("header", ["bytes=100-", "bytes=150-200", "bytes=-0"])
def test_a_range_past_the_end_is_unsatisfiable(header: str) -> None:
    with pytest.raises(Unsatisfiable):
        span(header, 100)


def test_writes_are_all_or_nothing_on_the_local_store(tmp_path: Path) -> None:
    with environment(files_url=f"file://{tmp_path}"):
        with pytest.raises(RuntimeError), store.writer("file_broken") as out:
            out.write(b"x" * (20 << 20))  # parts already staged
            raise RuntimeError("the caller failed")
        assert list(tmp_path.iterdir()) == []

        async def parts(fail: bool) -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"y" * (6 << 20)
            if fail:
                raise Refused("refused midway")

        with pytest.raises(Refused):
            asyncio.run(store.put("file_refused", parts(True)))
        assert list(tmp_path.iterdir()) == []
        asyncio.run(store.put("file_whole", parts(False)))
        assert [p.name for p in tmp_path.iterdir()] == ["file_whole"]
        assert store.size("file_whole") == 18 << 20
        with store.open_file("file_whole") as source:
            assert source.readline(10) == b"y" * 10
        store.delete("file_whole")
        store.delete("file_whole")  # none is fine
        assert list(tmp_path.iterdir()) == []
        assert store.check() is None


def test_staging_files_left_by_a_killed_upload_go_after_a_while(tmp_path: Path) -> None:
    old, fresh, whole = tmp_path / "file_old#1", tmp_path / "file_new#1", tmp_path / "file_done"
    for path in (old, fresh, whole):
        path.write_bytes(b"x")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    os.utime(whole, (time.time() - 7200, time.time() - 7200))
    with environment(files_url=f"file://{tmp_path}"):
        assert store.abort_abandoned(3600) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file_done", "file_new#1"]
