"""Where the bytes of files live (batch inputs and outputs): one object store, named by a URL.

The ``files`` table holds what a file is (owner, purpose, size, expiry); this module holds its
bytes, one object per file id, in the store ``INFERQ_FILES_URL`` names (docs/files.md):
``file:///dir`` (the default: ``INFERQ_FILES_DIR``, else ``data_dir/files``, for one host),
``s3://bucket/prefix`` (AWS S3 and S3-compatible stores, with ``INFERQ_FILES_ENDPOINT`` and
``INFERQ_FILES_REGION``), ``gs://bucket/prefix``, ``az://container/prefix``, and
``memory:///``. obstore (Apache Arrow's ``object_store``) speaks to all of them with one API;
credentials come from each cloud's own environment (``AWS_ACCESS_KEY_ID``, IRSA's web identity
token, GKE's workload identity, ...), never from inferq's settings, so nothing here can print
them.

Every write is all or nothing: a writer that ends with an error aborts its multipart upload
(S3 drops the parts; the local store deletes its staging file), and an object appears only
when its writer completes. Everything streams in parts: a 200 MB file never sits in memory.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import BaseError, NotFoundError
from obstore.store import LocalStore, from_url

from app.core.errors import DomainError, Kind
from app.core.settings import Settings, get_settings

if TYPE_CHECKING:
    from obstore import WritableFile
    from obstore.store import ObjectStore

PART = 8 << 20  # bytes per part of an upload (S3's smallest part is 5 MiB)
READ_BLOCK = 1 << 20  # bytes per read from the store, and per chunk sent to a client
RETRY_AFTER_S = 5


def unavailable(exc: BaseException) -> DomainError:
    """The store did not answer or refused us: the caller may try again (503)."""
    return DomainError(
        Kind.UNAVAILABLE,
        "file_store_unavailable",
        f"the file store is unavailable: {type(exc).__name__}",
        retry_after_s=RETRY_AFTER_S,
    )


def store() -> ObjectStore:
    """This process's store, as the settings name it."""
    s = get_settings()
    return _open(s.files_url, str(s.storage_dir), s.files_endpoint, s.files_region)


def describe(settings: Settings) -> str:
    """The store the settings name, in one line without credentials, for a person: what
    `inferq up`'s banner and `inferq status`'s first line say."""
    local = _local_dir(settings.files_url, str(settings.storage_dir.resolve()))
    if local is not None:
        return f"local directory {local}"
    parts = urlsplit(settings.files_url)
    named = f"{parts.scheme}://{parts.hostname or ''}{parts.path}"  # no user:password@
    if settings.files_endpoint:
        endpoint = urlsplit(settings.files_endpoint)
        return f"{named} at {endpoint.scheme}://{endpoint.hostname}" + (
            f":{endpoint.port}" if endpoint.port else ""
        )
    return named


def _local_dir(url: str, storage_dir: str) -> str | None:
    """The directory of a local store (an empty URL: ``storage_dir``), None for a remote one."""
    if not url:
        return storage_dir
    return url.removeprefix("file://") if url.startswith("file://") else None


@lru_cache(maxsize=4)
def _open(url: str, directory: str, endpoint: str, region: str) -> ObjectStore:
    local = _local_dir(url, directory)
    if local is not None:
        return LocalStore(local, mkdir=True)
    config: dict[str, Any] = {}
    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=5),
        # A whole request: a download streamed to a slow client keeps its GET open.
        "timeout": timedelta(hours=1),
    }
    if url.startswith(("s3://", "s3a://")):
        if endpoint:
            config["endpoint"] = endpoint
            client["allow_http"] = endpoint.startswith("http://")
        if region:
            config["region"] = region
    # A store that does not answer is a 503 within seconds, not a request hung for the
    # library's default three minutes of retries.
    backoff = {"init_backoff": timedelta(milliseconds=100), "max_backoff": timedelta(seconds=2)}
    retry = {"max_retries": 2, "retry_timeout": timedelta(seconds=10), "backoff": backoff}
    return from_url(  # type: ignore[call-overload, no-any-return]
        url, config=config or None, client_options=client, retry_config=retry
    )


def key(file_id: str) -> str:
    if not file_id.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"not a file id: {file_id!r}")
    return file_id


# --- writing -----------------------------------------------------------------------------------


class _Writer:
    """obstore's buffered writer, its store's failures a 503 (obstore raises them as
    ``OSError`` from ``write`` and ``close``); ``size``: the bytes written, the object's size
    once the block ends (no HEAD request to learn it)."""

    def __init__(self, out: WritableFile) -> None:
        self._out = out
        self.size = 0

    def write(self, data: bytes) -> int:
        try:
            written = self._out.write(data)
        except (BaseError, OSError) as exc:
            raise unavailable(exc) from exc
        self.size += written
        return written


@contextlib.contextmanager
def writer(file_id: str) -> Iterator[_Writer]:
    """Write the object of ``file_id``; it appears only if the block ends without an error
    (an error aborts the upload: no object, no parts)."""
    try:
        out = obstore.open_writer(store(), key(file_id), buffer_size=PART)
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc
    try:
        yield _Writer(out)
    except BaseException as failure:
        # Abort; a store that is down cannot be told, and its parts wait for the bucket's
        # lifecycle rule (docs/files.md, "Expiry"): the failure that got us here is the one
        # to raise.
        with contextlib.suppress(BaseError, OSError):
            out.__exit__(type(failure), failure, failure.__traceback__)
        raise
    try:
        out.close()
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc


