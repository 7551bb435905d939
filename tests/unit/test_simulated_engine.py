"""The SIMULATED engine: determinism, priority admission, batching, stop strings, sampling
options, aborts; n, structured outputs, token-id prompts, echo and prompt logprobs."""

from __future__ import annotations

import asyncio
import json
import math
import time

import jsonschema
import pytest

from app.core.scheduling.tokens import (
    SIM_VOCABULARY,
    WORDS,
    Counter,
    ModelCard,
    count_words,
    encode,
)
from app.core.scheduling.tokens import decode as tokens_decode
from app.core.settings import Settings
from workers.engines.base import EngineRequestError, GenChunk, GenRequest, TokenWindow
from workers.engines.simulated import (
    VOCABULARY,
    CostModel,
    SimulatedEngine,
    decode,
    prompt_tokens_of,
)


async def _collect(engine: SimulatedEngine, req: GenRequest) -> tuple[str, str | None, int]:
    text, reason, tokens = "", None, 0
    async for chunk in engine.generate(req):
        text += chunk.text
        tokens += chunk.num_tokens
        reason = chunk.finish_reason
    return text, reason, tokens


def cost(**overrides: float) -> CostModel:
    return CostModel.from_settings(Settings(), **overrides)


def _fast(**kw: float) -> CostModel:
    return cost(base_ms=1.0, prefill_ms_per_token=0.0, decode_ms_per_seq=0.0, **kw)


def test_output_is_deterministic_from_prompt_and_seed() -> None:
    async def main() -> list[tuple[str, str | None, int]]:
        engine = SimulatedEngine(_fast())
        await engine.start()
        reqs = [
            GenRequest("a", prompt="hello there", max_tokens=12, seed=1),
            GenRequest("b", prompt="hello there", max_tokens=12, seed=1),
            GenRequest("c", prompt="hello there", max_tokens=12, seed=2),
        ]
        out = await asyncio.gather(*(_collect(engine, r) for r in reqs))
        await engine.shutdown()
        return out

    a, b, c = asyncio.run(main())
    assert a == b
    assert a[0] != c[0]
    assert a[1] == "length" and a[2] == 12


def test_waiting_requests_are_admitted_by_priority_then_arrival() -> None:
    async def main() -> list[str]:
        engine = SimulatedEngine(_fast(max_num_seqs=1))
        await engine.start()
        finished: list[str] = []

        async def run(rid: str, priority: int) -> None:
            await _collect(engine, GenRequest(rid, prompt="x", max_tokens=3, priority=priority))
            finished.append(rid)

        blocker = asyncio.create_task(run("blocker", 5))
        await asyncio.sleep(0.005)  # the blocker is running; the rest must wait
        others = [
            asyncio.create_task(run(rid, prio))
            for rid, prio in [("bulk1", 2), ("rt1", 0), ("std", 1), ("rt2", 0), ("bulk2", 2)]
        ]
        await asyncio.gather(blocker, *others)
        await engine.shutdown()
        return finished

    assert asyncio.run(main()) == ["blocker", "rt1", "rt2", "std", "bulk1", "bulk2"]


def test_concurrent_requests_share_steps() -> None:
    async def main() -> tuple[int, int]:
        engine = SimulatedEngine(_fast())
        await engine.start()
        await asyncio.gather(
            *(_collect(engine, GenRequest(str(i), prompt="p", max_tokens=20)) for i in range(32))
        )
        await engine.shutdown()
        return engine.steps, engine.max_batch

    steps, biggest = asyncio.run(main())
    assert biggest == 32
    assert steps < 32 * 20 / 4  # 640 tokens in a few dozen steps, not one step per token


def test_step_cost_follows_the_cost_model() -> None:
    model = cost(base_ms=6.0, prefill_ms_per_token=0.035, decode_ms_per_seq=0.17)
    assert model.step_ms(0, 67) == 6.0 + 0.17 * 67
    assert model.step_ms(1000, 0) == 6.0 + 35.0


def test_default_cost_model_matches_the_cited_h100_figure() -> None:
    """3400 tok/s at 19.75 ms ITL (~67 decoding) for Llama-3.1-8B on one H100 (docstring)."""
    model = cost()
    step_ms = model.step_ms(0, 67) * 1.14  # plus the ~14% prefill share of that run
    assert abs(step_ms - 19.75) / 19.75 < 0.05
    assert abs(67 / (step_ms / 1000) - 3400) / 3400 < 0.05


