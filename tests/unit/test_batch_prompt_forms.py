"""Every prompt form of the completions API in a batch line and in ``POST /v1/jobs`` (issue 64;
docs/openai.md, "Several prompts are one job"), in process: the API over ``httpx.ASGITransport``,
the ops worker's own validation and finalization (app/batches), the real dispatcher loop, and a
worker's real executor on the SIMULATED engine (deterministic with a seed), on a SQLite file
and a real Redis.

A batch line's ``response.body`` is what the realtime endpoint answers for the same body: the
same choices in the same order (several prompts numbered prompt by prompt, ``n`` each) and the
same usage.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import text

from app.batches import finalize, validation
from app.core import db
from app.core.messaging import clients
from app.core.settings import Settings
from app.dispatcher.loop import Dispatcher
from tests.support import wait_until
from tests.unit.inprocess import Worker, call, create_batch

COMPLETIONS = "/v1/completions"
# The simulated engine's context here: "word " * 40 is 40 tokens, past it.
CONTEXT = 32

# One line per prompt form, and the sampling options that change the answer's shape.
FORMS: dict[str, dict[str, Any]] = {
    "text": {"prompt": "Once upon a time", "seed": 1},
    # Short words: four characters a token (the estimate without a tokenizer) would be wrong.
    "texts-n2": {
        "prompt": ["Once upon a time", "a b c d e f g h"],
        "n": 2,
        "temperature": 0.8,
        "seed": 2,
    },
    "ids-echo-logprobs": {"prompt": [11, 12, 13, 14], "echo": True, "logprobs": 2, "seed": 3},
    "id-lists-prompt-logprobs": {
        "prompt": [[11, 12, 13], [21, 22]],
        "prompt_logprobs": 1,
        "seed": 4,
    },
    "texts-echo-logprobs-n2": {
        "prompt": ["Once upon a time", "Tell me"],
        "echo": True,
        "logprobs": 1,
        "n": 2,
        "temperature": 0.8,
        "seed": 5,
    },
}


def body(core: Settings, **fields: Any) -> dict[str, Any]:
    return {"model": core.model_name, "max_tokens": 4, **fields}


def record(custom_id: str, request: dict[str, Any]) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": request}
    return json.dumps(line).encode()


@pytest.fixture
def stack(core: Settings) -> Iterator[Settings]:
    """A worker on the simulated engine and the dispatcher's loop, running."""
    stop = threading.Event()
    with Worker(core, max_model_len=CONTEXT):
        dispatcher = Dispatcher(core, clients.redis_client())
        looping = threading.Thread(target=dispatcher.run, args=(stop,), daemon=True)
        looping.start()
        try:
            yield core
        finally:
            stop.set()
            looping.join(10)


def run_batch(lines: list[bytes]) -> tuple[dict[str, Any], str]:
    """Upload ``lines``, create the batch, start it as the ops worker does, and finalize it once
    its jobs are done; (the batch as the API shows it, what start answered)."""
    batch_id = create_batch(lines, COMPLETIONS)
    started = validation.start(batch_id)  # the ops worker's start task
    if started == "in_progress":
        wait_until(lambda: finalize.finalize(batch_id), 20, "the batch to finalize", every=0.05)
    return call("GET", f"/v1/batches/{batch_id}").json(), started


def contents(file_id: str) -> list[dict[str, Any]]:
    answer = call("GET", f"/v1/files/{file_id}/content")
    assert answer.status_code == 200, answer.text
    return [json.loads(x) for x in answer.content.splitlines()]


def jobs_of(batch_id: str) -> int:
    with db.transaction() as connection:
        query = text("SELECT count(*) FROM jobs WHERE batch_id = :b")
        return int(connection.execute(query, {"b": batch_id}).scalar_one())


def cost_of(job_id: str) -> int:
    """What the job was charged in the fair share (its row's cost)."""
    with db.transaction() as connection:
        query = text("SELECT cost FROM jobs WHERE id = :i")
        return int(connection.execute(query, {"i": job_id}).scalar_one())


