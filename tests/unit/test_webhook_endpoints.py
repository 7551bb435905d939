"""Webhook endpoints in process: managed with the official OpenAI SDK (unchanged, over the real
app), a batch's end written as one event per subscribed endpoint, delivered by the ops worker's
real delivery code to a receiver on loopback and verified by the SDK's ``webhooks.unwrap``."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types.webhooks import BatchCancelledWebhookEvent, ResponseCancelledWebhookEvent
from sqlalchemy import text

from app.api.main import create_app
from app.batches import finalize
from app.cli.main import main as cli
from app.core import db
from app.core.db import session_scope
from app.core.errors import DomainError
from app.core.settings import Settings, get_settings
from app.core.tenants.keys import create_key
from app.core.webhooks import endpoints, rules
from tests.conftest import PostgresDatabases, database_url_for
from tests.support import Receiver
from tests.unit.conftest import environment
from tests.unit.inprocess import Worker
from workers.ops import delivery

# A public address, as the URL policy asks (no DNS here); nothing is ever sent to it: no event
# that its endpoints list fires in these tests.
PUBLIC = "https://8.8.8.8/hooks"
LINE = {
    "custom_id": "a",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


def events() -> list[Any]:
    with db.transaction() as connection:
        query = (
            "SELECT id, type, endpoint_id, batch_id, job_id, url FROM webhook_events ORDER BY id"
        )
        return list(connection.execute(text(query)))


@contextlib.contextmanager
def sdk(tenant: str) -> Iterator[OpenAI]:
    """The official SDK, unchanged, on the real app in this process, with a key of ``tenant``."""
    with session_scope() as session:
        _, plaintext = create_key(session, tenant)
    with TestClient(create_app()) as http:
        yield OpenAI(base_url="http://testserver/v1", api_key=plaintext, http_client=http)


@pytest.fixture
def keyed(core: Settings) -> Iterator[Settings]:
    with environment(require_auth="true") as settings:
        yield settings


@pytest.fixture
def client(keyed: Settings) -> Iterator[OpenAI]:
    with sdk("acme") as c:
        yield c


def test_an_endpoint_is_made_listed_changed_rotated_and_deleted_with_the_sdk(
    client: OpenAI,
) -> None:
    made = client.webhooks.create(name="batches", url=PUBLIC, event_types=["batch.completed"])
    assert made.id.startswith("whep_") and made.signing_secret.startswith("whsec_")
    assert made.signing_secret_hint == f"whsec_...{made.signing_secret[-4:]}"
    listed = client.webhooks.list()
    assert [e.id for e in listed.data] == [made.id]
    assert "signing_secret" not in listed.data[0].model_dump()  # shown once, never listed

    changed = client.webhooks.update(made.id, event_types=["batch.completed", "batch.failed"])
    assert changed.event_types == ["batch.completed", "batch.failed"]
    assert client.webhooks.retrieve(made.id).event_types == changed.event_types
    rotated = client.webhooks.rotate_secret(made.id)
    assert rotated.signing_secret.startswith("whsec_")
    assert rotated.signing_secret != made.signing_secret
    assert client.webhooks.event_types.list().data == [
        "batch.completed",
        "batch.failed",
        "batch.expired",
        "batch.cancelled",
        "response.completed",
        "response.failed",
        "response.cancelled",
        "response.incomplete",
    ]

    deleted = client.webhooks.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    assert client.webhooks.list().data == []


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (  # OpenAI's type of something inferq does not have: refused by name
            {"event_types": ["fine_tuning.job.succeeded"]},
            "event_types",
            "unsupported_event_type",
        ),
        ({"event_types": ["job.succeeded"]}, "event_types", "unsupported_event_type"),
        ({"event_types": []}, "event_types", "invalid_event_types"),
        ({"url": "http://127.0.0.1:9/hook"}, "url", "webhook_url_refused"),
        ({"url": "ftp://8.8.8.8/hook"}, "url", "webhook_url_refused"),
        ({"name": "   "}, "name", "invalid_name"),
    ],
)
def test_bad_input_names_the_field_and_writes_nothing(
    client: OpenAI, body: dict[str, Any], param: str, code: str
) -> None:
    fields = {"name": "n", "url": PUBLIC, "event_types": ["batch.failed"]}
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.webhooks.create(**(fields | body))
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["param"], error["code"]) == (param, code), error
    assert client.webhooks.list().data == []


def test_another_tenants_endpoint_is_not_found(client: OpenAI) -> None:
    mine = client.webhooks.create(name="n", url=PUBLIC, event_types=["batch.failed"])
    with sdk("other") as theirs:
        with pytest.raises(openai.NotFoundError):
            theirs.webhooks.retrieve(mine.id)
        with pytest.raises(openai.NotFoundError):
            theirs.webhooks.update(mine.id, name="taken")
        with pytest.raises(openai.NotFoundError):
            theirs.webhooks.rotate_secret(mine.id)
        with pytest.raises(openai.NotFoundError):
            theirs.webhooks.delete(mine.id)
        assert theirs.webhooks.list().data == []
    assert client.webhooks.retrieve(mine.id).name == "n"


def test_a_batch_end_goes_to_each_subscribed_endpoint_and_the_sdk_unwraps_it(
    client: OpenAI, receiver: Receiver
) -> None:
    with environment(require_auth="true", webhook_allow_private="true") as settings:
        hooked = client.webhooks.create(
            name="cancels", url=receiver.url("/ok/cancels"), event_types=["batch.cancelled"]
        )
        client.webhooks.create(
            name="completions", url=receiver.url("/ok/done"), event_types=["batch.completed"]
        )
        uploaded = client.files.create(
            file=("in.jsonl", json.dumps(LINE).encode() + b"\n"), purpose="batch"
        )
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert client.batches.cancel(batch.id).status == "cancelling"
        assert finalize.finalize(batch.id)  # what the ops worker does next
        assert client.batches.retrieve(batch.id).status == "cancelled"

        # One event, for the one endpoint that lists batch.cancelled, at the endpoint's URL.
        [event] = events()
        assert (event.type, event.endpoint_id, event.batch_id) == (
            "batch.cancelled",
            hooked.id,
            batch.id,
        )
        assert event.id.startswith("evt_") and event.url == hooked.url
        assert delivery.deliver(event.id, get_settings()) == "delivered"
        [request] = receiver.received("/ok/cancels")
        assert receiver.received("/ok/done") == []

        unwrapped = client.webhooks.unwrap(
            request["body"], request["headers"], secret=hooked.signing_secret
        )
        assert isinstance(unwrapped, BatchCancelledWebhookEvent)
        assert unwrapped.id == event.id and unwrapped.data.id == batch.id
        assert unwrapped.object == "event"

        # Rotated keeping the old secret: a redelivery verifies with either for 24 hours.
        rotated = client.webhooks.rotate_secret(hooked.id, keep_old_secret_active_for_24_hours=True)
        base = f"/webhook_endpoints/{hooked.id}/events/{event.id}"
        # Moved: the event is sent again where the endpoint points now.
        client.webhooks.update(hooked.id, url=receiver.url("/ok/moved"))
        resent: Any = client.post(f"{base}/redeliver", cast_to=object, body={})
        assert (resent["id"], resent["status"]) == (event.id, "pending")
        assert delivery.deliver(event.id, settings) == "delivered"
        [again] = receiver.received("/ok/moved")
        assert again["body"] == request["body"]  # the same bytes, the same webhook-id
        for secret in (hooked.signing_secret, rotated.signing_secret):
            client.webhooks.verify_signature(again["body"], again["headers"], secret=secret)
        with pytest.raises(openai.InvalidWebhookSignatureError):
            client.webhooks.verify_signature(
                request["body"], request["headers"], secret=rotated.signing_secret
            )
        # The endpoint's delivery log: the event, and both attempts with their answers.
        log: Any = client.get(base, cast_to=object)
        assert [(a["kind"], a["status_code"]) for a in log["data"]] == [
            ("scheduled", 200),
            ("redelivery", 200),
        ]
        listed: Any = client.get(f"/webhook_endpoints/{hooked.id}/events", cast_to=object)
        assert [e["id"] for e in listed["data"]] == [event.id]

        # A deleted endpoint takes its events with it: nothing more goes to its URL, and an
        # attempt under way when it went records nothing (and raises nothing).
        client.post(f"{base}/redeliver", cast_to=object, body={})
        claimed = delivery._claim(event.id, settings)
        assert claimed is not None
        client.webhooks.delete(hooked.id)
        assert events() == []
        sent = delivery.send(claimed.url, event.id, claimed.body, settings, claimed.secrets)
        assert sent.ok and delivery._record(claimed, sent, settings) == "skipped"


def test_the_docs_samples_have_the_fields_the_api_answers(client: OpenAI) -> None:
    """docs/webhooks.md, "Webhook endpoints": the create answer and the event body."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "webhooks.md").read_text()
    section = text[text.index("## Webhook endpoints") :]
    samples = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", section, re.S)]
    event_sample, created_sample = samples
    made = client.webhooks.create(name="n", url=PUBLIC, event_types=["batch.completed"])
    answered: Any = client.get(f"/webhook_endpoints/{made.id}", cast_to=object)
    assert set(created_sample) == set(answered) | {"signing_secret"}
    assert set(created_sample) == set(made.model_dump())
    body = json.loads(rules.render_openai("evt_x", "batch.completed", 1.0, "batch_x"))
    assert set(event_sample) == set(body) and set(event_sample["data"]) == set(body["data"])
    assert event_sample["type"] in client.webhooks.event_types.list().data