def test_stop_string_ends_the_sequence() -> None:
    async def main():
        engine = SimulatedEngine(_fast())
        await engine.start()
        full, _, _ = await _collect(engine, GenRequest("a", prompt="q", max_tokens=30, seed=3))
        stop = " " + full.split()[4]
        stopped = await _collect(
            engine, GenRequest("b", prompt="q", max_tokens=30, seed=3, stop=(stop,))
        )
        await engine.shutdown()
        return full, stop, stopped

    full, stop, (text, reason, _) = asyncio.run(main())
    assert reason == "stop"
    assert text == full[: full.index(stop)]


def test_sampling_options_act_as_in_vllm_or_are_refused() -> None:
    """min_tokens holds stop strings back, include_stop_str_in_output keeps the stop string,
    options that only shape the distribution change nothing, and stop_token_ids (which needs
    a vocabulary) fails its request by name."""

    async def main() -> tuple[str, ...]:
        engine = SimulatedEngine(_fast())
        await engine.start()

        async def text(rid: str, **kw: object) -> tuple[str, str | None, int]:
            req = GenRequest(rid, prompt="q", max_tokens=30, seed=3, **kw)  # type: ignore[arg-type]
            return await _collect(engine, req)

        full, _, _ = await text("full")
        stop = " " + full.split()[4]
        kept, reason, _ = await text(
            "kept", stop=(stop,), options={"include_stop_str_in_output": True}
        )
        assert reason == "stop"
        late, _, late_tokens = await text("late", stop=(stop,), options={"min_tokens": 6})
        shaped, _, _ = await text("shaped", options={"top_k": 5, "presence_penalty": 1.5})
        with pytest.raises(EngineRequestError) as refused:
            await text("ids", options={"stop_token_ids": [2]})
        await engine.shutdown()
        assert refused.value.code == "invalid_request"
        assert "stop_token_ids" in str(refused.value)
        return full, stop, kept, late, str(late_tokens), shaped

    full, stop, kept, late, late_tokens, shaped = asyncio.run(main())
    assert kept == full[: full.index(stop) + len(stop)]
    # The stop string's first occurrence is the 5th word: with min_tokens=6 it is passed over,
    # and the sequence ends at a later occurrence or at max_tokens.
    after = full.index(stop) + len(stop)
    assert int(late_tokens) >= 6 and late.startswith(full[:after])
    assert late == full[: full.find(stop, after)] if stop in full[after:] else late == full
    assert shaped == full


def test_abort_finishes_a_running_sequence() -> None:
    async def main() -> tuple[str | None, int]:
        engine = SimulatedEngine(cost(base_ms=5.0))
        await engine.start()
        task = asyncio.create_task(_collect(engine, GenRequest("a", prompt="q", max_tokens=10_000)))
        await asyncio.sleep(0.05)
        await engine.abort("a")
        _, reason, tokens = await task
        await engine.shutdown()
        return reason, tokens

    reason, tokens = asyncio.run(main())
    assert reason == "abort"
    assert 0 < tokens < 10_000


def test_the_kv_cache_bounds_how_many_run_at_once() -> None:
    """Each sequence holds prompt + max_tokens of the cache: with room for two (2 x 50 of 120),
    the third waits though max_num_seqs would take all five, and every one still finishes."""

    async def main() -> tuple[int, int, list[tuple[str, str | None, int]]]:
        engine = SimulatedEngine(_fast(kv_cache_tokens=120, max_num_seqs=256))
        await engine.start()
        prompt = " ".join(["word"] * 10)
        reqs = [GenRequest(f"r{i}", prompt=prompt, max_tokens=40) for i in range(5)]
        tasks = [asyncio.create_task(_collect(engine, r)) for r in reqs]
        most_running, most_waiting = 0, 0
        while not all(t.done() for t in tasks):
            stats = engine.stats()
            most_running = max(most_running, stats.running)
            most_waiting = max(most_waiting, stats.waiting)
            assert stats.kv_cache_usage <= 1.0
            await asyncio.sleep(0.0005)
        out = [t.result() for t in tasks]
        await engine.shutdown()
        return most_running, most_waiting, out

    most_running, most_waiting, out = asyncio.run(main())
    assert most_running == 2
    assert most_waiting >= 3
    assert all(reason == "length" and tokens == 40 for _, reason, tokens in out)


