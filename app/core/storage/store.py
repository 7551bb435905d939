"""Where the bytes of files live (batch inputs and outputs): one object store, named by a URL.

The ``files`` table holds what a file is (owner, purpose, size, expiry, and which store holds
it: :func:`describe`); this module holds its bytes, one object per file id, in the store
``INFERQ_FILES_URL`` names (docs/files.md): ``file:///dir`` (the default: ``INFERQ_FILES_DIR``,
else ``data_dir/files``, for one host), ``s3://bucket/prefix`` (AWS S3 and S3-compatible
stores, with ``INFERQ_FILES_ENDPOINT`` and ``INFERQ_FILES_REGION``), ``gs://bucket/prefix``,
``az://container/prefix``, and ``memory:///``. obstore (Apache Arrow's ``object_store``) speaks
to all of them with one API; credentials come from each cloud's own environment
(``AWS_ACCESS_KEY_ID``, IRSA's web identity token, GKE's workload identity, ...), never from
inferq's settings, so nothing here can print them.

Every write is all or nothing: a writer that ends with an error aborts its multipart upload
(S3 drops the parts; the local store deletes its staging file), and an object appears only
when its writer completes. Everything streams in parts: a 200 MB file never sits in memory.

A store that fails is a 503 that says what failed and where (:func:`unavailable`): connection
refused, timed out, access denied, no such bucket, no credentials found, with the store's
name and host and never the library's own text, which can hold a signed URL or the store's
answer.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import time
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import obstore
from obstore.exceptions import (
    BaseError,
    NotFoundError,
    PermissionDeniedError,
    UnauthenticatedError,
)
from obstore.store import LocalStore, from_url

from app.core.errors import DomainError, Kind
from app.core.settings import Settings, get_settings

if TYPE_CHECKING:
    from obstore import WritableFile
    from obstore.store import ObjectStore

PART = 8 << 20  # bytes per part of an upload (S3's smallest part is 5 MiB)
READ_BLOCK = 1 << 20  # bytes per read from the store, and per chunk sent to a client
RETRY_AFTER_S = 5
# A whole transfer: a download streamed to a slow client keeps its GET open.
TRANSFER_TIMEOUT_S = 3600.0
# A request with no body to stream (HEAD, DELETE, the health probe): a store that accepts the
# connection and never answers is "timed out" within seconds, not after the transfers' hour.
CALL_TIMEOUT_S = 10.0

# Where an s3:// store's credentials are read from, in the order obstore (object_store) tries
# them: environment variables (never inferq settings), then the instance profile.
AWS_CREDENTIAL_SOURCES = (
    "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN (IRSA)",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI or _FULL_URI (ECS, EKS Pod Identity)",
    "on AWS, the instance profile (the instance metadata service)",
)


class NoCredentials(Exception):
    """An s3:// store at an S3-compatible endpoint with no credentials in the environment:
    found before any request is sent (object_store would ask AWS's instance metadata service,
    which such a store cannot use)."""


# --- what the store is, and what went wrong ----------------------------------------------------


def describe(settings: Settings) -> str:
    """The configured store in one line, without credentials: ``s3://bucket/prefix at
    http://127.0.0.1:8333``, ``s3://bucket/prefix (AWS S3)``, ``gs://bucket/prefix``, ``local
    directory /abs/dir``, ``memory:///``. The files table records it for each file (which store
    holds its bytes), so its form stays as it is."""
    url = settings.files_url
    local = _local_dir(url, str(settings.storage_dir))
    if local is not None:
        return f"local directory {Path(local).resolve()}"
    parts = urlsplit(url)
    scheme = "s3" if parts.scheme == "s3a" else parts.scheme
    if scheme == "memory":
        return "memory:///"
    # A password in the URL (user:secret@host) or a signed query (an Azure SAS token) never
    # leaves here; a user part alone (abfss://container@account...) names a place.
    user, at, host = parts.netloc.rpartition("@")
    netloc = host if at and ":" in user else parts.netloc
    path = parts.path.strip("/")
    name = f"{scheme}://{netloc}/{path}" if path else f"{scheme}://{netloc}"
    if scheme != "s3":
        return name
    endpoint = _endpoint(settings)
    return f"{name} at {endpoint}" if endpoint else f"{name} (AWS S3)"


def _endpoint(settings: Settings) -> str:
    """An s3:// store's endpoint as a host to name: scheme, host, port (no credentials)."""
    raw = settings.files_endpoint or os.environ.get("AWS_ENDPOINT_URL") or ""
    raw = raw or os.environ.get("AWS_ENDPOINT") or ""
    if not raw:
        return ""
    parts = urlsplit(raw)
    host = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{host}{parts.path.rstrip('/')}" if parts.scheme else host