def test_the_cli_adds_lists_and_removes_a_tenants_endpoint(core: Settings) -> None:
    runner = CliRunner()
    added = runner.invoke(
        cli, ["webhooks", "add", "--tenant", "acme", "--events", "batch.failed", PUBLIC]
    )
    assert added.exit_code == 0, added.output
    secret = added.stdout.strip()
    assert secret.startswith("whsec_") and "not shown again" in added.stderr
    listed = runner.invoke(cli, ["webhooks", "list", "--tenant", "acme"])
    [line] = listed.stdout.splitlines()
    endpoint_id = line.split()[0]
    assert PUBLIC in line and "batch.failed" in line and secret not in line
    assert runner.invoke(cli, ["webhooks", "list", "--tenant", "other"]).stdout == ""

    refused = runner.invoke(
        cli, ["webhooks", "add", "--tenant", "acme", "--events", "video.completed", PUBLIC]
    )
    assert refused.exit_code == 1
    assert "unsupported_event_type: 'video.completed' is not an event type" in refused.stderr
    foreign = runner.invoke(cli, ["webhooks", "remove", "--tenant", "other", endpoint_id])
    assert foreign.exit_code == 1 and "webhook_endpoint_not_found" in foreign.stderr
    removed = runner.invoke(cli, ["webhooks", "remove", "--tenant", "acme", endpoint_id])
    assert removed.exit_code == 0 and removed.stdout.strip() == "removed"
    assert runner.invoke(cli, ["webhooks", "list", "--tenant", "acme"]).stdout == ""


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_creations_at_once_stop_at_the_tenants_ceiling(
    backend: str, tmp_path: Path, postgres: PostgresDatabases, redis_url: str
) -> None:
    """Twelve creations at once with four places left: four are made, eight refused."""
    types = ["batch.failed"]
    url = database_url_for(backend, tmp_path, postgres)
    with environment(data_dir=str(tmp_path), database_url=url, redis_url=redis_url):
        db.migrate()
        left = 4
        with session_scope() as session:
            for i in range(endpoints.MAX_PER_TENANT - left):
                endpoints.create(session, "acme", name=f"n{i}", url=PUBLIC, event_types=types)
        start = threading.Barrier(12)

        def one(i: int) -> str:
            start.wait()
            try:
                with session_scope() as session:
                    endpoints.create(session, "acme", name=f"m{i}", url=PUBLIC, event_types=types)
            except DomainError as exc:
                return exc.code
            return "made"

        with ThreadPoolExecutor(12) as pool:
            outcomes = list(pool.map(one, range(12)))
        assert sorted(outcomes) == ["made"] * left + ["too_many_webhook_endpoints"] * 8
        with session_scope() as session:
            assert len(endpoints.list_page(session, "acme", limit=100, after=None)[0]) == 20


