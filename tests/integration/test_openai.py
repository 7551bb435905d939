"""The OpenAI surface end to end with the official ``openai`` client: a real API, a simulated
inference worker and the ops worker (batches, beat), on SQLite and PostgreSQL."""

from __future__ import annotations

import io
import json
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import redis
from openai import OpenAI
from openai.types.webhooks import BatchCompletedWebhookEvent
from standardwebhooks import Webhook

from app.core.settings import DEMO_MODEL_NAME
from tests.conftest import PostgresDatabases, backend_stack_for
from tests.integration.test_api import assert_error
from tests.support import Receiver, Stack, free_port, queue, wait_until

SECRET = "whsec_" + "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
MODEL = DEMO_MODEL_NAME
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MAX_LINES = 2100  # INFERQ_BATCH_MAX_LINES here (50,000 by default)
MAX_FILE_BYTES = 1_000_000  # INFERQ_FILES_MAX_BYTES here (200 MB by default)


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
        "openai",
        ops=True,
        sim_time_scale=0.2,
        max_model_len=2000,
        batch_sweep_interval_s=0.3,
        batch_max_lines=MAX_LINES,
        files_max_bytes=MAX_FILE_BYTES,
        webhook_allow_private="true",
        webhook_secret=SECRET,
        webhook_sweep_interval_s=0.3,
    ) as s:
        yield s


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def job(stack: Stack, job_id: str) -> dict[str, Any]:
    with stack.client() as c:
        response = c.get(f"/v1/jobs/{job_id}")
        assert response.status_code == 200, response.text
        return dict(response.json())


# --- realtime --------------------------------------------------------------------------------


def test_models_lists_the_served_model(client: OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_completion_is_a_realtime_job(client: OpenAI, stack: Stack) -> None:
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "name three queues"}],
        max_tokens=12,
        metadata={"team": "search"},
    )
    choice = answer.choices[0]
    assert answer.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12
    row = job(stack, answer.id)
    assert row["status"] == "succeeded" and row["lane"] == "realtime"
    assert row["result"]["text"] == choice.message.content
    assert row["metadata"] == {"team": "search"}


def test_completion_with_lane_and_stop(client: OpenAI, stack: Stack) -> None:
    answer = client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=6, extra_body={"lane": "standard"}
    )
    assert answer.object == "text_completion"
    assert answer.choices[0].text and answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 6
    assert job(stack, answer.id)["lane"] == "standard"


def test_service_tier_flex_runs_in_the_standard_lane(client: OpenAI, stack: Stack) -> None:
    """The SDK's own ``service_tier`` parameter (docs/openai.md, "Service tiers")."""
    flex = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "later is fine"}],
        max_tokens=4,
        service_tier="flex",
    )
    assert flex.service_tier == "flex"
    assert job(stack, flex.id)["lane"] == "standard"
    plain = client.completions.create(model=MODEL, prompt="now", max_tokens=2)
    assert job(stack, plain.id)["lane"] == "realtime"
    # The SDK's Completion has no service_tier field; the raw answer has it.
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="now", max_tokens=2, extra_body={"service_tier": "priority"}
    )
    assert raw.http_response.json()["service_tier"] == "priority"


def test_chat_stream_arrives_in_pieces_and_reassembles(client: OpenAI, stack: Stack) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "tell a long story"}],
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 1, "the output should arrive in more than one chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40
    row = job(stack, chunks[0].id)
    assert "".join(pieces) == row["result"]["text"]
    assert row["status"] == "succeeded" and row["lane"] == "realtime"


def test_completion_stream(client: OpenAI, stack: Stack) -> None:
    chunks = list(
        client.completions.create(model=MODEL, prompt="count", max_tokens=20, stream=True)
    )
    texts = [c.choices[0].text for c in chunks if c.choices[0].text]
    assert len(texts) > 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(texts) == job(stack, chunks[0].id)["result"]["text"]


