"""The parts of files that need no object store server: the upload's counter (its limits
across chunk boundaries), the one byte range a download serves, expires_after, the store's
all-or-nothing writes on the local directory, what an answer says when an s3:// store cannot
be used (a refused connection, a store that never answers, no credentials: each on a loopback
socket of the test's own, nothing sent beyond it), the store's one-line name, and files whose
bytes stay in the store used before INFERQ_FILES_URL was switched (docs/files.md). Access
denied and a missing bucket need a real store: tests/integration/test_files_s3.py."""

from __future__ import annotations

import asyncio
import http.server
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text

from app.api.downloads import Unsatisfiable, span
from app.core.db import session_scope
from app.core.errors import DomainError
from app.core.settings import Settings
from app.core.storage import files, store
from tests.unit.conftest import environment
from tests.unit.inprocess import call


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


# --- the store's name ---------------------------------------------------------------------------


def test_the_store_is_named_in_one_line_without_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    cases = {
        (f"file://{tmp_path}/files/", ""): f"local directory {tmp_path}/files",
        ("s3://inferq-files/inferq/", "http://127.0.0.1:8333/"): (
            "s3://inferq-files/inferq at http://127.0.0.1:8333"
        ),
        ("s3a://bucket", ""): "s3://bucket (AWS S3)",
        ("s3://bucket/p", "https://key:secret@minio.example:9000"): (
            "s3://bucket/p at https://minio.example:9000"
        ),
        ("gs://bucket/prefix", ""): "gs://bucket/prefix",
        ("https://account.blob.core.windows.net/c/p?sv=2024&sig=SECRET", ""): (
            "https://account.blob.core.windows.net/c/p"
        ),
        ("s3://user:secret@bucket/p", ""): "s3://bucket/p (AWS S3)",
        ("memory:///", ""): "memory:///",
    }
    for (url, endpoint), expected in cases.items():
        with environment(files_url=url, files_endpoint=endpoint) as settings:
            assert store.describe(settings) == expected
    # Empty: the data directory's files/, as an absolute path.
    monkeypatch.chdir(tmp_path)
    with environment(files_url="", data_dir=".inferq") as settings:
        assert store.describe(settings) == f"local directory {tmp_path}/.inferq/files"


# --- an s3:// store that cannot be used, on loopback sockets of the test's own -----------------


def _no_aws_environment(monkeypatch: pytest.MonkeyPatch, metadata: str) -> None:
    """Nothing of this machine's own AWS setup, and the instance metadata service (the
    credential chain's last source) at ``metadata`` on loopback: whatever the code under test
    does, nothing goes to 169.254.169.254."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", metadata)


@pytest.fixture
def refusing() -> Iterator[str]:
    """An endpoint on loopback that refuses connections: a port bound and never listened on
    (no other process can take it while the test runs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent() -> Iterator[tuple[str, list[socket.socket]]]:
    """An endpoint on loopback that accepts connections and never answers; the list holds
    every connection it took."""
    taken: list[socket.socket] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        server.settimeout(0.2)
        done = threading.Event()

        def accept() -> None:
            while not done.is_set():
                try:
                    taken.append(server.accept()[0])
                except TimeoutError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{server.getsockname()[1]}", taken
        done.set()
        thread.join(2)
        for conn in taken:
            conn.close()


def _s3(core: Settings, endpoint: str, **more: str) -> Any:
    return environment(
        files_url="s3://inferq-files/inferq",
        files_endpoint=endpoint,
        files_region="us-east-1",
        data_dir=str(core.data_dir),
        **more,
    )


def _upload() -> Any:
    return call(
        "POST", "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", b"{}\n")}
    )


def _files() -> int:
    with session_scope() as session:
        return int(session.execute(text("SELECT count(*) FROM files")).scalar_one())