def test_a_sequence_larger_than_the_kv_cache_runs_alone() -> None:
    async def main() -> tuple[str, str | None, int]:
        engine = SimulatedEngine(_fast(kv_cache_tokens=20))
        await engine.start()
        out = await _collect(engine, GenRequest("big", prompt="a b c", max_tokens=30))
        await engine.shutdown()
        return out

    assert asyncio.run(main())[1:] == ("length", 30)


def test_the_token_window_keeps_its_sum_as_steps_come_and_go() -> None:
    window = TokenWindow(window=0.05)
    assert window.read() == (0, None)
    window.add(3)
    window.add(4)
    tokens, age = window.read()
    assert tokens == 7 and age is not None and age >= 0
    time.sleep(0.06)
    assert window.read() == (0, None)
    window.add(5)
    assert window.read()[0] == 5 and window.per_s() == pytest.approx(5 / 0.05)


def test_a_held_prefix_skips_its_prefill_and_is_counted_as_vllm_counts_it() -> None:
    """INFERQ_SIM_PREFIX_CACHE: a chat whose system prompt is held skips its prefill (all but
    the last prompt token), the counters say so, and the least recently used prefix goes."""
    system = "policy " * 400

    def chat(rid: str, lead: str) -> GenRequest:
        messages = [{"role": "system", "content": lead}, {"role": "user", "content": rid}]
        return GenRequest(rid, messages=messages, max_tokens=1)

    async def main() -> tuple[list[float], list[tuple[int, int]]]:
        engine = SimulatedEngine(cost(base_ms=0.0, decode_ms_per_seq=0.0, prefix_cache=1))
        await engine.start()
        took, counts = [], []
        for rid, lead in (("a", system), ("b", system), ("c", "other " * 400), ("d", system)):
            started = time.perf_counter()
            await _collect(engine, chat(rid, lead))
            took.append(time.perf_counter() - started)
            stats = engine.stats()
            counts.append((stats.prefix_cache_queries, stats.prefix_cache_hits))
        await engine.shutdown()
        return took, counts

    took, counts = asyncio.run(main())
    # a: computed; b: held, ~400 tokens of prefill skipped; c: another prefix takes the one
    # place; d: the first prefix was dropped, computed again.
    hits = [after[1] - before[1] for before, after in zip([(0, 0), *counts], counts, strict=False)]
    assert hits[0] == 0 and hits[1] >= 400 and hits[2] == 0 and hits[3] == 0
    assert counts[-1][0] > counts[-1][1] > 0
    assert took[1] < took[0] / 3 and took[3] > took[1] * 3


def test_no_prefix_cache_by_default() -> None:
    async def main() -> tuple[int, int]:
        engine = SimulatedEngine(cost(base_ms=0.0, prefill_ms_per_token=0.0))
        await engine.start()
        for rid in ("a", "b"):
            await _collect(engine, GenRequest(rid, prompt="x " * 300 + rid, max_tokens=1))
        stats = engine.stats()
        await engine.shutdown()
        return stats.prefix_cache_queries, stats.prefix_cache_hits

    assert asyncio.run(main()) == (0, 0)


async def _choices(engine: SimulatedEngine, req: GenRequest) -> tuple[list[GenChunk], dict]:
    """Every chunk of ``req``, and each choice's (text, finish_reason, stop_reason, tokens)."""
    chunks = [chunk async for chunk in engine.generate(req)]
    choices: dict[int, list] = {}
    for chunk in chunks:
        text, _, _, tokens = choices.get(chunk.index, ("", None, None, 0))
        choices[chunk.index] = [
            text + chunk.text,
            chunk.finish_reason,
            chunk.stop_reason,
            tokens + chunk.num_tokens,
        ]
    return chunks, choices


def _run(*reqs: GenRequest) -> list[tuple[list[GenChunk], dict]]:
    async def main() -> list[tuple[list[GenChunk], dict]]:
        engine = SimulatedEngine(_fast())
        await engine.start()
        try:
            return [await _choices(engine, req) for req in reqs]
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_n_streams_that_many_choices_each_its_own_text() -> None:
    (chunks, choices), (_, again), (_, one) = _run(
        GenRequest("a", prompt="hello", max_tokens=6, seed=4, options={"n": 3}),
        GenRequest("b", prompt="hello", max_tokens=6, seed=4, options={"n": 3}),
        GenRequest("c", prompt="hello", max_tokens=6, seed=4),
    )
    assert sorted(choices) == [0, 1, 2] and choices == again
    assert len({c[0] for c in choices.values()}) == 3
    assert all(c[1] == "length" and c[3] == 6 for c in choices.values())
    assert choices[0] == one[0]  # choice 0 is what n=1 writes
    # The choices stream side by side (each of the cost model's sequences), not one after another.
    assert [c.index for c in chunks[:3]] == [0, 1, 2]


