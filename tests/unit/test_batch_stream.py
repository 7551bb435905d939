"""A batch's lines start while its file is read (issue 65; app/batches/validation.py).

In process: the API's routes, the ops worker's own validation (``validation.start``) and
finalization, and, where a line must run, a worker on the SIMULATED engine with the real
dispatcher loop. ``STREAM_LINES`` is made small (and kept: chunks double in size otherwise) so
that a short file is read in several chunks, and the file's reader (``validation.lines``) is
wrapped to act between two chunks: wait until a line has run, cancel the batch, or die as an
ops worker would.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import text, update

from app.batches import finalize, validation
from app.core import db
from app.core.messaging import clients
from app.core.models import Batch
from app.core.settings import Settings
from app.dispatcher.loop import Dispatcher
from tests.support import wait_until
from tests.unit.inprocess import Worker, call, create_batch

CHAT = "/v1/chat/completions"
CHUNK = 2  # lines a chunk commits here
REAL_LINES = validation.lines


def record(core: Settings, custom_id: str, **body: Any) -> bytes:
    request = {"model": core.model_name, "max_tokens": 2, **body}
    request.setdefault("messages", [{"role": "user", "content": f"line {custom_id}"}])
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": request}
    ).encode()


def create(lines: list[bytes]) -> str:
    return create_batch(lines, CHAT)


def jobs_of(batch_id: str) -> list[tuple[str, str, str | None]]:
    """(custom_id, status, error_code) of the batch's jobs, in line order."""
    with db.transaction() as connection:
        rows = connection.execute(
            text(
                "SELECT custom_id, status, error_code FROM jobs WHERE batch_id = :b"
                " ORDER BY batch_line"
            ),
            {"b": batch_id},
        ).all()
    return [(r[0], r[1], r[2]) for r in rows]


def status_of(batch_id: str) -> str:
    return str(call("GET", f"/v1/batches/{batch_id}").json()["status"])


