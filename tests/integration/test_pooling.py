"""Batches of embeddings, reranks and scores end to end with the official ``openai`` client: a
real API, the ops worker and simulated pooling workers (SIMULATED) in processes of their own,
on SQLite and PostgreSQL (docs/openai.md, "Batches of embeddings")."""

from __future__ import annotations

import base64
import io
import json
import struct
import time
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI
from openai.types import CreateEmbeddingResponse

from tests.conftest import PostgresDatabases, backend_stack_for
from tests.support import Stack

EMBED, RANK = "emb", "rank"
GROUP = 16  # INFERQ_BATCH_EMBED_GROUP here (256 by default)
MOST_INPUTS = 2000  # INFERQ_BATCH_MAX_EMBEDDING_INPUTS here (50,000 by default)


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
        "pooling",
        ops=True,
        workers=0,
        batch_sweep_interval_s=0.3,
        batch_embed_group=GROUP,
        batch_max_embedding_inputs=MOST_INPUTS,
    ) as s:
        s.start_worker(served_model_name=EMBED, model_task="embed", max_model_len=64)
        s.start_worker(served_model_name=RANK, model_task="score")
        yield s


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def run_batch(client: OpenAI, endpoint: str, lines: list[dict[str, Any]]) -> Any:
    """Upload ``lines`` (each with its custom_id and body), run them, wait for the end."""
    data = "".join(
        json.dumps({"custom_id": line["custom_id"], "method": "POST", "url": endpoint, **line})
        + "\n"
        for line in lines
    ).encode()
    source = client.files.create(file=("lines.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=source.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)
        batch = client.batches.retrieve(batch.id)
    return batch


def outputs(client: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_of_embeddings_runs_grouped_and_answers_each_line_in_openais_shape(
    client: OpenAI, stack: Stack
) -> None:
    lines = [
        {"custom_id": f"doc-{i}", "body": {"model": EMBED, "input": f"document {i} about queues"}}
        for i in range(100)
    ]
    lines[10]["body"]["input"] = ["first of three", "second of three", "third"]
    lines[11]["body"]["encoding_format"] = "base64"
    lines[12]["body"]["input"] = [f"input {j}" for j in range(40)]  # over a group: a job of its own
    batch = run_batch(client, "/v1/embeddings", lines)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (100, 0)
    answers = outputs(client, batch.output_file_id)
    assert [a["custom_id"] for a in answers] == [line["custom_id"] for line in lines]
    assert len({a["id"] for a in answers}) == 100
    realtime = client.embeddings.create(
        model=EMBED, input=["document 0 about queues", "third"], encoding_format="float"
    )
    for answer, line in zip(answers, lines, strict=True):
        assert answer["error"] is None and answer["response"]["status_code"] == 200
        raw = answer["response"]["body"]
        if line["body"].get("encoding_format") == "base64":
            # Little-endian float32, as the SDK decodes it before it builds its types.
            for d in raw["data"]:
                packed = base64.b64decode(d["embedding"])
                d["embedding"] = list(struct.unpack(f"<{len(packed) // 4}f", packed))
        body = CreateEmbeddingResponse.model_validate(raw)
        given = line["body"]["input"]
        items = [given] if isinstance(given, str) else given
        assert [d.index for d in body.data] == list(range(len(items)))
        # The simulated model counts words: each line's usage is its own inputs'.
        assert body.usage.prompt_tokens == sum(len(item.split()) for item in items)
        for d in body.data:
            assert sum(v * v for v in d.embedding) == pytest.approx(1.0, rel=1e-5)
    # A line's vector is the one a realtime call gets for the same text.
    first = CreateEmbeddingResponse.model_validate(answers[0]["response"]["body"])
    assert first.data[0].embedding == realtime.data[0].embedding
    third = CreateEmbeddingResponse.model_validate(answers[10]["response"]["body"])
    assert third.data[2].embedding == realtime.data[1].embedding
    # Grouped: far fewer jobs than lines, each carrying its lines.
    jobs = stack.scalar("SELECT count(*) FROM jobs WHERE batch_id = :b", b=batch.id)
    carried = stack.scalar("SELECT sum(line_count) FROM jobs WHERE batch_id = :b", b=batch.id)
    assert carried == 100 and jobs < 100 / 2, jobs


def test_rerank_and_score_lines_answer_as_their_endpoints_do(client: OpenAI, stack: Stack) -> None:
    documents = ["queues hold jobs", "a cat", "workers claim jobs from queues"]
    reranked = run_batch(
        client,
        "/v1/rerank",
        [
            {"custom_id": "r1", "body": {"model": RANK, "query": "queues", "documents": documents}},
            {
                "custom_id": "r2",
                "body": {"model": RANK, "query": "cats", "documents": documents, "top_n": 1},
            },
        ],
    )
    assert reranked.status == "completed", reranked
    r1, r2 = (a["response"]["body"] for a in outputs(client, reranked.output_file_id))
    scores = [r["relevance_score"] for r in r1["results"]]
    assert scores == sorted(scores, reverse=True) and len(r1["results"]) == 3
    assert {r["document"]["text"] for r in r1["results"]} == set(documents)
    assert len(r2["results"]) == 1 and r2["usage"]["prompt_tokens"] > 0
    scored = run_batch(
        client,
        "/v1/score",
        [{"custom_id": "s", "body": {"model": RANK, "text_1": "queues", "text_2": documents}}],
    )
    [answer] = outputs(client, scored.output_file_id)
    data = answer["response"]["body"]["data"]
    assert [d["index"] for d in data] == [0, 1, 2]
    by_index = {r["index"]: r["relevance_score"] for r in r1["results"]}
    assert [d["score"] for d in data] == pytest.approx([by_index[i] for i in range(3)])


@pytest.mark.parametrize(
    ("lines", "code"),
    [
        (
            [
                {"custom_id": "a", "body": {"model": EMBED, "input": ["x"] * 1500}},
                {"custom_id": "b", "body": {"model": EMBED, "input": ["y"] * 501}},
            ],
            "too_many_inputs",
        ),
        (
            [{"custom_id": "long", "body": {"model": EMBED, "input": "word " * 80}}],
            "context_length_exceeded",
        ),
        ([{"custom_id": "chat", "body": {"model": "inferq-demo", "input": "hi"}}], "wrong_task"),
        ([{"custom_id": "empty", "body": {"model": EMBED, "input": ""}}], None),
    ],
    ids=["too-many-inputs", "too-long", "wrong-task", "empty-input"],
)
def test_a_bad_line_fails_the_batch_by_its_line_and_starts_no_job(
    client: OpenAI, stack: Stack, lines: list[dict[str, Any]], code: str | None
) -> None:
    batch = run_batch(client, "/v1/embeddings", lines)
    assert batch.status == "failed", batch
    [error] = batch.errors.data
    assert error.line == len(lines) and error.message
    if code is not None:
        assert error.code == code
    assert stack.scalar("SELECT count(*) FROM jobs WHERE batch_id = :b", b=batch.id) == 0