def test_a_batch_line_of_every_prompt_form_answers_as_the_realtime_endpoint(
    stack: Settings,
) -> None:
    lines = [record(name, body(stack, **fields)) for name, fields in FORMS.items()]
    batch, started = run_batch(lines)
    assert started == "in_progress" and batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    out = contents(batch["output_file_id"])
    assert [x["custom_id"] for x in out] == list(FORMS)  # input order
    for result in out:
        fields = FORMS[result["custom_id"]]
        realtime = call("POST", COMPLETIONS, json=body(stack, **fields))
        assert realtime.status_code == 200, realtime.text
        expected = realtime.json()
        assert result["error"] is None and result["response"]["status_code"] == 200
        answer = result["response"]["body"]
        assert answer["object"] == expected["object"] == "text_completion"
        assert answer.keys() == expected.keys() and answer["model"] == expected["model"]
        assert answer["choices"] == expected["choices"], result["custom_id"]
        assert answer["usage"] == expected["usage"], result["custom_id"]
        # Charged as the realtime job is: every prompt's tokens as counted, and prompts x n x
        # max_tokens.
        realtime_job = realtime.headers["inferq-job-id"]
        assert cost_of(result["response"]["request_id"]) == cost_of(realtime_job)
    answers = {x["custom_id"]: x["response"]["body"] for x in out}
    # The shapes the forms ask for: prompt by prompt, n each; echo's prompt text first with its
    # logprobs (the first null); vLLM's prompt_logprobs, one per prompt token, null first.
    several = answers["texts-n2"]["choices"]
    assert [c["index"] for c in several] == [0, 1, 2, 3]
    assert answers["texts-n2"]["usage"]["completion_tokens"] == 4 * 4
    [echoed] = answers["ids-echo-logprobs"]["choices"]
    assert echoed["logprobs"]["token_logprobs"][0] is None
    assert len(echoed["logprobs"]["tokens"]) == 4 + 4
    assert answers["ids-echo-logprobs"]["usage"]["prompt_tokens"] == 4
    lists = answers["id-lists-prompt-logprobs"]
    assert [len(c["prompt_logprobs"]) for c in lists["choices"]] == [3, 2]
    assert all(c["prompt_logprobs"][0] is None for c in lists["choices"])
    assert lists["usage"]["prompt_tokens"] == 5
    both = answers["texts-echo-logprobs-n2"]["choices"]
    echoes = ["Once upon a time"] * 2 + ["Tell me"] * 2  # prompt by prompt, n each
    assert all(c["text"].startswith(e) for c, e in zip(both, echoes, strict=True)), both
    assert all(c["logprobs"]["token_logprobs"][0] is None for c in both)


def test_a_bad_prompt_form_fails_the_batch_by_its_line_and_starts_no_job(stack: Settings) -> None:
    """As any bad line does (docs/openai.md, "Batches"): the batch fails with each bad line's
    number, the param named and the realtime endpoint's message, and the transaction rolls back
    (no job); the good forms around them are not errors."""
    bad: list[Any] = [[], ["a", [1, 2]], [[]], [-1, 2], [[1], "a"]]
    good: list[Any] = ["Once upon a time", [1, 2, 3], ["a", "b"], [[1], [2, 3]]]
    lines = [record(f"good-{i}", body(stack, prompt=p)) for i, p in enumerate(good)]
    lines += [record(f"bad-{i}", body(stack, prompt=p)) for i, p in enumerate(bad)]
    batch, started = run_batch(lines)
    assert started == "failed" and batch["status"] == "failed", batch
    errors = batch["errors"]["data"]
    assert [e["line"] for e in errors] == list(range(len(good) + 1, len(lines) + 1)), errors
    for error, prompt in zip(errors, bad, strict=True):
        realtime = call("POST", COMPLETIONS, json=body(stack, prompt=prompt)).json()["error"]
        assert error["param"] == "body.prompt", error
        assert error["code"] == realtime["code"], (error, realtime)
        assert error["message"] == f"body.{realtime['message']}", (error, realtime)
    assert jobs_of(batch["id"]) == 0


def test_a_second_prompt_past_the_context_fails_the_batch_naming_it(stack: Settings) -> None:
    long = "word " * 40
    lines = [
        record("fits", body(stack, prompt=["Once upon a time", "Tell me"])),
        record("too-long", body(stack, prompt=["Once upon a time", long])),
        record("ids-too-long", body(stack, prompt=[[1, 2], list(range(CONTEXT))])),
    ]
    batch, started = run_batch(lines)
    assert started == "failed", batch
    found = [(e["line"], e["code"], e["param"]) for e in batch["errors"]["data"]]
    assert found == [
        (2, "context_length_exceeded", "body.prompt.1"),
        (3, "context_length_exceeded", "body.prompt.1"),
    ]
    assert jobs_of(batch["id"]) == 0


def job_of(core: Settings, prompt: Any, **params: Any) -> dict[str, Any]:
    made = call(
        "POST",
        "/v1/jobs",
        json={"prompt": prompt, "params": {"max_tokens": 3, "seed": 5, **params}},
    )
    assert made.status_code in (200, 201, 202), made.text
    job_id = made.json()["id"]

    def done() -> dict[str, Any] | None:
        job = call("GET", f"/v1/jobs/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed") else None

    job: dict[str, Any] = wait_until(done, 20, "the job to end", every=0.05)
    assert job["status"] == "succeeded", job
    return job


def test_a_job_of_token_ids_or_several_prompts_shows_every_choice(stack: Settings) -> None:
    ids = [11, 12, 13, 14, 15]
    one = job_of(stack, ids)
    assert one["result"]["usage"]["prompt_tokens"] == len(ids)
    assert one["result"]["usage"]["completion_tokens"] == 3
    prompts = [ids, [21, 22, 23]]
    alone = [job_of(stack, p, n=2, temperature=0.8) for p in prompts]
    several = job_of(stack, prompts, n=2, temperature=0.8)
    result = several["result"]
    assert result["choices"] is not None, result
    # Choice p*n + j is prompt p's j-th, the same as that prompt asked alone.
    assert [c["index"] for c in result["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in result["choices"]] == [
        c["text"] for a in alone for c in a["result"]["choices"]
    ]
    assert result["text"] == result["choices"][0]["text"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert result["usage"][key] == sum(a["result"]["usage"][key] for a in alone), key
    # Several prompts at n=1: still one choice each.
    pair = job_of(stack, ["Once upon a time", "Tell me"])
    assert [c["index"] for c in pair["result"]["choices"] or []] == [0, 1], pair
