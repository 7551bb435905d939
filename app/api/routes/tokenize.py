"""vLLM's utility endpoints: ``POST /tokenize`` and ``POST /detokenize`` (the API's bearer key,
the models /v1/models lists) and ``GET /version`` (no key, as vLLM's); served by
app/api/tokenize.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from app.api import tokenize as service
from app.api.auth import Tenant
from app.api.schemas import ErrorBody

router = APIRouter(tags=["vllm"], responses={"default": {"model": ErrorBody}})


@router.post("/tokenize")
def tokenize(body: service.TokenizeRequest, _tenant: Tenant) -> dict[str, Any]:
    """A prompt's token ids with the model's tokenizer (vLLM's): ``count``,
    ``max_model_len``, ``tokens`` and, with ``return_token_strs``, ``token_strs``."""
    return service.tokenize(body)


@router.post("/detokenize")
def detokenize(body: service.DetokenizeRequest, _tenant: Tenant) -> dict[str, str]:
    """The text of token ids with the model's tokenizer (vLLM's): ``{"prompt": ...}``."""
    return service.detokenize(body)


@router.get("/version")
def version() -> dict[str, str]:
    """``{"version": ...}``: inferq's version (the API runs no vLLM)."""
    return service.version()