def test_a_tenant_has_at_most_twenty_endpoints_and_a_bad_change_changes_nothing(
    client: OpenAI,
) -> None:
    made = [
        client.webhooks.create(name=f"n{i}", url=PUBLIC, event_types=["batch.failed"])
        for i in range(endpoints.MAX_PER_TENANT)
    ]
    with pytest.raises(openai.ConflictError) as refused:
        client.webhooks.create(name="one more", url=PUBLIC, event_types=["batch.failed"])
    assert isinstance(refused.value.body, dict)
    assert refused.value.body["code"] == "too_many_webhook_endpoints"

    first = made[0]
    with pytest.raises(openai.UnprocessableEntityError):
        client.webhooks.update(first.id, url="http://10.0.0.1/hook")
    with pytest.raises(openai.UnprocessableEntityError):
        client.webhooks.update(first.id, event_types=["batch.failed", "eval.run.failed"])
    kept = client.webhooks.retrieve(first.id)
    assert (kept.url, kept.event_types, kept.updated_at) == (
        PUBLIC,
        ["batch.failed"],
        first.updated_at,
    )
    assert client.webhooks.update(first.id, name="n0").updated_at == first.updated_at


def test_a_background_responses_end_goes_to_the_endpoints_that_list_it(
    client: OpenAI, receiver: Receiver
) -> None:
    with environment(require_auth="true", webhook_allow_private="true") as settings:
        hooked = client.webhooks.create(
            name="responses",
            url=receiver.url("/ok/responses"),
            event_types=["response.cancelled", "response.completed"],
        )
        made = client.responses.create(model=settings.model_name, input="hi", background=True)
        assert client.responses.cancel(made.id).status == "cancelled"
        # A foreground response is answered on the line: no event (OpenAI's rule too).
        [event] = events()
        assert (event.type, event.endpoint_id) == ("response.cancelled", hooked.id)
        assert delivery.deliver(event.id, settings) == "delivered"
        [request] = receiver.received("/ok/responses")
        unwrapped = client.webhooks.unwrap(
            request["body"], request["headers"], secret=hooked.signing_secret
        )
        assert isinstance(unwrapped, ResponseCancelledWebhookEvent)
        assert unwrapped.data.id == made.id


def test_a_background_response_that_a_worker_finishes_is_an_event(
    client: OpenAI, keyed: Settings
) -> None:
    hooked = client.webhooks.create(
        name="responses", url=PUBLIC, event_types=["response.incomplete", "response.failed"]
    )
    with Worker(keyed):
        made = client.responses.create(
            model=keyed.model_name, input="hi", background=True, max_output_tokens=3
        )
        for _ in range(100):
            if events():
                break
            time.sleep(0.05)
    # The simulated engine stops at max_output_tokens: the response is incomplete.
    [event] = events()
    assert (event.type, event.endpoint_id) == ("response.incomplete", hooked.id)
    # Its body is written with it, naming the response, and it is not the job's: deleting the
    # response right after it ended leaves the event to be delivered.
    with db.transaction() as connection:
        body = connection.execute(
            text("SELECT body FROM webhook_events WHERE id = :i"), {"i": event.id}
        ).scalar_one()
    assert json.loads(body)["data"] == {"id": made.id} and event.job_id is None
    client.responses.delete(made.id)
    assert [e.id for e in events()] == [event.id]
