"""Files in a real S3-compatible store (SeaweedFS on loopback, bench/objectstore.py): two API
processes and the ops worker share nothing but its URL (each its own data directory, one
PostgreSQL); uploads stream in and are checked on the way, downloads stream out with Range,
a refused or broken upload leaves nothing, wrong credentials are a missing part, a store that
fails says how (access denied, no such bucket, connection refused) and where, and expired
files go (docs/files.md)."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import obstore
import pytest
from obstore.exceptions import PermissionDeniedError
from openai import OpenAI
from sqlalchemy import text

from app.core.errors import DomainError
from app.core.settings import get_settings
from app.core.status_codes import status_of
from app.core.storage import store
from bench.objectstore import BUCKET, Seaweed
from tests.conftest import PostgresDatabases, database_url_for, fresh_redis_url
from tests.support import Proc, Stack, free_port, wait_until

MODEL = "inferq-demo"
MAX_LINES = 500  # INFERQ_BATCH_MAX_LINES here
CHAT: Final = "/v1/chat/completions"


@pytest.fixture(scope="module")
def weed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seaweed]:
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Two:
    """The stack, and its second API process (its own port and data directory)."""

    def __init__(self, stack: Stack, second: str) -> None:
        self.stack = stack
        self.second = second

    def client(self, which: int) -> OpenAI:
        url = self.stack.url if which == 1 else self.second
        return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def two(
    weed: Seaweed, tmp_path_factory: pytest.TempPathFactory, postgres: PostgresDatabases
) -> Iterator[Two]:
    tmp = tmp_path_factory.mktemp("files-s3")
    stack = Stack(
        tmp,
        database_url_for("postgres", tmp, postgres),
        fresh_redis_url(),
        batch_max_lines=MAX_LINES,
        batch_sweep_interval_s=0.3,
        files_sweep_interval_s=0.5,
        files_abandoned_upload_s=5,
        sim_time_scale=0.05,
    )
    stack.env.update(weed.settings())
    try:
        stack.migrate()
        stack.start_api()
        stack.start_ops(data_dir=tmp / "ops-data")
        stack.start_worker(data_dir=tmp / "worker-data")
        port = free_port()
        api2 = stack.spawn(
            "api2", "api", env={"INFERQ_API_PORT": str(port), "INFERQ_DATA_DIR": str(tmp / "api2")}
        )
        second = f"http://127.0.0.1:{port}"
        wait_until(lambda: _up(second, api2), 60, "the second API")
        yield Two(stack, second)
    finally:
        stack.stop()


def _up(url: str, proc: Proc) -> bool:
    assert proc.alive(), proc.tail()
    try:
        return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def chat_line(custom_id: str, max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": custom_id}]}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {**body, "max_tokens": max_tokens},
    }


def local_files(tmp: Path) -> list[Path]:
    """Files any process left on its own disk under a ``files`` directory (there should be
    none: the bytes are in the store)."""
    return [p for p in tmp.rglob("*") if p.is_file() and "files" in p.relative_to(tmp).parts]


def test_a_batch_through_the_store_with_the_sdk(two: Two, weed: Seaweed) -> None:
    one, other = two.client(1), two.client(2)
    lines = [chat_line(f"line-{i}") for i in range(40)]
    upload = one.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    assert upload.bytes == len(jsonl(lines)) and upload.expires_at is not None
    assert upload.id in weed.objects()
    # The other API process reads it back from the store, and starts the batch.
    assert other.files.content(upload.id).content == jsonl(lines)
    batch = other.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")

    def done() -> Any:
        found = one.batches.retrieve(batch.id)
        return found if found.status in ("completed", "failed") else None

    ended = wait_until(done, 120, "the batch to end", every=0.3)
    assert ended.status == "completed", ended
    assert ended.request_counts.completed == 40
    out = other.files.content(ended.output_file_id).text.splitlines()
    assert [json.loads(x)["custom_id"] for x in out] == [f"line-{i}" for i in range(40)]
    assert ended.output_file_id in weed.objects()
    assert local_files(two.stack.tmp) == []


def test_downloads_stream_one_byte_range(two: Two) -> None:
    data = jsonl([chat_line(f"r{i}") for i in range(30)])
    file_id = two.client(1).files.create(file=("r.jsonl", io.BytesIO(data)), purpose="batch").id
    url = f"{two.second}/v1/files/{file_id}/content"
    whole = httpx.get(url)
    assert whole.status_code == 200 and whole.content == data
    assert whole.headers["accept-ranges"] == "bytes"
    part = httpx.get(url, headers={"Range": "bytes=10-99"})
    assert part.status_code == 206 and part.content == data[10:100]
    assert part.headers["content-range"] == f"bytes 10-99/{len(data)}"
    tail = httpx.get(url, headers={"Range": "bytes=-7"})
    assert tail.status_code == 206 and tail.content == data[-7:]
    rest = httpx.get(url, headers={"Range": f"bytes={len(data) - 3}-"})
    assert rest.content == data[-3:]
    past = httpx.get(url, headers={"Range": f"bytes={len(data)}-"})
    assert past.status_code == 416 and past.headers["content-range"] == f"bytes */{len(data)}"
    several = httpx.get(url, headers={"Range": "bytes=0-1,5-6"})
    assert several.status_code == 200 and several.content == data  # ignored, as RFC 9110 allows


def test_a_refused_upload_leaves_no_row_object_or_part(two: Two, weed: Seaweed) -> None:
    before = (two.stack.scalar("SELECT count(*) FROM files"), weed.objects())
    # 12 MB of lines, one too many at the end: two 8 MB parts went to the store before the
    # count ran over, so the multipart upload had begun and must be aborted.
    filler = "x" * 23_000
    lines = [dict(chat_line(f"big-{i}"), note=filler) for i in range(MAX_LINES + 1)]
    answer = httpx.post(
        f"{two.stack.url}/v1/files",
        files={"file": ("big.jsonl", jsonl(lines))},
        data={"purpose": "batch"},
        timeout=60,
    )
    assert answer.status_code == 422, answer.text
    assert answer.json()["error"]["code"] == "too_many_lines"
    assert (two.stack.scalar("SELECT count(*) FROM files"), weed.objects()) == before
    assert weed.multipart_uploads() == []
    # A purpose sent before the file is checked before any byte is stored.
    wrong = httpx.post(
        f"{two.stack.url}/v1/files",
        data={"purpose": "fine-tune"},
        files={"file": ("x.jsonl", b"{}\n")},
    )
    assert wrong.status_code == 422 and wrong.json()["error"]["code"] == "invalid_purpose"
    assert weed.objects() == before[1] and weed.multipart_uploads() == []


def test_expires_after_and_the_sweep(two: Two, weed: Seaweed) -> None:
    client = two.client(1)
    kept = client.files.create(
        file=("k.jsonl", io.BytesIO(b"{}\n")),
        purpose="batch",
        extra_body={"expires_after": {"anchor": "created_at", "seconds": 3600}},
    )
    assert kept.expires_at == kept.created_at + 3600
    with pytest.raises(Exception) as refused:
        client.files.create(
            file=("k.jsonl", io.BytesIO(b"{}\n")),
            purpose="batch",
            extra_body={"expires_after": {"anchor": "created_at", "seconds": 60}},
        )
    assert getattr(refused.value, "status_code", None) == 422
    # Make it due (the shortest OpenAI allows is an hour): the ops worker's sweep deletes the
    # object and the row.
    with two.stack.db().begin() as conn:
        conn.execute(text("UPDATE files SET expires_at = 1 WHERE id = :f"), {"f": kept.id})
    wait_until(lambda: kept.id not in weed.objects(), 30, "the expired object to go")
    wait_until(
        lambda: kept.id not in [f.id for f in client.files.list()], 30, "the expired row to go"
    )


def test_wrong_credentials_are_a_missing_part(two: Two, weed: Seaweed) -> None:
    with pytest.raises(PermissionDeniedError):
        obstore.put(weed.store(secret="wrong"), "x", b"x")
    port = free_port()
    bad = two.stack.spawn(
        "api-bad-secret",
        "api",
        env={"INFERQ_API_PORT": str(port), "AWS_SECRET_ACCESS_KEY": "wrong-secret"},
    )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _up(url, bad), 60, "the API with a wrong secret")
    ready = httpx.get(f"{url}/readyz").json()
    assert ready["status"] == "degraded"
    assert [m["part"] for m in ready["missing"]] == ["files"]
    where = f"s3://{BUCKET}/inferq at {weed.endpoint}"
    assert "file store is unavailable" in ready["missing"][0]["message"]
    assert f"({where}: access denied: " in ready["missing"][0]["message"]
    answer = httpx.post(
        f"{url}/v1/files", data={"purpose": "batch"}, files={"file": ("x.jsonl", b"{}\n")}
    )
    # Still 503 (the request was fine; the deployment lacks a working part), but no
    # Retry-After: the same request fails the same way until a person fixes the credentials.
    assert answer.status_code == 503 and "retry-after" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "file_store_unavailable"
    assert error["message"].startswith(f"the file store {where} is unavailable: access denied")
    assert "AWS_SECRET_ACCESS_KEY" in error["message"]
    # The command reading for itself with the wrong secret, and asking the API that has it.
    for status in (
        two.stack.cli("status", "--no-api", env={"AWS_SECRET_ACCESS_KEY": "wrong-secret"}),
        two.stack.cli("status", env={"INFERQ_API_URL": url}),
    ):
        assert "file store is unavailable" in status.stdout + status.stderr
        assert "access denied" in status.stdout + status.stderr
        assert "wrong-secret" not in status.stdout + status.stderr + bad.tail(400) + answer.text
    assert f"the API at {url}, which read" in status.stdout
    bad.stop()
    # The right secret: ready.
    assert httpx.get(f"{two.stack.url}/readyz").json()["status"] == "ready"


def test_a_missing_bucket_is_named_not_taken_for_a_missing_file(
    weed: Seaweed, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In this process, against the real store: a HEAD cannot tell a missing bucket from a
    missing object (both a bare 404), so the probe lists, and a read's NoSuchBucket is the
    store's failure (503), not "the file's bytes are gone" (404)."""
    for name, value in weed.settings().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("INFERQ_FILES_URL", "s3://no-such-bucket/inferq")
    get_settings.cache_clear()
    try:
        where = f"s3://no-such-bucket/inferq at {weed.endpoint}"
        assert store.check() == f"{where}: no such bucket"
        with pytest.raises(DomainError) as failed:
            asyncio.run(store.open_stream("file_absent", 0, 10))
        assert status_of(failed.value) == 503 and failed.value.retry_after_s is None
        assert failed.value.message == f"the file store {where} is unavailable: no such bucket"
        # The bucket that is there: healthy, and a missing object is only that.
        monkeypatch.setenv("INFERQ_FILES_URL", f"s3://{BUCKET}/inferq")
        get_settings.cache_clear()
        assert store.check() is None
        with pytest.raises(FileNotFoundError):
            asyncio.run(store.open_stream("file_absent", 0, 10))
    finally:
        get_settings.cache_clear()


