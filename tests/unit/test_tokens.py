"""app/core/scheduling/tokens.py against a real Redis and a real (freshly trained) byte-level BPE
tokenizer."""

from __future__ import annotations

import hashlib
import itertools

import pytest
import redis
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from app.core.contract.jobs import JobCreate
from app.core.errors import DomainError, Kind
from app.core.messaging import names
from app.core.scheduling import tokens

_names = itertools.count()


def model_name() -> str:
    # The API caches cards per model for CARD_CACHE_S: every test serves a model of its own.
    return f"model-{next(_names)}"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(["the queue holds every job until a worker claims it"] * 50, trainer)
    return bpe


def body(**fields: object) -> JobCreate:
    return JobCreate.model_validate(fields)


def test_counts_a_prompt_as_the_published_tokenizer_does(
    redis_url: str, tokenizer: Tokenizer
) -> None:
    store = redis.Redis.from_url(redis_url)
    name = model_name()
    source = tokenizer.to_str()
    card = tokens.publish(store, name, 12, source)
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert card.tokenizer == f"sha256:{digest}"
    assert store.get(f"inferq:tokenizer:{digest}") == source.encode()

    fits = "the queue holds every job"
    assert tokens.check(store, [name], [body(prompt=fits)]) == [len(tokenizer.encode(fits).ids)]
    over = "zebra quokka " * 4  # unseen words: many byte-level tokens
    assert len(tokenizer.encode(over).ids) >= 12
    with pytest.raises(DomainError) as refused:
        tokens.check(store, [name, name], [body(prompt=fits), body(prompt=over)], "jobs")
    assert (refused.value.kind, refused.value.code) == (Kind.INVALID, "context_length_exceeded")
    assert refused.value.param == "jobs.1.prompt"


def test_messages_count_their_contents(redis_url: str, tokenizer: Tokenizer) -> None:
    store = redis.Redis.from_url(redis_url)
    name = model_name()
    tokens.publish(store, name, 100, tokenizer.to_str())
    chat = body(
        messages=[{"role": "system", "content": "a worker"}, {"role": "user", "content": "the job"}]
    )
    expected = len(tokenizer.encode("a worker").ids) + len(tokenizer.encode("the job").ids)
    assert tokens.check(store, [name], [chat]) == [expected]


def test_the_simulated_word_counter(redis_url: str) -> None:
    store = redis.Redis.from_url(redis_url)
    name = model_name()
    tokens.publish(store, name, 4, tokens.WORDS)
    assert tokens.check(store, [name], [body(prompt="one, two")]) == [3]
    with pytest.raises(DomainError) as refused:
        tokens.check(store, [name], [body(messages=[{"role": "user", "content": "a b c d"}])])
    assert refused.value.param == "messages"


def test_without_a_usable_card_nothing_is_refused(redis_url: str) -> None:
    """No card, or one this API cannot read: estimates only; the engine stays the judge."""
    store = redis.Redis.from_url(redis_url)
    long = body(prompt="x" * 4000)
    assert tokens.check(store, [model_name()], [long]) == [1000]
    broken = model_name()
    tokens.publish(store, broken, 10, '{"not": "a tokenizer"}')
    assert tokens.check(store, [broken], [long]) == [1000]
    gone = model_name()
    card = tokens.publish(store, gone, 10, "{}")
    store.delete(names.TOKENIZER_KEY_PREFIX + card.tokenizer.removeprefix("sha256:"))
    assert tokens.check(store, [gone], [long]) == [1000]