def test_a_store_that_refuses_connections_is_named_with_its_host(
    core: Settings, refusing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_aws_environment(monkeypatch, refusing)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "inferq-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "a-secret-never-shown")
    with _s3(core, refusing):
        where = f"s3://inferq-files/inferq at {refusing}"
        assert store.check() == f"{where}: connection refused"
        answer = _upload()
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["code"] == "file_store_unavailable"
        assert error["message"] == f"the file store {where} is unavailable: connection refused"
        # An outage may pass: the client is told when to try again.
        assert answer.headers["retry-after"] == str(store.RETRY_AFTER_S)
        assert "a-secret-never-shown" not in answer.text
        assert _files() == 0


def test_a_store_that_never_answers_has_timed_out_within_seconds(
    core: Settings,
    silent: tuple[str, list[socket.socket]],
    refusing: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint, taken = silent
    _no_aws_environment(monkeypatch, refusing)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "inferq-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "inferq-test-secret")
    # The bound of a request with no body to stream (10 s), made short for the test.
    monkeypatch.setattr(store, "CALL_TIMEOUT_S", 0.3)
    with _s3(core, endpoint):
        started = time.monotonic()
        assert store.check() == f"s3://inferq-files/inferq at {endpoint}: timed out"
        assert time.monotonic() - started < 5  # three tries of 0.3 s, and their backoff
        assert taken, "the store was never reached"
        files.add_upload("default", "file_kept", "k.jsonl", "batch", 3, 3600)
        answer = call("DELETE", "/v1/files/file_kept")
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["message"].endswith("is unavailable: timed out")
        assert answer.headers["retry-after"] == str(store.RETRY_AFTER_S)
        assert _files() == 1  # the row stays while its object cannot be deleted


def test_no_credentials_is_said_before_anything_is_sent(
    core: Settings,
    silent: tuple[str, list[socket.socket]],
    refusing: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An S3-compatible store and no credentials: object_store would end its search at AWS's
    instance metadata service (169.254.169.254) and report its answer as the store's."""
    endpoint, taken = silent
    _no_aws_environment(monkeypatch, refusing)
    with _s3(core, endpoint):
        reason = store.check()
        assert reason is not None
        assert reason.startswith(f"s3://inferq-files/inferq at {endpoint}: no credentials found")
        assert "nothing was sent" in reason  # not even to the metadata service
        for source in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_WEB_IDENTITY_TOKEN_FILE"):
            assert source in reason
        answer = _upload()
        assert answer.status_code == 503, answer.text
        message = answer.json()["error"]["message"]
        assert "is unavailable: no credentials found" in message and "AWS_ROLE_ARN" in message
        # A person must act: no Retry-After to invite the same request again in 5 s.
        assert "retry-after" not in answer.headers
        assert _files() == 0
    time.sleep(0.3)  # the accept loop's turn
    assert taken == [], "a request was sent"


class _MetadataService(http.server.BaseHTTPRequestHandler):
    """AWS's instance metadata service as a host that is not an EC2 instance sees it: the
    token request refused (the issue's ``PUT http://169.254.169.254/latest/api/token ...
    403``), here on loopback."""

    seen: list[str] = []

    def do_PUT(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(403)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT

    def log_message(self, *_: Any) -> None:
        pass


def test_no_credentials_on_aws_says_what_the_metadata_service_answered(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWS's own S3 (no endpoint): the instance profile is the last source, so the chain asks
    the metadata service, here one on loopback (AWS_METADATA_ENDPOINT); it gives none, and no
    request to S3 follows."""
    service = http.server.HTTPServer(("127.0.0.1", 0), _MetadataService)
    threading.Thread(target=service.serve_forever, daemon=True).start()
    metadata = f"http://127.0.0.1:{service.server_port}"
    _no_aws_environment(monkeypatch, metadata)
    _MetadataService.seen = []
    try:
        with _s3(core, ""):
            reason = store.check()
            assert reason is not None
            assert reason.startswith("s3://inferq-files/inferq (AWS S3): no credentials found")
            assert f"the instance metadata service at {metadata} gave none" in reason
            assert "403 Forbidden" in reason and "AWS_ACCESS_KEY_ID" in reason
            answer = _upload()
            assert answer.status_code == 503 and "retry-after" not in answer.headers
            assert "is unavailable: no credentials found" in answer.json()["error"]["message"]
    finally:
        service.shutdown()
        service.server_close()
    assert "PUT /latest/api/token" in _MetadataService.seen


# --- a switched store ---------------------------------------------------------------------------


def test_files_in_the_store_used_before_a_switch_are_marked_and_kept(
    core: Settings, tmp_path: Path
) -> None:
    before, after = tmp_path / "before", tmp_path / "after"
    first = f"local directory {before}"
    with environment(files_url=f"file://{before}"):
        old = _upload().json()
        assert (old["store"], old["store_current"]) == (first, True)
    with session_scope() as session:  # a row stored before the store was recorded
        session.execute(text("UPDATE files SET store = NULL WHERE id = :f"), {"f": old["id"]})
        session.commit()
    with environment(files_url=f"file://{before}"):
        untold = _upload().json()["id"]
    with environment(files_url=f"file://{after}"):
        listed = {f["id"]: f for f in call("GET", "/v1/files").json()["data"]}
        assert listed[old["id"]]["store_current"] is True  # unknown: taken to be here
        assert (listed[untold]["store"], listed[untold]["store_current"]) == (first, False)
        assert call("GET", f"/v1/files/{untold}").json()["store_current"] is False
        # Its content is not "gone": it is in the other store, which the answer names.
        answer = call("GET", f"/v1/files/{untold}/content")
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "file_in_other_store"
        assert f"in the file store {first}, not in the current one" in error["message"]
        assert f"local directory {after}" in error["message"]
        # Deleting it here would leave its object there with no row: refused, both kept.
        refused = call("DELETE", f"/v1/files/{untold}")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "file_in_other_store"
        # A batch over it could not read its lines: refused, and no batch is made.
        body = {"input_file_id": untold, "endpoint": "/v1/chat/completions"}
        refused = call("POST", "/v1/batches", json={**body, "completion_window": "24h"})
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["param"] == "input_file_id"
        assert "cannot start a batch on file" in refused.json()["error"]["message"]
        assert call("GET", "/v1/batches").json()["data"] == []
        # Expired, it waits for a process of its own store too.
        with session_scope() as session:
            session.execute(text("UPDATE files SET expires_at = 1 WHERE id = :f"), {"f": untold})
            session.commit()
        assert files.delete_expired() == 0
        new = _upload().json()
        assert (new["store"], new["store_current"]) == (f"local directory {after}", True)
        assert call("GET", f"/v1/files/{new['id']}/content").content == b"{}\n"
    assert (before / untold).exists() and _files() == 3
    # Back on its store, it is read and deleted as any other.
    with environment(files_url=f"file://{before}"):
        assert call("GET", f"/v1/files/{untold}/content").content == b"{}\n"
        assert files.delete_expired() == 1
        assert not (before / untold).exists()