# --- the store stopped (these run last: they stop and start the module's server) -------------


def test_the_store_stopped_mid_upload(two: Two, weed: Seaweed) -> None:
    before = (two.stack.scalar("SELECT count(*) FROM files"), weed.objects())
    # ~1 MB of ten lines (400 lines in all: under the module's limit of 500)
    block = (json.dumps(dict(chat_line("s"), note="y" * 100_000)) + "\n").encode() * 10

    boundary = "inferq-test-boundary"

    def body() -> Iterator[bytes]:  # multipart, sent as it is made (chunked)
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="s.jsonl"'
            "\r\n\r\n"
        ).encode()
        for i in range(40):
            if i == 20:  # two parts of 8 MB are in the store by now
                weed.stop()
            yield block
        yield f"\r\n--{boundary}--\r\n".encode()

    answer = httpx.post(
        f"{two.stack.url}/v1/files",
        content=body(),
        headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        timeout=120,
    )
    assert answer.status_code == 503, answer.text
    error = answer.json()["error"]
    assert error["code"] == "file_store_unavailable"
    where = f"s3://{BUCKET}/inferq at {weed.endpoint}"
    assert error["message"] == f"the file store {where} is unavailable: connection refused"
    assert "retry-after" in answer.headers
    ready = httpx.get(f"{two.stack.url}/readyz").json()
    assert ready["status"] == "degraded" and [m["part"] for m in ready["missing"]] == ["files"]
    assert f"({where}: connection refused)" in ready["missing"][0]["message"]
    weed.start()
    assert (two.stack.scalar("SELECT count(*) FROM files"), weed.objects()) == before
    # Its abort could not reach a stopped store, so its parts stayed there: the ops worker
    # aborts an upload left older than INFERQ_FILES_ABANDONED_UPLOAD_S (5 s here).
    wait_until(lambda: weed.multipart_uploads() == [], 60, "the abandoned upload to be aborted")


def test_the_store_stopped_before_finalize(two: Two, weed: Seaweed) -> None:
    client = two.client(1)
    lines = [chat_line(f"f{i}", max_tokens=32) for i in range(60)]
    upload = client.files.create(file=("f.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    wait_until(lambda: client.batches.retrieve(batch.id).status == "in_progress", 60, "in progress")
    weed.stop()
    try:
        # Every line ends while the store is down: the output cannot be written.
        wait_until(
            lambda: (
                two.stack.scalar(
                    "SELECT count(*) FROM jobs WHERE batch_id = :b AND finished_at IS NULL",
                    b=batch.id,
                )
                == 0
            ),
            120,
            "the batch's jobs to end",
        )
        assert client.batches.retrieve(batch.id).status in ("in_progress", "finalizing")
    finally:
        weed.start()

    def done() -> Any:
        found = client.batches.retrieve(batch.id)
        return found if found.status == "completed" else None

    ended = wait_until(done, 120, "the batch to complete once the store is back", every=0.3)
    out = [
        json.loads(x)["custom_id"]
        for x in client.files.content(ended.output_file_id).text.splitlines()
    ]
    assert out == [f"f{i}" for i in range(60)]  # each line once, in order