def test_n_choices_all_end_when_the_request_is_aborted() -> None:
    async def main() -> dict:
        engine = SimulatedEngine(cost(base_ms=5.0))
        await engine.start()
        req = GenRequest("a", prompt="q", max_tokens=10_000, options={"n": 2})
        task = asyncio.create_task(_choices(engine, req))
        await asyncio.sleep(0.05)
        await engine.abort("a")
        _, choices = await task
        await engine.shutdown()
        assert not engine._by_id
        return choices

    choices = asyncio.run(main())
    assert {i: c[1] for i, c in choices.items()} == {0: "abort", 1: "abort"}


def test_json_object_is_valid_json_that_fits_max_tokens() -> None:
    reqs = [
        GenRequest(
            f"{seed}.{most}",
            prompt="give me JSON",
            max_tokens=most,
            seed=seed,
            options={"structured_outputs": {"json_object": True}, "n": 2},
        )
        for seed in range(6)
        for most in (3, 8, 16, 64)
    ]
    for req, (_, choices) in zip(reqs, _run(*reqs), strict=True):
        for text, reason, stop_reason, tokens in choices.values():
            assert isinstance(json.loads(text), dict), text
            # Ended by the end-of-sequence token after the object, within max_tokens.
            assert (reason, stop_reason) == ("stop", None) and tokens <= req.max_tokens
    # Too few tokens for {} and the end of sequence: a prefix, cut at max_tokens, as vLLM would.
    json_object = {"structured_outputs": {"json_object": True}}
    (_, one), (_, two), (_, compact) = _run(
        GenRequest("x", prompt="q", max_tokens=1, options=json_object),
        GenRequest("y", prompt="q", max_tokens=2, options=json_object),
        GenRequest(
            "z",
            prompt="q",
            max_tokens=30,
            seed=1,
            options={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
        ),
    )
    assert one[0][:2] == ["{", "length"] and two[0][:2] == ["{}", "length"]
    assert " " not in compact[0][0] and isinstance(json.loads(compact[0][0]), dict)


def test_a_json_schema_is_followed_and_other_constraints_are_refused() -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 18, "exclusiveMaximum": 30},
            "score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 2,
            },
            "pet": {"anyOf": [{"type": "null"}, {"type": "string"}]},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "age", "score", "tags"],
    }
    reqs = [
        GenRequest(
            str(seed),
            prompt="q",
            max_tokens=200,
            seed=seed,
            options={"structured_outputs": {"json": schema}},
        )
        for seed in range(5)
    ]
    for _, choices in _run(*reqs):
        jsonschema.validate(json.loads(choices[0][0]), schema)
        assert choices[0][1] == "stop"
    (_, chosen), (_, short) = _run(
        GenRequest(
            "c", prompt="q", seed=1, options={"structured_outputs": {"choice": ["yes", "no way"]}}
        ),
        GenRequest("s", prompt="q", max_tokens=3, options={"structured_outputs": {"json": schema}}),
    )
    assert chosen[0][:2] in (["yes", "stop"], ["no way", "stop"])
    assert short[0][1] == "length" and short[0][3] == 3

    async def refused(options: dict) -> EngineRequestError:
        engine = SimulatedEngine(_fast())
        await engine.start()
        try:
            with pytest.raises(EngineRequestError) as error:
                await _choices(engine, GenRequest("r", prompt="q", options=options))
            return error.value
        finally:
            await engine.shutdown()

    regex = asyncio.run(refused({"structured_outputs": {"regex": "a+"}}))
    pattern = asyncio.run(
        refused({"structured_outputs": {"json": {"type": "string", "pattern": "^a$"}}})
    )
    assert regex.code == pattern.code == "invalid_request"
    assert "regex" in str(regex) and "pattern" in str(pattern)