def test_disconnecting_stream_cancels_the_job(stack: Stack) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go on forever"}],
        "max_tokens": 8000,
        "stream": True,
    }
    with (
        httpx.Client(base_url=stack.url, timeout=30) as c,
        c.stream("POST", CHAT, json=body) as response,
    ):
        assert response.status_code == 200
        job_id = response.headers["inferq-job-id"]
        data = []
        for text in response.iter_lines():
            if text.startswith("data: "):
                data.append(text)
            if len(data) >= 3:
                break
    # The connection is closed: the job is cancelled and aborted in the engine.
    ended = stack.wait_job(job_id, timeout=20)
    assert ended["status"] == "cancelled"
    assert ended["result"] is None or ended["result"]["usage"]["completion_tokens"] < 8000


def test_caller_that_gives_up_before_the_answer_cancels_the_job(stack: Stack) -> None:
    probe = {"probe": secrets.token_hex(4)}
    body = {"model": MODEL, "prompt": "go on forever", "max_tokens": 8000, "metadata": probe}
    with (
        httpx.Client(base_url=stack.url, timeout=1.5) as c,
        pytest.raises(httpx.ReadTimeout),
    ):
        c.post(COMPLETIONS, json=body)  # gives up (closes the connection) after 1.5 s

    def found() -> dict[str, Any] | None:
        # Its job is committed before the caller gives up on a quiet host, not always on a
        # loaded one: nothing orders the two.
        with stack.client() as c:
            listed = c.get("/v1/jobs", params={"lane": "realtime", "limit": 1}).json()["data"]
        return listed[0] if listed and listed[0]["metadata"] == probe else None

    newest = wait_until(found, 10, "the job the caller gave up on")
    ended = stack.wait_job(newest["id"], timeout=20)
    assert ended["status"] == "cancelled"
    # None when a loaded machine had not claimed the job before the caller left.
    assert ended["result"] is None or ended["result"]["usage"]["completion_tokens"] < 8000


def test_unsupported_and_bad_requests_are_refused(client: OpenAI, stack: Stack) -> None:
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as unknown:  # OpenAI's answer to an unknown model
        client.chat.completions.create(model="gpt-4o", messages=messages)  # type: ignore[arg-type]
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10**6)  # type: ignore[arg-type]
    assert refused.value.body["param"] == "max_tokens"  # type: ignore[index]
    # A prompt longer than the context (2000 here) is a 400, never a stream: the API refuses
    # what it can count (3000 words), the engine what only the chat template pushes over
    # (1998 words + the template's tokens): that one ran as a job and failed.
    before = stack.scalar("SELECT count(*) FROM jobs")
    for words, jobs_made in ((3000, 0), (1998, 1)):
        long = [{"role": "user", "content": "word " * words}]
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as failed:
                client.chat.completions.create(model=MODEL, messages=long, stream=stream)  # type: ignore[call-overload]
            body = failed.value.body
            assert body["code"] == "context_length_exceeded"  # type: ignore[index]
            assert stack.scalar("SELECT count(*) FROM jobs") == before + jobs_made
            before += jobs_made
            if not jobs_made:
                assert body["param"] == "messages"  # type: ignore[index]


