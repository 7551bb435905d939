"""Where the bytes of files live (batch inputs and outputs): one local directory.

The ``files`` table holds what a file is (owner, purpose, size); this module holds its bytes,
under ``INFERQ_FILES_DIR`` (default ``data_dir/files``), one file per id. Writes go to a
temporary name and are renamed into place, so a reader never sees half a file and a crashed
upload leaves no file behind. Everything streams in blocks: a 200 MB file never sits in
memory. The API and the ops worker must see the same directory (a shared volume in
docker-compose).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from app.core.settings import get_settings

BLOCK = 1 << 20


class TooLarge(Exception):
    """The source had more bytes than the limit allowed (nothing was stored)."""


def _root() -> Path:
    root = get_settings().storage_dir
    root.mkdir(parents=True, exist_ok=True)
    return root


def path(file_id: str) -> Path:
    if not file_id.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"not a file id: {file_id!r}")
    return _root() / file_id


@contextlib.contextmanager
def writer(file_id: str) -> Iterator[BinaryIO]:
    """Write a file under ``file_id``; it appears only if the block ends without an error."""
    target = path(file_id)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{file_id}.")
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def save(file_id: str, source: BinaryIO, limit: int) -> int:
    """Copy ``source`` into storage; returns its size. More than ``limit`` bytes: TooLarge."""
    size = 0
    with writer(file_id) as out:
        while block := source.read(BLOCK):
            size += len(block)
            if size > limit:
                raise TooLarge(f"the file is larger than {limit} bytes")
            out.write(block)
    return size


def size(file_id: str) -> int:
    return path(file_id).stat().st_size


def open_file(file_id: str) -> BinaryIO:
    return path(file_id).open("rb")


def delete(file_id: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path(file_id).unlink()
