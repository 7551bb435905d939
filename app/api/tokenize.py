"""vLLM's utility endpoints its clients call: ``POST /tokenize``, ``POST /detokenize`` and
``GET /version``, answered as ``vllm serve`` answers them (vllm/entrypoints/serve/tokenize/).

The API holds no model: it tokenizes with the tokenizer the model's workers publish in its
model card (app/core/scheduling/tokens.py), the one it counts prompt tokens with, so a prompt's
``count`` here is its ``prompt_tokens`` on /v1/completions. An adapter tokenizes as its base
model. Chat ``messages`` are refused: their tokens come from the model's chat template, which
only the workers hold (docs/openai.md, "Tokenize, detokenize, version").
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from app import __version__
from app.core.errors import DomainError, Kind, unavailable
from app.core.messaging import clients
from app.core.scheduling import catalog, tokens
from app.core.settings import get_settings


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``); its ``TokenizeChatRequest``
    (``messages``) is read only to be refused. Fields vLLM does not know are ignored, as vLLM's
    server ignores them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    # vLLM's default: true for a prompt (false for messages, whose template adds its own).
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


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


def tokenize(body: TokenizeRequest) -> dict[str, Any]:
    """vLLM's ``TokenizeResponse``: count, max_model_len, tokens, token_strs."""
    if body.messages is not None and body.prompt is None:
        raise DomainError(
            Kind.INVALID,
            "unsupported_parameter",
            "messages is not supported: chat messages are tokenized through the model's chat "
            "template, which its workers apply and the API does not hold; tokenize the "
            "rendered prompt instead",
            param="messages",
        )
    if body.prompt is None:
        raise DomainError(Kind.INVALID, "missing", "prompt: field required", param="prompt")
    found = _counter(body.model)
    try:
        body.prompt.encode()
    except UnicodeEncodeError:
        raise DomainError(
            Kind.INVALID,
            "invalid_text",
            "prompt: text must be valid Unicode (no lone surrogates)",
            param="prompt",
        ) from None
    ids, strs = tokens.encode(found, body.prompt, body.add_special_tokens)
    return {
        "count": len(ids),
        "max_model_len": found.card.max_model_len,
        "tokens": ids,
        "token_strs": strs if body.return_token_strs else None,
    }


def detokenize(body: DetokenizeRequest) -> dict[str, str]:
    """vLLM's ``DetokenizeResponse``: the prompt the token ids make."""
    return {"prompt": tokens.decode(_counter(body.model), body.tokens)}


def version() -> dict[str, str]:
    """``{"version": ...}`` as vLLM's /version has it: inferq's own version (the API runs no
    vLLM, and its workers may run different engines)."""
    try:
        return {"version": metadata.version("inferq")}
    except metadata.PackageNotFoundError:
        return {"version": __version__}