def test_what_vllm_serve_takes_is_taken(client: OpenAI, stack: Stack) -> None:
    """Explicit nulls are defaults, vLLM's sampling options reach the job (only those set),
    refused fields ask for nothing at their defaults, and an option this engine cannot honour
    fails its job by name."""
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        extra_body={
            "temperature": None,
            "logprobs": None,
            "tools": None,
            "use_beam_search": False,
            "repetition_penalty": 1.0,
            "top_k": 3,
            "min_tokens": 2,
            "logit_bias": {"7": -100},
        },
    )
    assert out.choices[0].finish_reason == "length"
    stored = stack.scalar("SELECT params FROM jobs WHERE id = :id", id=out.id)
    params = stored if isinstance(stored, dict) else json.loads(stored)
    assert params == {"max_tokens": 5, "top_k": 3, "min_tokens": 2, "logit_bias": {"7": -100.0}}
    with stack.client() as c:
        submitted = c.post("/v1/jobs", json={"prompt": "hi", "params": {"seed": None, "top_k": 2}})
        assert submitted.status_code == 202, submitted.text
        before = stack.scalar("SELECT count(*) FROM jobs")
        bad = c.post("/v1/jobs", json={"prompt": "hi", "params": {"min_p": 2}})
        assert_error(bad, 422, "less_than_equal", "params.min_p")
        bad = c.post(
            CHAT, json={"model": MODEL, "messages": messages, "top_logprobs": 2, "stream": True}
        )
        error = assert_error(bad, 422, "unsupported_parameter", "top_logprobs")
        assert error["message"].startswith("top_logprobs needs logprobs: true")  # once
        bad = c.post(COMPLETIONS, json={"model": MODEL, "prompt": "hi", "n": 99})
        assert_error(bad, 422, "value_error", "n")
        assert stack.scalar("SELECT count(*) FROM jobs") == before
    # The SIMULATED engine has no ids a caller would know: stop_token_ids fails the job, a 400
    # naming the option (it runs several choices and logprobs).
    for extra in ({"stop_token_ids": [1]},):
        with pytest.raises(openai.BadRequestError) as failed:
            client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                extra_body=extra,
            )
        assert failed.value.body["code"] == "invalid_request"  # type: ignore[index]
        assert next(iter(extra)) in failed.value.body["message"]  # type: ignore[index]
    # echo is the worker's, not the engine's: it works on every engine. A chat continues the
    # assistant's last message.
    prefix = [*messages, {"role": "assistant", "content": "Well,"}]
    echoed = client.chat.completions.create(
        model=MODEL,
        messages=prefix,  # type: ignore[arg-type]
        max_tokens=3,
        extra_body={"echo": True, "user": "u-42"},
    )
    assert (echoed.choices[0].message.content or "").startswith("Well,")
    assert stack.scalar("SELECT end_user FROM jobs WHERE id = :id", id=echoed.id) == "u-42"


def test_tools_the_model_cannot_call_are_refused_by_name(client: OpenAI, stack: Stack) -> None:
    """The SIMULATED engine has no tool parser (its model card says so): tool_choice auto, the
    default with tools, is a 400 naming tool_choice before anything is written; a forced
    choice fails its job by name; malformed tool fields are 422s naming the field."""
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    before = stack.scalar("SELECT count(*) FROM jobs")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, tools=tools)  # type: ignore[arg-type]
    assert refused.value.body["code"] == "tools_not_supported"  # type: ignore[index]
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]
    assert refused.value.body["message"].startswith("tool_choice auto (the default")  # type: ignore[index]
    with stack.client() as c:
        chat = {"model": MODEL, "messages": messages}
        for body, param in (
            (
                {
                    **chat,
                    "tools": tools,
                    "tool_choice": {"type": "function", "function": {"name": "g"}},
                },
                "tool_choice",
            ),
            ({**chat, "tool_choice": "required"}, "tool_choice"),
            (
                {**chat, "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
                "tools[0].function.name",
            ),
            ({**chat, "tools": [], "tool_choice": "none"}, "tools"),
        ):
            assert_error(c.post(CHAT, json=body), 422, param=param)
        assert_error(
            c.post(COMPLETIONS, json={"model": MODEL, "prompt": "x", "tools": tools}),
            422,
            "extra_forbidden",
            "tools",
        )
        jobs = c.post("/v1/jobs", json={"prompt": "x", "tools": tools, "tool_choice": "required"})
        assert_error(jobs, 422, "tools_need_messages", "tools")
    assert stack.scalar("SELECT count(*) FROM jobs") == before
    # A forced choice runs by structured output, which only vLLM has: the job fails naming it.
    with pytest.raises(openai.BadRequestError) as failed:
        client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice="required"
        )  # type: ignore[arg-type]
    assert "tools" in failed.value.body["message"]  # type: ignore[index]
    # With tool_choice none the tools ask for nothing the engine must do.
    out = client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice="none", max_tokens=3
    )  # type: ignore[arg-type]
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "length"


# --- files and batches ---------------------------------------------------------------------------


def line(custom_id: str, content: str, max_tokens: int, url: str = CHAT) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {**body, "max_tokens": max_tokens},
    }


def upload(client: OpenAI, lines: list[dict[str, Any]] | bytes) -> str:
    data = (
        lines
        if isinstance(lines, bytes)
        else b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    )
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch").id


def wait_batch(client: OpenAI, batch_id: str, statuses: set[str], timeout: float = 60) -> Any:
    def done() -> Any:
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in statuses else None

    return wait_until(done, timeout, f"batch {batch_id} to reach {statuses}", every=0.2)