async def put(file_id: str, parts: AsyncIterator[bytes]) -> None:
    """Stream ``parts`` into the object of ``file_id`` (a multipart upload). An exception from
    ``parts`` aborts the upload and is raised again as it was; a store that fails is a 503."""
    try:
        await obstore.put_async(store(), key(file_id), parts, chunk_size=PART, max_concurrency=4)
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc


# --- reading -----------------------------------------------------------------------------------


class _Raw(io.RawIOBase):
    """obstore's buffered reader as a raw stream, so that ``io.BufferedReader`` gives it
    ``readline(limit)``."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        try:
            data = self._source.read(len(buffer))
        except (BaseError, OSError) as exc:
            raise unavailable(exc) from exc
        buffer[: len(data)] = memoryview(data)
        return len(data)

    def close(self) -> None:
        self._source.close()
        super().close()


def open_file(file_id: str) -> io.BufferedReader:
    """The object of ``file_id``, read in ranged blocks as it is consumed; FileNotFoundError
    if there is none."""
    try:
        source = obstore.open_reader(store(), key(file_id), buffer_size=READ_BLOCK)
    except (NotFoundError, FileNotFoundError):  # the local store raises the latter
        raise FileNotFoundError(file_id) from None
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc
    return io.BufferedReader(_Raw(source), buffer_size=READ_BLOCK)


def size(file_id: str) -> int:
    try:
        return int(obstore.head(store(), key(file_id))["size"])
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc


async def open_stream(file_id: str, start: int, end: int) -> AsyncIterator[memoryview]:
    """Bytes ``start`` to ``end`` (exclusive) of the object, a block at a time. The GET is
    sent before this returns, so a missing object (FileNotFoundError) or a store that is down
    (503) is known before a caller answers anything."""
    try:
        result = await obstore.get_async(store(), key(file_id), options={"range": (start, end)})
    except (NotFoundError, FileNotFoundError):  # the local store raises the latter
        raise FileNotFoundError(file_id) from None
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc
    return _blocks(result)


async def _blocks(result: Any) -> AsyncIterator[memoryview]:
    try:
        async for chunk in result.stream(min_chunk_size=READ_BLOCK):
            yield memoryview(chunk)
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc


# --- removing, and the store's health ----------------------------------------------------------


def delete(file_id: str) -> None:
    """Remove the object (none is fine)."""
    try:
        obstore.delete(store(), key(file_id))
    except (NotFoundError, FileNotFoundError):  # the local store raises the latter
        pass
    except (BaseError, OSError) as exc:
        raise unavailable(exc) from exc


def abort_abandoned(older_than_s: float) -> int:
    """Uploads nobody will finish, begun more than ``older_than_s`` ago, removed: an API
    process killed mid-upload, or a store that went down during one, leaves a multipart
    upload whose abort never reached the store (its parts invisible, and billed). On S3 they
    are listed and aborted under our prefix with boto3 (obstore has no call for them); on the
    local directory they are object_store's staging files (``<id>#<n>``). The ops worker runs
    this with the expiry sweep; returns how many went."""
    s = get_settings()
    cutoff = time.time() - older_than_s
    url = s.files_url
    local = _local_dir(url, str(s.storage_dir))
    if local is not None:
        gone = 0
        for staged in Path(local).glob("*#*"):
            with contextlib.suppress(FileNotFoundError):
                if staged.stat().st_mtime < cutoff:
                    staged.unlink()
                    gone += 1
        return gone
    if not url.startswith(("s3://", "s3a://")):
        return 0  # GCS and Azure drop uncommitted parts themselves (after 7 days on Azure)
    import boto3  # only an s3:// store needs it
    from botocore.config import Config

    bucket, _, prefix = url.split("://", 1)[1].partition("/")
    client = boto3.client(
        "s3",
        endpoint_url=s.files_endpoint or None,
        region_name=s.files_region or None,
        # boto3 >= 1.36 adds checksums that several S3-compatible stores refuse; these calls
        # carry no payload, and need none.
        config=Config(
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            retries={"max_attempts": 2},
            connect_timeout=5,
            read_timeout=10,
        ),
    )
    gone = 0
    pages = client.get_paginator("list_multipart_uploads").paginate(
        Bucket=bucket, Prefix=f"{prefix.strip('/')}/" if prefix.strip("/") else ""
    )
    for page in pages:
        for upload in page.get("Uploads", []):
            if upload["Initiated"].timestamp() < cutoff:
                client.abort_multipart_upload(
                    Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                gone += 1
    return gone


PROBE = "inferq-probe"  # a key no file has (file ids start "file_")


def check() -> str | None:
    """Why the store cannot be used, or None: a HEAD of a key that does not exist must
    answer "not found" (a refused credential answers 403, a store that is down not at all)."""
    try:
        obstore.head(store(), PROBE)
    except (NotFoundError, FileNotFoundError):  # the local store raises the latter
        return None
    except (BaseError, OSError) as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return None
