"""Any valid text, NUL included, is stored and returned byte for byte on SQLite and PostgreSQL
(issue 64; docs/architecture.md, "Any valid text is stored"), through the real API, worker and
ops worker: jobs, the OpenAI calls, batches, files, stored responses and webhooks. A lone
surrogate is still refused, and so are bytes that are not UTF-8.

PostgreSQL's text and jsonb refuse NUL: there the store escapes it with U+FFFF, so every text
here also carries U+FFFF, and U+FFFF followed by "0" (how an escaped NUL looks)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from app.core import db
from app.core.models import File, Job, StoredResponse, pg_json_dumps, pg_json_loads
from app.core.settings import DEMO_MODEL_NAME, get_settings
from tests.conftest import PostgresDatabases, backend_stack_for
from tests.support import Receiver, Stack, wait_for_job, wait_until

# NUL, the escape character alone, an escaped NUL's look, and both after a backslash (JSON).
ODD = "a\x00b \uffff c\uffff0d \\\x00 \\u0000 \x00\x00"
MODEL = DEMO_MODEL_NAME


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres: PostgresDatabases,
) -> Iterator[Stack]:
    with backend_stack_for(
        request,
        tmp_path_factory,
        postgres,
        "anytext",
        ops=True,
        sim_time_scale=0,
        batch_sweep_interval_s=0.3,
        webhook_allow_private="true",
        webhook_sweep_interval_s=0.3,
    ) as s:
        yield s


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with stack.client() as c:
        yield c


def row(stack: Stack, model: type[Any], row_id: str) -> Any:
    """A row as the app reads it (its column types and, on PostgreSQL, its JSON functions)."""
    options: dict[str, Any] = {}
    if stack.database_url.startswith("postgresql"):
        options = {"json_serializer": pg_json_dumps, "json_deserializer": pg_json_loads}
    engine = create_engine(stack.database_url, **options)
    try:
        with Session(engine) as session:
            found = session.get(model, row_id)
            assert found is not None
            session.expunge(found)
            return found
    finally:
        engine.dispose()


def test_a_job_keeps_nul_in_its_prompt_metadata_and_user(
    stack: Stack, client: httpx.Client
) -> None:
    body = {"prompt": ODD, "metadata": {ODD: ODD}, "user": ODD, "params": {"max_tokens": 2}}
    made = client.post("/v1/jobs", json=body)
    assert made.status_code in (200, 201, 202), made.text
    job_id = made.json()["id"]
    done = wait_for_job(client, job_id, 30, {"succeeded", "failed"}, stack.procs)
    assert done["status"] == "succeeded", done
    again = client.get(f"/v1/jobs/{job_id}").json()
    assert again["metadata"] == {ODD: ODD} and again["user"] == ODD
    stored = row(stack, Job, job_id)
    assert stored.prompt == ODD and stored.meta == {ODD: ODD} and stored.end_user == ODD


def test_chat_and_completions_keep_nul_in_messages_and_prompt(
    stack: Stack, client: httpx.Client
) -> None:
    messages = [{"role": "system", "content": ODD}, {"role": "user", "content": ODD}]
    chat = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 2, "user": ODD},
    )
    assert chat.status_code == 200, chat.text
    stored = row(stack, Job, chat.headers["inferq-job-id"])
    assert [m["content"] for m in stored.messages] == [ODD, ODD] and stored.end_user == ODD
    completion = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": ODD, "max_tokens": 2}
    )
    assert completion.status_code == 200, completion.text
    assert row(stack, Job, completion.headers["inferq-job-id"]).prompt == ODD


def test_a_batch_line_keeps_nul_in_its_custom_id_and_prompt(
    stack: Stack, client: httpx.Client
) -> None:
    line = {
        "custom_id": ODD,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": ODD}], "max_tokens": 2},
    }
    data = json.dumps(line).encode() + b"\n"
    upload = client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert upload.status_code == 200, upload.text
    made = client.post(
        "/v1/batches",
        json={
            "input_file_id": upload.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            "metadata": {"k": ODD},
        },
    )
    assert made.status_code == 200, made.text

    def ended() -> dict[str, Any] | None:
        batch = client.get(f"/v1/batches/{made.json()['id']}").json()
        return batch if batch["status"] in ("completed", "failed") else None

    batch = wait_until(ended, 60, "the batch to end", every=0.2)
    assert batch["status"] == "completed", batch
    assert batch["metadata"] == {"k": ODD}
    output = client.get(f"/v1/files/{batch['output_file_id']}/content").content
    [result] = [json.loads(x) for x in output.splitlines()]
    assert result["custom_id"] == ODD and result["error"] is None
    stored = row(stack, Job, result["response"]["request_id"])
    assert stored.custom_id == ODD and stored.messages[0]["content"] == ODD


def test_a_file_keeps_its_nul_bytes_and_a_name_with_nul(stack: Stack, client: httpx.Client) -> None:
    data = b'\x00\xff{"a": "\\u0000"}\x00\n' + ODD.encode()
    name = "in\uffff0\x00.jsonl"
    # Written by hand: httpx would send the NUL of the name as %00 (HTML's form encoding).
    boundary = secrets.token_hex(8)
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{name}"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    upload = client.post(
        "/v1/files",
        content=form,
        headers={"content-type": f"multipart/form-data; boundary={boundary}"},
    )
    assert upload.status_code == 200, upload.text
    file_id = upload.json()["id"]
    assert client.get(f"/v1/files/{file_id}/content").content == data
    assert client.get(f"/v1/files/{file_id}").json()["filename"] == name
    assert row(stack, File, file_id).filename == name


def test_a_stored_response_keeps_nul_in_its_input_and_instructions(
    stack: Stack, client: httpx.Client
) -> None:
    made = client.post(
        "/v1/responses",
        json={"model": MODEL, "input": ODD, "instructions": ODD, "max_output_tokens": 2},
    )
    assert made.status_code == 200, made.text
    response = made.json()
    assert response["instructions"] == ODD
    again = client.get(f"/v1/responses/{response['id']}").json()
    assert again["instructions"] == ODD
    items = client.get(f"/v1/responses/{response['id']}/input_items").json()["data"]
    assert [part["text"] for item in items for part in item["content"]] == [ODD]
    follow = client.post(
        "/v1/responses",
        json={
            "model": MODEL,
            "input": ODD,
            "previous_response_id": response["id"],
            "max_output_tokens": 2,
        },
    )
    assert follow.status_code == 200, follow.text
    job = row(stack, Job, "job_" + follow.json()["id"].removeprefix("resp_"))
    contents = [m["content"] for m in job.messages]
    assert contents[0] == ODD and contents[-1] == ODD
    assert (
        json.loads(row(stack, StoredResponse, response["id"]).input)[0]["content"][0]["text"] == ODD
    )


def test_a_webhook_carries_nul_in_the_jobs_metadata(
    stack: Stack, client: httpx.Client, receiver: Receiver
) -> None:
    path = f"/nul/{secrets.token_hex(4)}"  # the receiver outlives one database's stack
    made = client.post(
        "/v1/jobs",
        json={
            "prompt": "x",
            "params": {"max_tokens": 1},
            "metadata": {"k": ODD},
            "webhook_url": receiver.url(path),
        },
    )
    assert made.status_code in (200, 201, 202), made.text
    wait_until(lambda: receiver.received(path), 30, "the job's webhook")
    [request] = receiver.received(path)
    event = json.loads(request["body"])
    assert event["data"]["metadata"] == {"k": ODD}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "lone \\ud800 surrogate"}', "prompt"),
        (b'{"prompt": "x", "metadata": {"k": "\\udfff"}}', "metadata"),
    ],
)
def test_a_lone_surrogate_is_still_refused_clearly(
    client: httpx.Client, body: bytes, param: str
) -> None:
    answer = client.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and "valid Unicode" in error["message"]
    assert "surrogate" in error["message"]


def test_bytes_that_are_not_utf8_are_a_400(client: httpx.Client) -> None:
    for path in ("/v1/jobs", "/v1/completions", "/v1/chat/completions"):
        answer = client.post(
            path, content=b'{"prompt": "\xff\xfe"}', headers={"content-type": "application/json"}
        )
        assert answer.status_code == 400, (path, answer.text)
        assert answer.json()["error"]["code"] == "invalid_json"
        assert "UTF-8" in answer.json()["error"]["message"]


def downgrade(revision: str) -> None:
    from importlib.resources import files

    from alembic import command
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(files("migrations")))
    command.downgrade(config, revision)


def test_rows_with_uffff_written_before_escaping_read_back_unchanged(
    postgres: PostgresDatabases, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Migration 0013 doubles the U+FFFF of rows written before it; its downgrade is refused
    while a row holds NUL and otherwise gives the rows back as they were."""
    url = postgres.create()
    monkeypatch.setenv("INFERQ_DATABASE_URL", url)
    get_settings.cache_clear()
    db.dispose()
    old = "x\uffff0y\uffff\uffffz\uffff"
    plain = create_engine(url)
    try:
        db.migrate("0012")
        with plain.begin() as c:
            c.execute(
                text(
                    "INSERT INTO jobs (id, tenant, lane, model, prompt, messages, params, "
                    "metadata, custom_id, status, attempts, lease_token, created_at, updated_at, "
                    "kind, line_count, failed_lines, cost, charged, prefix) VALUES ('job_old', "
                    "'t', 'bulk', 'm', :p, CAST(:m AS jsonb), '{}', CAST(:meta AS jsonb), :c, "
                    "'queued', 0, 0, 0, 0, 'generate', 1, 0, 0, 0, '')"
                ),
                {
                    "p": old,
                    "c": old,
                    "m": json.dumps([{"role": "user", "content": old}]),
                    "meta": json.dumps({old: old}),
                },
            )
        db.migrate("head")
        with db.session_scope() as session:
            job = session.get(Job, "job_old")
            assert job is not None
            assert (job.prompt, job.custom_id) == (old, old)
            assert job.messages == [{"role": "user", "content": old}]
            assert job.meta == {old: old}
            job.prompt = ODD
        with pytest.raises(RuntimeError, match="hold NUL"):
            downgrade("0012")
        with db.session_scope() as session:
            job = session.get(Job, "job_old")
            assert job is not None and job.prompt == ODD
            job.prompt = old
        downgrade("0012")
        with plain.connect() as c:
            back = c.execute(text("SELECT prompt, custom_id, messages, metadata FROM jobs")).one()
        assert tuple(back) == (old, old, [{"role": "user", "content": old}], {old: old})
    finally:
        plain.dispose()
        db.dispose()
        get_settings.cache_clear()