def output_lines(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = client.files.content(file_id).content
    assert client.files.retrieve(file_id).bytes == len(content)  # the row says what was written
    return [json.loads(x) for x in content.decode().splitlines()]


def test_files_round_trip(client: OpenAI) -> None:
    data = b'{"a": 1}\n{"b": 2}\n'
    created = client.files.create(file=("mine.jsonl", io.BytesIO(data)), purpose="batch")
    assert created.bytes == len(data) and created.filename == "mine.jsonl"
    assert client.files.retrieve(created.id).purpose == "batch"
    assert client.files.content(created.id).content == data
    assert created.id in [f.id for f in client.files.list()]
    assert client.files.delete(created.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.content(created.id)
    with pytest.raises(openai.UnprocessableEntityError):
        client.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="fine-tune")


def test_batch_runs_every_line(client: OpenAI, stack: Stack) -> None:
    lines = [line(f"req-{i}", f"question {i}", 4 + i % 5) for i in range(25)]
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint=CHAT,
        completion_window="24h",
        metadata={"run": "nightly"},
    )
    assert batch.status == "validating"
    done = wait_batch(client, batch.id, {"completed", "failed"})
    assert done.status == "completed", done.errors
    assert done.request_counts.total == 25 and done.request_counts.completed == 25
    assert done.request_counts.failed == 0 and done.error_file_id is None
    assert done.in_progress_at and done.finalizing_at and done.completed_at
    assert done.metadata == {"run": "nightly"}
    out = {x["custom_id"]: x for x in output_lines(client, done.output_file_id)}
    assert set(out) == {x["custom_id"] for x in lines}
    for source in lines:
        result = out[source["custom_id"]]
        assert result["error"] is None and result["response"]["status_code"] == 200
        body = result["response"]["body"]
        assert body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] == source["body"]["max_tokens"]
        row = job(stack, result["response"]["request_id"])  # every line was a bulk job
        assert row["lane"] == "bulk" and row["batch_id"] == batch.id
        assert row["result"]["text"] == body["choices"][0]["message"]["content"]
    assert batch.id in [b.id for b in client.batches.list(limit=5)]