@pytest.fixture
def small_chunks(core: Settings, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setattr(validation, "STREAM_LINES", CHUNK)
    monkeypatch.setattr(validation, "STREAM_LINES_MOST", CHUNK)  # every chunk the same
    return core


def between_chunks(
    monkeypatch: pytest.MonkeyPatch, after_line: int, act: Callable[[], None]
) -> None:
    """Run ``act`` once the reader has handed out line ``after_line`` and is asked for the next
    (the chunk that line closed is committed by then)."""

    def lines(source: Any, limit: int) -> Iterator[tuple[int, bytes | None]]:
        for number, raw in REAL_LINES(source, limit):
            if number == after_line + 1:
                act()
            yield number, raw

    monkeypatch.setattr(validation, "lines", lines)


def test_the_first_lines_run_while_the_rest_of_the_file_is_read(
    small_chunks: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = small_chunks
    stop = threading.Event()
    batch_id = create([record(core, f"r{i}") for i in range(1, 9)])
    seen: dict[str, Any] = {}

    def a_line_has_run() -> None:
        # The reader waits here, after the second chunk, until a worker has ended a line: it
        # can only if that line's job was committed and sent before the file was read through.
        def ended() -> bool:
            return any(status == "succeeded" for _, status, _ in jobs_of(batch_id))

        wait_until(ended, 20, "a line to run while the file is still being read")
        seen["batch"] = status_of(batch_id)

    between_chunks(monkeypatch, 4, a_line_has_run)
    with Worker(core):
        dispatcher = Dispatcher(core, clients.redis_client())
        looping = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
        looping.start()
        try:
            assert validation.start(batch_id) == "in_progress"
            wait_until(lambda: finalize.finalize(batch_id), 20, "the batch to finalize")
        finally:
            stop.set()
            looping.join(10)
    assert seen["batch"] == "validating"  # lines ran before the file was read to its end
    batch = call("GET", f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
    output = call("GET", f"/v1/files/{batch['output_file_id']}/content").content.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in output) == sorted(
        f"r{i}" for i in range(1, 9)
    )


def test_a_bad_line_after_started_chunks_fails_the_batch_and_stops_its_lines(
    small_chunks: Settings,
) -> None:
    core = small_chunks
    lines = [record(core, f"r{i}") for i in range(1, 6)] + [b"{not json"]
    batch_id = create(lines)
    assert validation.start(batch_id) == "failed"  # no worker here: the lines stay queued
    batch = call("GET", f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "failed", batch
    assert [(e["line"], e["code"]) for e in batch["errors"]["data"]] == [(6, "invalid_json")]
    assert batch["output_file_id"] is None
    # Two chunks went in before the bad line was read; their lines are stopped, none runs.
    assert jobs_of(batch_id) == [(f"r{i}", "cancelled", "batch_failed") for i in range(1, 5)]


def test_a_cancel_while_the_file_is_read_stops_what_went_in_and_lets_no_more_in(
    small_chunks: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = small_chunks
    batch_id = create([record(core, f"r{i}") for i in range(1, 9)])

    def cancel() -> None:
        answer = call("POST", f"/v1/batches/{batch_id}/cancel")
        assert answer.status_code == 200 and answer.json()["status"] == "cancelling", answer.text

    between_chunks(monkeypatch, 4, cancel)
    assert validation.start(batch_id) == "cancelled while validating"
    assert jobs_of(batch_id) == [(f"r{i}", "cancelled", "batch_cancelled") for i in range(1, 5)]
    assert finalize.finalize(batch_id)
    assert status_of(batch_id) == "cancelled"


class _Died(Exception):
    """An ops worker killed mid-file (its transaction at hand rolls back, as the server's
    would on a lost connection)."""


@pytest.mark.parametrize("kind", ["chat", "embeddings"])
def test_the_next_ops_worker_goes_on_after_the_last_committed_line(
    small_chunks: Settings, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    core = small_chunks
    stack = contextlib.ExitStack()
    with stack:
        run_twice(core, monkeypatch, kind, stack)


def run_twice(
    core: Settings, monkeypatch: pytest.MonkeyPatch, kind: str, stack: contextlib.ExitStack
) -> None:
    if kind == "chat":
        lines = [record(core, f"r{i}") for i in range(1, 8)]
    else:
        # A worker of the embedding model makes it known (its card); no dispatcher runs here,
        # so the lines stay queued.
        stack.enter_context(Worker(core, model="embedder", task="embed"))
        lines = [
            json.dumps(
                {
                    "custom_id": f"r{i}",
                    "method": "POST",
                    "url": "/v1/embeddings",
                    "body": {"model": "embedder", "input": f"text {i}"},
                }
            ).encode()
            for i in range(1, 8)
        ]
    batch_id = create_batch(lines, CHAT if kind == "chat" else "/v1/embeddings")

    def die() -> None:
        raise _Died

    between_chunks(monkeypatch, 4, die)
    with pytest.raises(_Died):
        validation.start(batch_id)
    assert status_of(batch_id) == "validating"
    monkeypatch.setattr(validation, "lines", REAL_LINES)
    with db.transaction() as connection:  # its lease runs out
        connection.execute(update(Batch).where(Batch.id == batch_id).values(claimed_at=1.0))
    assert validation.start(batch_id) == "in_progress"
    with db.transaction() as connection:
        rows = connection.execute(
            text("SELECT custom_id, lines FROM jobs WHERE batch_id = :b"), {"b": batch_id}
        ).all()
    custom_ids = []
    for custom_id, grouped in rows:  # a grouped job's lines say whose inputs it holds
        grouped = json.loads(grouped) if isinstance(grouped, str) else grouped
        if grouped:
            custom_ids += [entry["custom_id"] for entry in grouped]
        else:
            custom_ids.append(custom_id)
    assert sorted(custom_ids) == sorted(f"r{i}" for i in range(1, 8))  # each line once
    assert call("GET", f"/v1/batches/{batch_id}").json()["request_counts"]["total"] == 7
