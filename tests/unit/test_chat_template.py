"""Chats rendered as vLLM renders them (issue 64): text parts one newline apart, the developer
role as system for a template that does not know it (workers/engines/base.py render_chat), and
``POST /tokenize`` with ``messages`` rendered by the API from the template the worker publishes
(app/core/contract/chat_template.py), checked against transformers' apply_chat_template on a
real tokenizer with the demo model's template."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from app.core.contract import chat_template
from app.core.contract.chat import ChatMessage
from app.core.messaging import clients
from app.core.scheduling import tokens
from app.core.settings import Settings
from tests.unit.inprocess import call
from workers.engines.base import chat_template_card, render_chat
from workers.engines.demo import CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

TEXT = "<|user|> Hello there, be brief. get_weather city Paris <|assistant|>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """A byte-level BPE whose ``<s>`` starts every text it encodes with special tokens, with
    the demo model's chat template."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<s>", "</s>"],
    )
    bpe.train_from_iterator([TEXT] * 50, trainer)
    bpe.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bpe.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": None,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_text_parts_join_with_a_newline_as_vllm() -> None:
    parts = [
        {"type": "text", "text": "Hello"},
        {"type": "text", "text": ""},
        {"type": "text", "text": " there"},
    ]
    assert ChatMessage(role="user", content=parts).content == "Hello\n there"  # type: ignore[arg-type]
    assert ChatMessage(role="user", content="a").text() == "a"


def test_developer_is_system_for_a_template_that_does_not_know_it(tokenizer: Any) -> None:
    chat = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_chat(chat, tokenizer) == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    # Systems after the first message move first, merged (vLLM's _consolidate_system_messages).
    later = [
        {"role": "system", "content": "A"},
        {"role": "user", "content": "Hi"},
        {"role": "developer", "content": "B"},
    ]
    assert render_chat(later, tokenizer) == "<|system|>\nA\n\nB\n<|user|>\nHi\n<|assistant|>\n"
    # Without a developer message nothing moves.
    plain = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "A"}]
    assert render_chat(plain, tokenizer) == "<|user|>\nHi\n<|system|>\nA\n<|assistant|>\n"
    # A template that names the role keeps it.
    knowing = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    knowing.chat_template = CHAT_TEMPLATE + "{# 'developer' #}"
    assert render_chat(chat, knowing).startswith("<|developer|>\nBe brief.\n")


CASES: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hello!"}], {}),
    ([{"role": "user", "content": "Hello!"}], {"add_generation_prompt": False}),
    ([{"role": "user", "content": "Weather?"}], {"tools": TOOLS}),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        ],
        {"tools": TOOLS},
    ),
    (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello th"}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
]


def _as_vllm(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation vLLM hands transformers (content a string, arguments an object)."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


@pytest.mark.parametrize(("messages", "options"), CASES)
def test_the_api_renders_as_transformers(
    tokenizer: Any, messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    card = chat_template_card(tokenizer)
    assert card is not None and card["formats"] == {"": "string"}
    assert card["special_tokens"]["bos_token"] == "<s>"
    generation = options.get("add_generation_prompt", True)
    expected = tokenizer.apply_chat_template(
        _as_vllm(messages),
        tools=options.get("tools"),
        tokenize=False,
        add_generation_prompt=generation,
        continue_final_message=options.get("continue_final_message", False),
    )
    got = chat_template.render(
        card,
        messages,
        options.get("tools"),
        add_generation_prompt=generation,
        continue_final_message=options.get("continue_final_message", False),
    )
    assert got == expected


def test_refusals(tokenizer: Any) -> None:
    card = chat_template_card(tokenizer)
    assert card is not None
    with pytest.raises(chat_template.TemplateError, match="not compatible"):
        chat_template.render(card, [{"role": "user", "content": "x"}], continue_final_message=True)
    with pytest.raises(chat_template.TemplateError, match="empty conversation"):
        chat_template.render(card, [])
    refusing = {**card, "templates": {"": "{{ raise_exception('no way') }}"}}
    with pytest.raises(chat_template.TemplateError, match="no way"):
        chat_template.render(refusing, [{"role": "user", "content": "x"}])
    with pytest.raises(chat_template.Unsupported):
        chat_template.render(
            {**card, "formats": {"": "openai"}}, [{"role": "user", "content": "x"}]
        )


def test_tokenize_messages_as_vllm(core: Settings, tokenizer: Any) -> None:
    card = chat_template_card(tokenizer)
    tokens.publish(
        clients.redis_client(),
        core.model_name,
        64,
        tokenizer.backend_tokenizer.to_str(),
        chat_template=card,
    )
    clients.reset()
    messages = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}],
        },
    ]
    text = "<|system|>\nBe brief.\n<|user|>\nHello\nthere\n<|assistant|>\n"
    asked = call("POST", "/tokenize", json={"messages": messages, "return_token_strs": True})
    assert asked.status_code == 200, asked.text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert asked.json() == {
        "count": len(ids),
        "max_model_len": 64,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    bos = call("POST", "/tokenize", json={"messages": messages, "add_special_tokens": True})
    assert bos.json()["tokens"] == tokenizer(text)["input_ids"] == [tokenizer.bos_token_id, *ids]
    # Tools as vLLM dumps them: a missing description is null in the template's JSON.
    tool = {"type": "function", "function": {"name": "get_weather"}}
    with_tools = call("POST", "/tokenize", json={"messages": messages[1:], "tools": [tool]})
    dumped = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": None, "parameters": None},
        }
    ]
    rendered = tokenizer.apply_chat_template(
        _as_vllm([{"role": "user", "content": "Hello\nthere"}]),
        tools=dumped,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert with_tools.json()["tokens"] == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    both = call(
        "POST",
        "/tokenize",
        json={"messages": messages, "continue_final_message": True, "add_generation_prompt": True},
    )
    assert both.status_code == 422 and "Cannot set both" in both.json()["error"]["message"]
    untrusted = call("POST", "/tokenize", json={"messages": messages, "chat_template": "x"})
    assert untrusted.status_code == 422, untrusted.text