def test_batch_cancel_keeps_finished_lines(client: OpenAI) -> None:
    quick = [line(f"quick-{i}", "q", 2) for i in range(5)]
    slow = [line(f"slow-{i}", "s", 8000) for i in range(20)]
    batch = client.batches.create(
        input_file_id=upload(client, quick + slow), endpoint=CHAT, completion_window="24h"
    )
    wait_until(
        lambda: client.batches.retrieve(batch.id).request_counts.completed >= 5,
        60,
        "the quick lines to finish",
        every=0.1,
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling" and cancelling.cancelling_at
    done = wait_batch(client, batch.id, {"cancelled"}, timeout=30)
    assert done.request_counts.total == 25 and done.request_counts.completed == 5
    assert done.request_counts.failed == 20 and done.cancelled_at
    kept = output_lines(client, done.output_file_id)
    assert sorted(x["custom_id"] for x in kept) == sorted(x["custom_id"] for x in quick)
    errors = output_lines(client, done.error_file_id)
    assert sorted(x["custom_id"] for x in errors) == sorted(x["custom_id"] for x in slow)
    assert {x["error"]["code"] for x in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


def test_malformed_file_fails_the_batch_and_enqueues_nothing(client: OpenAI, stack: Stack) -> None:
    good = json.dumps(line("a", "x", 4)).encode()
    duplicate = json.dumps(line("a", "y", 4)).encode()
    wrong_url = json.dumps(line("c", "z", 4, url=COMPLETIONS)).encode()
    bad_body = json.dumps({**line("d", "w", 4), "body": {"model": MODEL}}).encode()
    too_long = json.dumps(line("e", "word " * 2001, 4)).encode()
    data = b"\n".join([good, b"{not json", duplicate, wrong_url, bad_body, too_long]) + b"\n"
    batch = client.batches.create(
        input_file_id=upload(client, data), endpoint=CHAT, completion_window="24h"
    )
    failed = wait_batch(client, batch.id, {"failed", "completed", "in_progress"})
    assert failed.status == "failed" and failed.failed_at
    assert failed.errors is not None
    found = [(e.line, e.code) for e in failed.errors.data]
    assert found == [
        (2, "invalid_json"),
        (3, "duplicate_custom_id"),
        (4, "mismatched_url"),
        (5, "missing"),
        (6, "context_length_exceeded"),
    ]
    assert failed.errors.data[3].param == "body.messages"
    assert failed.errors.data[4].param == "body.messages"
    assert stack.scalar("SELECT count(*) FROM jobs WHERE batch_id = :b", b=batch.id) == 0
    assert redis.Redis.from_url(stack.redis_url).llen(queue("bulk")) == 0


def test_batch_request_errors(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file_nope", endpoint=CHAT, completion_window="24h")
    file_id = upload(client, [line("a", "x", 4)])
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/moderations",  # OpenAI's, and not a job of inferq's
            completion_window="24h",  # type: ignore[arg-type]
        )
    assert refused.value.body["param"] == "endpoint"  # type: ignore[index]
    with pytest.raises(openai.UnprocessableEntityError):
        client.batches.create(input_file_id=file_id, endpoint=CHAT, completion_window="3d")  # type: ignore[arg-type]


def test_batch_expiry_and_its_signed_webhook(
    client: OpenAI, stack: Stack, receiver: Receiver
) -> None:
    quick = [line("quick", "q", 2)]
    slow = [line(f"slow-{i}", "s", 8000) for i in range(3)]
    path = f"/batch/{secrets.token_hex(4)}"  # the receiver outlives one database's stack
    batch = client.batches.create(
        input_file_id=upload(client, quick + slow),
        endpoint=CHAT,
        # Room for the quick line on a loaded machine; the slow ones need ~10 s.
        completion_window="7s",  # type: ignore[arg-type]
        extra_body={"webhook_url": receiver.url(path)},
    )
    done = wait_batch(client, batch.id, {"expired", "completed"}, timeout=40)
    assert done.status == "expired" and done.expired_at
    assert done.request_counts.completed == 1 and done.request_counts.failed == 3
    errors = output_lines(client, done.error_file_id)
    assert {x["custom_id"] for x in errors} == {"slow-0", "slow-1", "slow-2"}
    assert {x["error"]["code"] for x in errors} == {"batch_expired"}
    assert [x["custom_id"] for x in output_lines(client, done.output_file_id)] == ["quick"]

    wait_until(lambda: receiver.received(path), 20, "the batch webhook")
    [request] = receiver.received(path)
    event = Webhook(SECRET).verify(request["body"], request["headers"])
    assert event["type"] == "batch.expired"
    assert event["data"]["id"] == batch.id and event["data"]["status"] == "expired"
    assert event["data"]["error_file_id"] == done.error_file_id


def test_responses_on_real_processes_resumed_on_a_second_api(client: OpenAI, stack: Stack) -> None:
    """The Responses API through the SDK, unchanged, on the real API and worker processes: a
    plain response, one in the flex tier, a conversation, a background stream whose connection
    drops and resumes on a second API process, and a running background response cancelled."""
    made = client.responses.create(model=DEMO_MODEL_NAME, input="Name a queue", max_output_tokens=4)
    assert made.status == "incomplete" and made.output_text
    flex = client.responses.create(
        model=DEMO_MODEL_NAME, input="later", max_output_tokens=2, service_tier="flex"
    )
    assert flex.service_tier == "flex"
    assert job(stack, "job_" + flex.id.removeprefix("resp_"))["lane"] == "standard"
    follow_up = client.responses.create(
        model=DEMO_MODEL_NAME, input="Another", previous_response_id=made.id, max_output_tokens=2
    )
    assert follow_up.previous_response_id == made.id
    messages = stack.scalar(
        "SELECT messages FROM jobs WHERE id = :i", i="job_" + follow_up.id.removeprefix("resp_")
    )
    assert [
        m["content"] for m in (json.loads(messages) if isinstance(messages, str) else messages)
    ] == [
        "Name a queue",
        made.output_text,
        "Another",
    ]

    second = stack.spawn("api-2", "api", env={"INFERQ_API_PORT": str(port := free_port())})
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200,
            60,
            "the second API",
        )
        stream = client.responses.create(
            model=DEMO_MODEL_NAME, input="Go on", max_output_tokens=30, background=True,
            stream=True,
        )  # fmt: skip
        first = []
        for event in stream:
            first.append(event)
            if len(first) == 6:
                break
        stream.close()  # the connection drops
        other = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        response_id = first[0].response.id
        rest = list(
            other.responses.retrieve(
                response_id, stream=True, starting_after=first[-1].sequence_number
            )
        )
        whole = list(client.responses.retrieve(response_id, stream=True))
        assert [e.model_dump() for e in first + rest] == [e.model_dump() for e in whole]
        assert whole[-1].type == "response.incomplete"
        assert "".join(e.delta for e in whole if e.type == "response.output_text.delta") == (
            whole[-1].response.output_text
        )
    finally:
        second.stop()

    long = client.responses.create(
        model=DEMO_MODEL_NAME, input="Keep going", max_output_tokens=1900, background=True
    )
    wait_until(lambda: client.responses.retrieve(long.id).status == "in_progress", 30, "it to run")
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled", cancelled.status
    assert job(stack, "job_" + long.id.removeprefix("resp_"))["status"] == "cancelled"


def test_a_registered_endpoint_gets_batch_completed_and_the_sdk_unwraps_it(
    client: OpenAI, stack: Stack, receiver: Receiver
) -> None:
    """OpenAI's webhook endpoints end to end: registered with the SDK, the event written when
    the ops worker finalizes the batch, delivered by the ops worker, unwrapped by the SDK."""
    path = f"/endpoint/{secrets.token_hex(4)}"
    endpoint = client.webhooks.create(
        name="batches", url=receiver.url(path), event_types=["batch.completed"]
    )
    batch = client.batches.create(
        input_file_id=upload(client, [line("a", "x", 2)]), endpoint=CHAT, completion_window="24h"
    )
    assert wait_batch(client, batch.id, {"completed"}, timeout=60).status == "completed"

    def delivered() -> list[Any]:
        found = []
        for request in receiver.received(path):
            event = client.webhooks.unwrap(
                request["body"], request["headers"], secret=endpoint.signing_secret
            )
            if isinstance(event, BatchCompletedWebhookEvent) and event.data.id == batch.id:
                found.append(event)
        return found

    [event] = wait_until(delivered, 20, "the endpoint's batch.completed")
    assert event.id.startswith("evt_") and event.object == "event"
    client.webhooks.delete(endpoint.id)


def test_large_file_is_validated_and_started(client: OpenAI, stack: Stack) -> None:
    """The line limit is a setting; a file at it is accepted (the 50,000-line figure is
    measured by ``inferq bench --scenario batchfile``)."""
    lines = [line(f"n{i}", "x", 1) for i in range(2000)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=CHAT, completion_window="24h"
    )
    running = wait_batch(client, batch.id, {"in_progress", "finalizing", "completed", "failed"})
    assert running.status != "failed", running.errors
    assert running.request_counts.total == 2000
    done = wait_batch(client, batch.id, {"completed"}, timeout=120)
    assert done.request_counts.completed == 2000
    assert len(output_lines(client, done.output_file_id)) == 2000


def test_file_and_line_limits(client: OpenAI, stack: Stack) -> None:
    with pytest.raises(openai.APIStatusError) as refused:
        client.files.create(
            file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch"
        )
    assert refused.value.status_code == 413
    # One line too many is refused while the file streams in (docs/files.md, "Uploads"): no
    # row, and nothing left in the store, not even the upload's staging file.
    stored = stack.tmp / "data" / "files"
    before = (stack.scalar("SELECT count(*) FROM files"), sorted(stored.iterdir()))
    small = [line(f"n{i}", "x", 1) for i in range(MAX_LINES + 1)]
    with pytest.raises(openai.UnprocessableEntityError) as too_many:
        upload(client, small)
    assert too_many.value.code == "too_many_lines"
    assert (stack.scalar("SELECT count(*) FROM files"), sorted(stored.iterdir())) == before
    # The limit itself: exactly MAX_LINES lines are taken.
    assert upload(client, small[:MAX_LINES]).startswith("file")
