"""Every prompt form of the completions API (docs/openai.md, "Request forms"), in process: the
API over ``httpx.ASGITransport``, a worker's real executor, recorder and relay on the SIMULATED
engine fed from the real Redis, the job rows on a SQLite file.

Several prompts are one job (docs/architecture.md, "Several prompts, one job"): its choices are
numbered prompt by prompt, ``n`` each, as vLLM numbers them, and its usage is the sum.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from sqlalchemy import text

from app.core import db
from app.core.settings import Settings
from tests.unit.conftest import environment
from tests.unit.inprocess import Worker, call, run


def stored(job_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": job_id}).one()


def complete(core: Settings, **body: Any) -> dict[str, Any]:
    answer = call(
        "POST", "/v1/completions", json={"model": core.model_name, "max_tokens": 6, **body}
    )
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def streamed(core: Settings, **body: Any) -> list[dict[str, Any]]:
    async def scenario(client: httpx.AsyncClient) -> list[str]:
        request = {"model": core.model_name, "max_tokens": 6, "stream": True, **body}
        async with client.stream("POST", "/v1/completions", json=request) as answer:
            assert answer.status_code == 200
            return [line async for line in answer.aiter_lines() if line.startswith("data: ")]

    events = run(scenario)
    assert events[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in events[:-1]]


def test_several_prompts_answer_one_choice_each_in_order_with_one_usage(core: Settings) -> None:
    prompts = ["Once upon a time", "The queue was long and", "Tell me"]
    with Worker(core):
        alone = [complete(core, prompt=p, seed=7) for p in prompts]
        together = complete(core, prompt=prompts, seed=7)
    assert [c["index"] for c in together["choices"]] == [0, 1, 2]
    assert [c["text"] for c in together["choices"]] == [a["choices"][0]["text"] for a in alone]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert together["usage"][key] == sum(a["usage"][key] for a in alone), key
    job = stored(together["id"])
    # One job: the prompts in its row, in order, and no text prompt; its fair-share cost is
    # every prompt's tokens and every choice's most output (3 prompts x 6 tokens).
    assert job.prompt is None and json.loads(job.inputs) == prompts
    assert job.cost == together["usage"]["prompt_tokens"] + 3 * 6


def test_several_prompts_times_n_are_numbered_prompt_by_prompt(core: Settings) -> None:
    with Worker(core):
        answer = complete(core, prompt=["first prompt", "and a second"], n=2, seed=3)
        first = complete(core, prompt="first prompt", n=2, seed=3)
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2, 3]
    # Choices 0 and 1 are the first prompt's, as if it had been asked alone.
    assert [c["text"] for c in answer["choices"][:2]] == [c["text"] for c in first["choices"]]
    assert answer["usage"]["completion_tokens"] == 4 * 6


def test_token_ids_are_counted_without_the_tokenizer(core: Settings) -> None:
    ids = [11, 12, 13, 14, 15]
    with Worker(core):
        answer = complete(core, prompt=ids)
        nested = complete(core, prompt=[ids])
    assert answer["usage"]["prompt_tokens"] == nested["usage"]["prompt_tokens"] == len(ids)
    assert len(answer["choices"]) == len(nested["choices"]) == 1
    assert json.loads(stored(answer["id"]).inputs) == [ids]


def test_several_prompts_stream_interleaved_by_index_and_add_up(core: Settings) -> None:
    prompts = ["Once upon a time", "The queue was long and"]
    with Worker(core):
        whole = complete(core, prompt=prompts, seed=1)
        chunks = streamed(core, prompt=prompts, seed=1, stream_options={"include_usage": True})
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length"}
    # One usage, last, for the request: the same as the whole answer's.
    usages = [c for c in chunks if c.get("usage")]
    assert usages == [chunks[-1]] and chunks[-1]["usage"] == whole["usage"]


def test_echo_starts_every_choice_with_its_prompt(core: Settings) -> None:
    prompts = ["Once upon a time", "Tell me"]
    with Worker(core):
        answer = complete(core, prompt=prompts, echo=True, seed=2)
        plain = complete(core, prompt=prompts, seed=2)
    for echoed, alone, prompt in zip(answer["choices"], plain["choices"], prompts, strict=True):
        assert echoed["text"] == prompt + alone["text"]


def test_echo_with_logprobs_gives_the_prompts_logprobs_first(core: Settings) -> None:
    prompt = "Once upon a time"
    with Worker(core):
        answer = complete(core, prompt=prompt, echo=True, logprobs=2, max_tokens=3)
        chunks = streamed(core, prompt=prompt, echo=True, logprobs=2, max_tokens=3)
        job = call("GET", f"/v1/jobs/{answer['id']}")
    # The Job object shows the same choice: the echoed prompt's first token without a logprob.
    assert job.status_code == 200, job.text
    [stored_choice] = job.json()["result"]["choices"]
    assert stored_choice["logprobs"][0]["logprob"] is None
    assert stored_choice["prompt_logprobs"][0]["logprob"] is None
    [choice] = answer["choices"]
    logprobs = choice["logprobs"]
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == prompt_tokens + 3
    # OpenAI's legacy format: nothing precedes the first prompt token.
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(lp is not None for lp in logprobs["token_logprobs"][1:])
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["text_offset"][0] == 0
    assert choice["text"].startswith(prompt)
    # vLLM's prompt_logprobs too (the echo asked the engine for them): null first.
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == prompt_tokens
    # Streamed: the same tokens and offsets, the prompt's in the first piece.
    tokens = [
        t
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for t in c["choices"][0]["logprobs"]["tokens"]
    ]
    offsets = [
        o
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert tokens == logprobs["tokens"] and offsets == logprobs["text_offset"]


def test_prompt_logprobs_alone(core: Settings) -> None:
    with Worker(core):
        answer = complete(core, prompt="Once upon a time", prompt_logprobs=1, max_tokens=2)
    [choice] = answer["choices"]
    assert choice["logprobs"] is None
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == answer["usage"]["prompt_tokens"]
    for entry in entries[1:]:
        assert 1 <= len(entry) <= 2
        for token_id, logprob in entry.items():
            assert int(token_id) >= 0 and logprob["logprob"] <= 0 and logprob["rank"] >= 1


def test_bad_prompt_forms_are_refused_and_nothing_written(core: Settings) -> None:
    with Worker(core):
        for prompt in ([], [[]], [-1, 2], ["a", [1]], [""], [1.5]):
            answer = call(
                "POST", "/v1/completions", json={"model": core.model_name, "prompt": prompt}
            )
            assert answer.status_code == 422, (prompt, answer.text)
            assert answer.json()["error"]["param"] == "prompt", answer.json()
    with db.transaction() as connection:
        assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 0


def test_a_prompts_logprobs_count_against_the_result_bound(core: Settings) -> None:
    """A long prompt's logprobs, kept by each choice, are a result too: over
    INFERQ_MAX_LOGPROB_ENTRIES the request is refused before anything is written."""
    prompt = "word " * 200
    with environment(max_logprob_entries="2000"), Worker(core):
        refused = call(
            "POST",
            "/v1/completions",
            json={"model": core.model_name, "prompt": prompt, "prompt_logprobs": 5, "n": 2},
        )
        taken = call(
            "POST",
            "/v1/completions",
            json={
                "model": core.model_name,
                "prompt": prompt,
                "prompt_logprobs": 1,
                "max_tokens": 2,
            },
        )
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert (error["code"], error["param"]) == ("result_too_large", "prompt_logprobs")
    assert taken.status_code == 200, taken.text
    with db.transaction() as connection:
        assert connection.execute(text("SELECT count(*) FROM jobs")).scalar_one() == 1