def test_a_prompt_of_token_ids_is_the_text_of_its_words() -> None:
    ids = [0, 1, 2, 7, len(VOCABULARY) + 3]  # ids wrap round the vocabulary
    text = decode(ids)
    assert text.split() == [VOCABULARY[i % len(VOCABULARY)] for i in ids]
    assert count_words(text) == len(ids)
    (by_ids, ids_choices), (by_text, text_choices) = _run(
        GenRequest("i", prompt=ids, max_tokens=8, seed=5, echo=True),
        GenRequest("t", prompt=text, max_tokens=8, seed=5, echo=True),
    )
    assert ids_choices == text_choices
    assert by_ids[0].prompt_tokens == by_text[0].prompt_tokens == len(ids)
    # echo: the first chunk says the prompt (ids decoded), later ones nothing.
    assert by_ids[0].prompt_text == by_text[0].prompt_text == text
    assert all(c.prompt_text is None for c in by_ids[1:])

    async def refused(prompt: list[int]) -> EngineRequestError:
        engine = SimulatedEngine(_fast())
        await engine.start()
        try:
            with pytest.raises(EngineRequestError) as error:
                await _choices(engine, GenRequest("r", prompt=prompt))
            return error.value
        finally:
            await engine.shutdown()

    negative = asyncio.run(refused([3, -1]))
    assert negative.code == "invalid_token_ids" and "-1 is out of vocabulary" in str(negative)
    assert asyncio.run(refused([])).code == "invalid_request"


def test_echo_of_a_chat_is_the_assistants_last_message() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Well,"}]
    (chunks, _), (plain, _) = _run(
        GenRequest("c", messages=messages, echo=True, options={"n": 2}),
        GenRequest("p", messages=messages[:1], echo=True),
    )
    assert chunks[0].prompt_text == "Well," and plain[0].prompt_text == ""
    assert all(c.prompt_text is None for c in chunks[1:])


def test_prompt_logprobs_give_every_prompt_token_its_rank_and_the_best_alternatives() -> None:
    prompt = "The queue holds\nevery job, until"
    (chunks, _), (again, _), (ids_chunks, _) = _run(
        GenRequest("a", prompt=prompt, max_tokens=2, options={"prompt_logprobs": 3, "n": 2}),
        GenRequest("b", prompt=prompt, max_tokens=2, seed=9, options={"prompt_logprobs": 3}),
        GenRequest("i", prompt=[0, 1, 2], max_tokens=2, options={"prompt_logprobs": 0}),
    )
    scored = chunks[0].prompt_logprobs
    assert scored is not None and all(c.prompt_logprobs is None for c in chunks[1:])
    assert scored == again[0].prompt_logprobs  # the prompt's, whatever the seed
    assert len(scored) == chunks[0].prompt_tokens == count_words(prompt)
    assert "".join(t["token"] for t in scored) == prompt  # each token with its whitespace
    assert scored[0] == {
        "token_id": scored[0]["token_id"],
        "token": "The",
        "logprob": None,
        "rank": None,
        "top_logprobs": [],
    }
    for entry in scored[1:]:
        top = entry["top_logprobs"]
        assert [t["rank"] for t in top] == [1, 2, 3]
        values = [t["logprob"] for t in top]
        assert values == sorted(values, reverse=True) and all(v < 0 for v in values)
        assert sum(math.exp(v) for v in values) < 1
        ids = [t["token_id"] for t in top]
        assert len(set(ids)) == 3
        own = entry["rank"] <= 3
        assert (entry["token_id"] in ids) == own
        if own:
            assert top[entry["rank"] - 1]["logprob"] == entry["logprob"]
        else:
            assert entry["logprob"] < values[-1]
    by_ids = ids_chunks[0].prompt_logprobs
    assert by_ids is not None
    assert [t["token"] for t in by_ids] == ["the", " queue", " holds"]
    assert [t["token_id"] for t in by_ids] == [0, 1, 2]
    assert all(t["top_logprobs"] == [] for t in by_ids)


def test_the_stop_string_that_ended_a_choice_is_its_stop_reason() -> None:
    ((_, full),) = _run(GenRequest("a", prompt="q", max_tokens=30, seed=3))
    words = full[0][0].split()
    stops = (" " + words[6], " " + words[4])
    # The one that ends first in the text wins, as in vLLM.
    first = min(stops, key=lambda stop: full[0][0].find(stop) + len(stop))
    ((_, stopped),) = _run(GenRequest("b", prompt="q", max_tokens=30, seed=3, stop=stops))
    assert stopped[0][:3] == [full[0][0][: full[0][0].find(first)], "stop", first]
    assert full[0][2] is None


