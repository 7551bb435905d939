"""vLLM's utility endpoints its clients call: ``POST /tokenize``, ``POST /detokenize`` and
``GET /version``, answered as ``vllm serve`` answers them (vllm/entrypoints/serve/tokenize/).

The API holds no model: it tokenizes with the tokenizer the model's workers publish in its
model card (app/core/scheduling/tokens.py), the one it counts prompt tokens with, so a prompt's
``count`` here is its ``prompt_tokens`` on /v1/completions. An adapter tokenizes as its base
model. Chat ``messages`` are rendered with the chat template the workers publish in the card,
as vLLM renders them (app/core/contract/chat_template.py), then tokenized without the
tokenizer's special tokens unless ``add_special_tokens`` (vLLM's default for a chat); a model
whose card has no template, or one not rendered exactly here, is refused (docs/openai.md,
"Tokenize, detokenize, version").
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from app import __version__
from app.core.contract import chat_template
from app.core.contract.chat import ChatMessage, Tool
from app.core.errors import DomainError, Kind, unavailable
from app.core.messaging import clients
from app.core.models import valid_text
from app.core.scheduling import catalog, tokens
from app.core.settings import get_settings


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) and ``TokenizeChatRequest``
    (``messages``, ``tools``, ``add_generation_prompt``, ``continue_final_message``). Fields
    vLLM does not know are ignored, as vLLM's server ignores them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_generation_prompt: bool | None = None  # vLLM's default: true
    continue_final_message: bool = False
    # vLLM's default: true for a prompt, false for messages (their template adds its own).
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    # What vLLM refuses without --trust-request-chat-template, and inferq does not take.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Each message's content as sent (its text parts apart, as vLLM parses them); set from
    # ``messages``, never by the caller.
    sent_contents: list[Any] | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _keep_contents(cls, data: Any) -> Any:
        if isinstance(data, dict):
            messages = data.get("messages")
            data = {
                **data,
                "sent_contents": [
                    m.get("content") if isinstance(m, dict) else None for m in messages
                ]
                if isinstance(messages, list)
                else None,
            }
        return data


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]


def _counter(requested: str | None) -> tokens.Counter:
    """The counter of the model a call names (its base's, for an adapter); 404 for a model
    nobody serves, 503 while no worker of it has published its tokenizer."""
    model = catalog.resolve(requested)
    base = get_settings().base_of(model)
    found = tokens.counter(clients.redis_client(), base)
    if found is None:
        raise unavailable(
            "tokenizer_unavailable",
            f"the tokenizer of {model!r} is not known yet: a worker of {base!r} publishes it "
            "once its engine is up (GET /v1/models shows max_model_len then); retry later",
            param="model",
        )
    return found


def _tool_dump(tool: Tool) -> dict[str, Any]:
    """A tool as vLLM hands it to the template (``ChatCompletionToolsParam.model_dump``):
    ``description`` and ``parameters`` even when null, ``strict`` only when set."""
    function = tool.function.model_dump()
    if function.get("strict") is None:
        function.pop("strict", None)
    return {"type": tool.type, "function": function}


def _tokenize_chat(body: TokenizeRequest, messages: list[ChatMessage]) -> dict[str, Any]:
    """vLLM's ``TokenizeChatRequest``: the messages rendered by the model's chat template."""
    if body.chat_template is not None or (body.chat_template_kwargs or {}).get("chat_template"):
        raise DomainError(
            Kind.INVALID,
            "invalid_request",
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    if body.chat_template_kwargs:
        raise DomainError(
            Kind.INVALID,
            "unsupported_parameter",
            "chat_template_kwargs is not supported on /tokenize",
            param="chat_template_kwargs",
        )
    if body.continue_final_message and body.add_generation_prompt:
        raise DomainError(
            Kind.INVALID,
            "invalid_request",
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    found = _counter(body.model)
    card = found.card.chat_template
    if card is None:
        raise DomainError(
            Kind.INVALID,
            "unsupported_parameter",
            f"messages: {found.card.model!r} has no chat template its workers publish; "
            "tokenize the rendered prompt instead",
            param="messages",
        )
    tools = [_tool_dump(tool) for tool in body.tools] if body.tools else None
    try:
        text = chat_template.render(
            card,
            [
                m.model_dump(exclude_none=True) | {"content": sent}
                for m, sent in zip(messages, body.sent_contents or [], strict=True)
            ],
            tools,
            add_generation_prompt=(
                True if body.add_generation_prompt is None else body.add_generation_prompt
            ),
            continue_final_message=body.continue_final_message,
        )
    except chat_template.Unsupported as exc:
        raise DomainError(
            Kind.INVALID,
            "unsupported_parameter",
            f"messages: {exc}, which /tokenize does not render; tokenize the rendered prompt "
            "instead",
            param="messages",
        ) from None
    except chat_template.TemplateError as exc:
        raise DomainError(Kind.INVALID, "invalid_request", str(exc), param="messages") from None
    return _answer(found, text, bool(body.add_special_tokens), body.return_token_strs)


def tokenize(body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``: count, max_model_len, tokens, token_strs."""
    if body.messages is not None and body.prompt is None:
        return _tokenize_chat(body, body.messages)
    if body.prompt is None:
        raise DomainError(Kind.INVALID, "missing", "prompt: field required", param="prompt")
    found = _counter(body.model)
    if not valid_text(body.prompt):
        raise DomainError(
            Kind.INVALID,
            "invalid_text",
            "prompt: text must be valid Unicode (no lone surrogates)",
            param="prompt",
        )
    specials = True if body.add_special_tokens is None else body.add_special_tokens
    return _answer(found, body.prompt, specials, body.return_token_strs)


def _answer(found: tokens.Counter, text: str, specials: bool, strs: bool | None) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse`` of ``text`` (``specials``: the tokenizer's special tokens;
    ``strs``: each token's string too)."""
    ids, token_strs = tokens.encode(found, text, specials)
    return {
        "count": len(ids),
        "max_model_len": found.card.max_model_len,
        "tokens": ids,
        "token_strs": token_strs if strs else None,
    }


def detokenize(body: DetokenizeRequest) -> dict[str, str]:
    """vLLM's ``DetokenizeResponse``: the prompt the token ids make."""
    return {"prompt": tokens.decode(_counter(body.model), body.tokens)}


def version() -> dict[str, str]:
    """``{"version": ...}`` as vLLM's /version has it: inferq's own version (the API runs no
    vLLM, and its workers may run different engines), the one ``system_fingerprint`` says."""
    return {"version": __version__}
