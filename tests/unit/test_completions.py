"""OpenAI calls served as jobs (app/api/completions.py), in process: the API over
``httpx.ASGITransport``, a worker's real executor, recorder and relay on a simulated engine
(SIMULATED) fed from the real Redis, and the job rows on a SQLite file."""

from __future__ import annotations

import json
from typing import Any

import httpx
from sqlalchemy import text

from app.core import db
from app.core.settings import Settings
from tests.unit.inprocess import Worker, call, run

CHAT = [{"role": "user", "content": "Tell me about queues"}]


def stored(job_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": job_id}).one()


def jobs() -> int:
    with db.transaction() as connection:
        return int(connection.execute(text("SELECT count(*) FROM jobs")).scalar_one())


def test_a_chat_call_answers_with_its_jobs_committed_outcome(core: Settings) -> None:
    with Worker(core):
        answer = call(
            "POST",
            "/v1/chat/completions",
            json={"model": core.model_name, "messages": CHAT, "max_tokens": 8},
        )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "chat.completion" and body["model"] == core.model_name
    [choice] = body["choices"]
    job = stored(answer.headers["inferq-job-id"])
    assert (job.status, job.lane, job.relay) == ("succeeded", "realtime", "end")
    assert choice["message"]["content"] == job.result_text != ""
    assert body["usage"]["completion_tokens"] == job.completion_tokens == 8


def test_a_streamed_call_relays_pieces_that_add_up_to_the_stored_text(core: Settings) -> None:
    async def scenario(client: httpx.AsyncClient) -> tuple[httpx.Response, list[str]]:
        request = {"model": core.model_name, "prompt": "Once upon", "max_tokens": 12}
        async with client.stream(
            "POST", "/v1/completions", json={**request, "stream": True}
        ) as answer:
            events = [line async for line in answer.aiter_lines() if line.startswith("data: ")]
        return answer, events

    with Worker(core):
        answer, events = run(scenario)
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    text_out = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    job = stored(answer.headers["inferq-job-id"])
    assert job.relay == "tokens" and text_out == job.result_text != ""
    assert chunks[-1]["choices"][0]["finish_reason"] == job.finish_reason == "length"


def test_a_model_no_worker_serves_is_refused_and_nothing_written(core: Settings) -> None:
    answer = call("POST", "/v1/chat/completions", json={"model": core.model_name, "messages": CHAT})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "model_not_ready"
    assert int(answer.headers["Retry-After"]) > 0
    unknown = call("POST", "/v1/chat/completions", json={"model": "nobody", "messages": CHAT})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    assert jobs() == 0


def test_a_prompt_longer_than_the_context_is_an_invalid_request(core: Settings) -> None:
    with Worker(core, max_model_len=16):
        long = [{"role": "user", "content": "word " * 64}]
        answer = call(
            "POST", "/v1/chat/completions", json={"model": core.model_name, "messages": long}
        )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "context_length_exceeded"
    assert jobs() == 0


def test_a_service_tier_picks_the_lane_and_the_answer_echoes_it(core: Settings) -> None:
    """OpenAI's service tiers (docs/openai.md, "Service tiers"): auto and default keep the
    lane, priority is realtime, flex is standard; the answer says the tier it ran in."""
    asked = [
        (None, {}, "realtime", "default"),
        ("auto", {}, "realtime", "default"),
        ("default", {"lane": "standard"}, "standard", "flex"),
        ("priority", {}, "realtime", "priority"),
        ("flex", {}, "standard", "flex"),
    ]
    with Worker(core):
        for tier, extra, lane, echo in asked:
            body = {"model": core.model_name, "messages": CHAT, "max_tokens": 4, **extra}
            if tier is not None:
                body["service_tier"] = tier
            answer = call("POST", "/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["service_tier"] == echo, (tier, answer.json())
            assert stored(answer.json()["id"]).lane == lane, tier

        async def scenario(client: httpx.AsyncClient) -> list[str]:
            body = {
                "model": core.model_name,
                "prompt": "Once upon",
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
                "service_tier": "flex",
            }
            async with client.stream("POST", "/v1/completions", json=body) as answer:
                assert answer.status_code == 200
                return [line async for line in answer.aiter_lines() if line.startswith("data: {")]

        events = run(scenario)
    chunks = [json.loads(line.removeprefix("data: ")) for line in events]
    assert chunks and {c["service_tier"] for c in chunks} == {"flex"}
    assert stored(chunks[0]["id"]).lane == "standard"


def test_a_tier_the_lane_contradicts_or_one_not_offered_is_refused(core: Settings) -> None:
    with Worker(core):
        both = call(
            "POST",
            "/v1/chat/completions",
            json={
                "model": core.model_name,
                "messages": CHAT,
                "lane": "bulk",
                "service_tier": "priority",
            },
        )
        scale = call(
            "POST",
            "/v1/chat/completions",
            json={"model": core.model_name, "messages": CHAT, "service_tier": "scale"},
        )
    assert both.status_code == 422, both.text
    error = both.json()["error"]
    assert error["param"] == "service_tier" and "realtime" in error["message"], error
    assert "bulk" in error["message"], error
    assert scale.status_code == 422 and scale.json()["error"]["param"] == "service_tier"
    assert jobs() == 0


def test_the_pieces_of_calls_a_stream_missed_are_sent_from_the_committed_calls() -> None:
    """A streamed chat's end sends what the relay lost of each committed call: a call none of
    whose pieces came whole (its id and name too), the rest of one that came in part, nothing
    for one that came whole."""
    from app.api.completions import _missed

    def made(call_id: str, arguments: str) -> dict[str, Any]:
        return {
            "id": call_id,
            "type": "function",
            "function": {"name": "f", "arguments": arguments},
        }

    committed = [made("call_a", '{"a": 1}'), made("call_b", '{"b": 2}'), made("call_c", "{}")]
    sent = {0: ["", '{"a": 1}'], 1: ['{"b"']}
    assert _missed(committed, sent) == [
        {"index": 1, "function": {"arguments": ": 2}"}},
        {"index": 2, **made("call_c", "{}")},
    ]
    assert _missed(committed[:1], sent) == []