def test_the_vocabulary_and_ids_are_those_the_api_tokenizes_with() -> None:
    """/tokenize and /detokenize (app/core/scheduling/tokens.py) give the engine's ids."""
    assert VOCABULARY == SIM_VOCABULARY
    counter = Counter(ModelCard("m", 100, WORDS), None)
    text = "the queue, holds zebra\n every job"
    ids, _ = encode(counter, text)
    assert [t[0] for t in prompt_tokens_of(text)] == ids
    assert tokens_decode(counter, ids) == decode(ids)


def _check_logprobs(chunks: list[GenChunk], k: int) -> None:
    """Each chunk's logprobs: one per token of its text, the texts its text; the k best
    alternatives best first, the token among them at its logprob or below the last."""
    for chunk in chunks:
        if chunk.num_tokens == 0:
            assert not chunk.logprobs
            continue
        assert chunk.logprobs is not None and len(chunk.logprobs) == chunk.num_tokens
        assert "".join(t["token"] for t in chunk.logprobs) == chunk.text
        for entry in chunk.logprobs:
            top = entry["top_logprobs"]
            values = [t["logprob"] for t in top]
            assert len(top) == k and values == sorted(values, reverse=True)
            assert entry["logprob"] <= 0 and all(v <= 0 for v in values)
            assert sum(math.exp(v) for v in values) < 1
            if entry["logprob"] in values:
                assert top[values.index(entry["logprob"])]["token"] == entry["token"]
            elif top:
                assert entry["logprob"] < values[-1]


def test_logprobs_give_every_output_token_its_logprob_and_the_best_alternatives() -> None:
    prompt = "The queue holds every job"
    (chunks, choices), (again, same), (_, plain), (greedy, _), (ids_chunks, _) = _run(
        GenRequest("a", prompt=prompt, max_tokens=12, seed=5, options={"logprobs": 3, "n": 2}),
        GenRequest("b", prompt=prompt, max_tokens=12, seed=5, options={"logprobs": 3, "n": 2}),
        GenRequest("c", prompt=prompt, max_tokens=12, seed=5, options={"n": 2}),
        GenRequest("g", prompt=prompt, max_tokens=12, temperature=0.0, options={"logprobs": 2}),
        GenRequest("i", prompt=[0, 1, 2], max_tokens=4, options={"logprobs": 0}),
    )
    _check_logprobs(chunks, 3)
    _check_logprobs(greedy, 2)
    _check_logprobs(ids_chunks, 0)
    assert choices == plain  # the text is the same with logprobs or without
    assert [c.logprobs for c in chunks] == [c.logprobs for c in again] and choices == same
    assert all(c.logprobs is None for c in _run(GenRequest("p", prompt=prompt))[0][0])
    # A sampled token is not always the best; a greedy one is.
    sampled = [e for c in chunks for e in c.logprobs or ()]
    assert any(e["top_logprobs"][0]["token"] != e["token"] for e in sampled)
    assert all(
        e["top_logprobs"][0] == {"token": e["token"], "logprob": e["logprob"]}
        for c in greedy
        for e in c.logprobs or ()
    )
    # The first token has no space before it, nor have its alternatives; the others have one.
    first = next(c for c in chunks if c.index == 1 and c.num_tokens).logprobs
    assert first is not None
    assert all(not t["token"].startswith(" ") for t in first[0]["top_logprobs"])
    later = [c for c in chunks if c.num_tokens][-1].logprobs
    assert later is not None
    assert all(t["token"].startswith(" ") for t in later[0]["top_logprobs"])


def test_logprobs_join_into_the_text_a_stop_string_or_a_structure_ends() -> None:
    ((_, full),) = _run(GenRequest("a", prompt="q", max_tokens=30, seed=3))
    words = full[0][0].split()
    stop = words[4][:2]  # ends inside a token: the token is cut, and so is its text
    (stopped, choices), (shaped, objects) = _run(
        GenRequest("b", prompt="q", max_tokens=30, seed=3, stop=(stop,), options={"logprobs": 1}),
        GenRequest(
            "j",
            prompt="q",
            max_tokens=30,
            options={"logprobs": 1, "n": 2, "structured_outputs": {"json_object": True}},
        ),
    )
    assert choices[0][1:3] == ["stop", stop]
    _check_logprobs(stopped, 1)
    _check_logprobs(shaped, 1)
    for index, choice in objects.items():
        tokens = [e["token"] for c in shaped if c.index == index for e in c.logprobs or ()]
        assert "".join(tokens) == choice[0] and tokens[-1] == ""  # its end of sequence
        json.loads(choice[0])