def _missing_credentials(settings: Settings) -> bool:
    """An s3:// store at an endpoint that is not AWS, and no credentials in the environment:
    object_store would end its search at AWS's instance metadata service, which only AWS's
    own S3 honours, and report that service's answer (a 403, a timeout) as if the store had
    failed."""
    if not settings.files_url.startswith(("s3://", "s3a://")):
        return False
    host = urlsplit(_endpoint(settings)).hostname or ""
    if (
        not host
        or host == "amazonaws.com"
        or host.endswith((".amazonaws.com", ".amazonaws.com.cn"))
    ):
        return False  # AWS: the instance profile is a source too

    def given(*names: str) -> bool:
        return all(os.environ.get(name) for name in names)

    return not (
        given("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        or given("AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN")
        or given("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        or given("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        or os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("true", "1")
    )


_METADATA = re.compile(r"(https?://[^/\s]+)/latest/(api/token|meta-data)")
_STATUS = re.compile(r"status code: (\d{3}[^:]*)")


def _no_credentials(asked: str) -> str:
    *first, last = AWS_CREDENTIAL_SOURCES
    return (
        f"no credentials found ({asked}); they are read from {', '.join(first)}, or {last} "
        '(docs/files.md, "Credentials")'
    )


def reason(exc: BaseException) -> tuple[str, bool]:
    """What went wrong, in a few words, and whether a person must act (True: access denied,
    no such bucket, no credentials) or trying again may do (False: refused, timed out).
    Built from the kind of failure only: the library's text can hold a signed URL or the
    store's answer, so none of it is repeated beyond a status line."""
    if isinstance(exc, NoCredentials):
        # Found before any request (_missing_credentials).
        return _no_credentials("none in the environment; nothing was sent"), True
    text = str(exc)
    metadata = _METADATA.search(text)
    if metadata is not None:
        # object_store asks the instance metadata service last, and reports its failure as
        # the store's.
        return _no_credentials(
            f"none in the environment, and the instance metadata service at "
            f"{metadata.group(1)} gave none: {_transport(text) or 'it failed'}"
        ), True
    if "NoSuchBucket" in text:
        return "no such bucket", True
    if isinstance(exc, PermissionDeniedError | UnauthenticatedError) or re.search(
        r"status code: 40[13]\b", text
    ):
        return (
            "access denied: the store refused the credentials (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or the role's) or they lack a permission on the bucket",
            True,
        )
    transport = _transport(text)
    if transport is not None:
        return transport, False
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower(), isinstance(exc, PermissionError)
    return type(exc).__name__, False


def _transport(text: str) -> str | None:
    if "ConnectionRefused" in text or "Connection refused" in text:
        return "connection refused"
    if "kind: Timeout" in text or "TimedOut" in text:
        return "timed out"
    if "dns error" in text or "failed to lookup address" in text:
        return "host not found"
    status = _STATUS.search(text)
    if status is not None:
        return f"it answered {status.group(1).strip()}"
    return None


def unavailable(exc: BaseException) -> DomainError:
    """The store failed: a 503 that names the store and the kind of failure. One that may
    pass (refused, timed out) says when to try again; one a person must fix (access denied,
    no such bucket, no credentials) does not invite retries (docs/files.md)."""
    why, lasting = reason(exc)
    return DomainError(
        Kind.UNAVAILABLE,
        "file_store_unavailable",
        f"the file store {describe(get_settings())} is unavailable: {why}",
        retry_after_s=None if lasting else RETRY_AFTER_S,
    )


# What a store's failure can be raised as: obstore's errors, OSError (obstore raises some as
# FileNotFoundError, PermissionError, TimeoutError), and credentials found missing here.
FAILURES = (BaseError, OSError, NoCredentials)


# --- the store ---------------------------------------------------------------------------------


def store() -> ObjectStore:
    """This process's store, as the settings name it, for transfers (uploads, downloads)."""
    return _configured(TRANSFER_TIMEOUT_S)


def _calls() -> ObjectStore:
    """The same store, for requests with no body to stream (HEAD, DELETE, the probe)."""
    return _configured(CALL_TIMEOUT_S)


def _configured(timeout_s: float) -> ObjectStore:
    s = get_settings()
    if _missing_credentials(s):
        raise NoCredentials(describe(s))
    # The store reads its credentials from the environment when it is made: the AWS_
    # variables are part of what it is, so a process whose environment changes (a test)
    # gets a store that follows.
    aws = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_")))
    return _open(s.files_url, str(s.storage_dir), s.files_endpoint, s.files_region, timeout_s, aws)


def _local_dir(url: str, storage_dir: str) -> str | None:
    """The directory of a local store (an empty URL: ``storage_dir``), None for a remote one."""
    if not url:
        return storage_dir
    return url.removeprefix("file://") if url.startswith("file://") else None


@lru_cache(maxsize=8)
def _open(
    url: str,
    directory: str,
    endpoint: str,
    region: str,
    timeout_s: float,
    _aws: tuple[tuple[str, str], ...],
) -> ObjectStore:
    local = _local_dir(url, directory)
    if local is not None:
        return LocalStore(local, mkdir=True)
    config: dict[str, Any] = {}
    client: dict[str, Any] = {
        "connect_timeout": timedelta(seconds=5),
        "timeout": timedelta(seconds=timeout_s),
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


def _bucket_missing(exc: BaseException) -> bool:
    """A "not found" that is about the bucket, not the object (S3's NoSuchBucket)."""
    return "NoSuchBucket" in str(exc)


def _missing(exc: BaseException, file_id: str) -> Exception:
    """What a "not found" from the store means: the object is gone (FileNotFoundError), or
    the whole bucket is (the store's failure, a 503)."""
    return unavailable(exc) if _bucket_missing(exc) else FileNotFoundError(file_id)


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
        except FAILURES as exc:
            raise unavailable(exc) from exc
        self.size += written
        return written


@contextlib.contextmanager
def writer(file_id: str) -> Iterator[_Writer]:
    """Write the object of ``file_id``; it appears only if the block ends without an error
    (an error aborts the upload: no object, no parts)."""
    try:
        out = obstore.open_writer(store(), key(file_id), buffer_size=PART)
    except FAILURES as exc:
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
    except FAILURES as exc:
        raise unavailable(exc) from exc


async def put(file_id: str, parts: AsyncIterator[bytes]) -> None:
    """Stream ``parts`` into the object of ``file_id`` (a multipart upload). An exception from
    ``parts`` aborts the upload and is raised again as it was; a store that fails is a 503."""
    try:
        await obstore.put_async(store(), key(file_id), parts, chunk_size=PART, max_concurrency=4)
    except FAILURES as exc:
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
        except FAILURES as exc:
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
    except (NotFoundError, FileNotFoundError) as exc:  # the local store raises the latter
        raise _missing(exc, file_id) from None
    except FAILURES as exc:
        raise unavailable(exc) from exc
    return io.BufferedReader(_Raw(source), buffer_size=READ_BLOCK)


def size(file_id: str) -> int:
    """The object's size; FileNotFoundError if there is none."""
    try:
        return int(obstore.head(_calls(), key(file_id))["size"])
    except (NotFoundError, FileNotFoundError) as exc:  # the local store raises the latter
        raise _missing(exc, file_id) from None
    except FAILURES as exc:
        raise unavailable(exc) from exc


async def open_stream(file_id: str, start: int, end: int) -> AsyncIterator[memoryview]:
    """Bytes ``start`` to ``end`` (exclusive) of the object, a block at a time. The GET is
    sent before this returns, so a missing object (FileNotFoundError) or a store that is down
    (503) is known before a caller answers anything."""
    try:
        result = await obstore.get_async(store(), key(file_id), options={"range": (start, end)})
    except (NotFoundError, FileNotFoundError) as exc:  # the local store raises the latter
        raise _missing(exc, file_id) from None
    except FAILURES as exc:
        raise unavailable(exc) from exc
    return _blocks(result)


async def _blocks(result: Any) -> AsyncIterator[memoryview]:
    try:
        async for chunk in result.stream(min_chunk_size=READ_BLOCK):
            yield memoryview(chunk)
    except FAILURES as exc:
        raise unavailable(exc) from exc


# --- removing, and the store's health ----------------------------------------------------------


def delete(file_id: str) -> None:
    """Remove the object (none is fine)."""
    try:
        obstore.delete(_calls(), key(file_id))
    except (NotFoundError, FileNotFoundError) as exc:  # the local store raises the latter
        if _bucket_missing(exc):
            raise unavailable(exc) from exc
    except FAILURES as exc:
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


PROBE = "inferq-probe"  # a prefix no file has (file ids start "file_")


def check() -> str | None:
    """Why the store cannot be used (its name and the kind of failure), or None. It lists a
    prefix no file has: an empty answer is healthy; a refused credential answers 403, a
    missing bucket NoSuchBucket, a store that is down not at all. (A HEAD of a missing key
    cannot tell a missing bucket from a missing object: both are a bare 404.)"""
    try:
        next(iter(obstore.list(_calls(), prefix=PROBE, chunk_size=1)), None)
    except (NotFoundError, FileNotFoundError) as exc:
        if _bucket_missing(exc):
            return f"{describe(get_settings())}: {reason(exc)[0]}"
    except FAILURES as exc:
        return f"{describe(get_settings())}: {reason(exc)[0]}"
    return None
