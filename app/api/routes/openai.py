"""OpenAI-compatible realtime endpoints: /v1/chat/completions, /v1/completions, /v1/models, and
/v1/embeddings, /v1/rerank and /v1/score (vLLM's).

Each call is a job, served by app/api/completions.py (a pooled call by app/api/pooling.py);
the models are app/core/scheduling/catalog.py's.
"""

from __future__ import annotations

import hashlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import completions, pooling
from app.api.auth import Tenant
from app.api.schemas import ErrorBody
from app.core.openai.openai_format import ChatCompletionRequest, CompletionRequest
from app.core.openai.pooling_format import EmbeddingRequest, RerankRequest, ScoreRequest
from app.core.scheduling import catalog
from app.core.settings import get_settings

router = APIRouter(prefix="/v1", tags=["openai"], responses={"default": {"model": ErrorBody}})


def _model(model: catalog.Model) -> dict[str, Any]:
    """OpenAI's model object with vLLM's keys (its ``ModelCard``: ``root``, ``parent``,
    ``max_model_len``, ``permission``), and what a caller of a job platform also needs to know."""
    settings = get_settings()
    adapter = settings.adapters.get(model.name)
    if adapter is not None:
        root = adapter.path  # vLLM's root of an adapter: its directory
    elif model.name == settings.model_name and settings.model:
        root = settings.model  # of the served model: what it was loaded from
    else:
        root = model.name
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "inferq",
        "root": root,
        # vLLM's one default permission (every model may be sampled and viewed).
        "permission": [
            {
                # The same model answers the same every time (vLLM draws a new id per call).
                "id": "modelperm-" + hashlib.sha256(model.name.encode()).hexdigest()[:32],
                "object": "model_permission",
                "created": 0,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
        "ready": model.ready,  # a live worker serves it; if not, jobs wait (calls get 503)
        "workers": model.workers,
        "max_model_len": model.max_model_len,  # None until a worker of it has run
        "parent": model.parent,  # a LoRA adapter's base model (vLLM's field), else None
        "task": model.task,  # generate, embed or score: which endpoints it serves
    }


@router.get("/models")
def list_models(_tenant: Tenant) -> dict[str, Any]:
    """Every model a live worker serves, and the ones accepted with none (scaled to zero)."""
    return {"object": "list", "data": [_model(model) for model in catalog.models()]}


@router.get("/models/{model_id:path}")
def get_model(model_id: str, _tenant: Tenant) -> dict[str, Any]:
    name = catalog.resolve(model_id)
    return next(_model(model) for model in catalog.models() if model.name == name)


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, tenant: Tenant
) -> Response:
    """Chat completion as a job; ``stream: true`` relays tokens as they are produced."""
    return await completions.complete(body, request, tenant)


@router.post("/completions", response_model=None)
async def text_completions(body: CompletionRequest, request: Request, tenant: Tenant) -> Response:
    """Text completion as a job; ``stream: true`` relays tokens as they are produced."""
    return await completions.complete(body, request, tenant)


@router.post("/embeddings", response_model=None)
async def embeddings(body: EmbeddingRequest, request: Request, tenant: Tenant) -> Response:
    """OpenAI's embeddings, as a job on an embedding model."""
    return await pooling.answer(body, request, tenant)


@router.post("/rerank", response_model=None)
async def rerank(body: RerankRequest, request: Request, tenant: Tenant) -> Response:
    """vLLM's rerank: the documents by relevance to the query, on a scoring model."""
    return await pooling.answer(body, request, tenant)


@router.post("/score", response_model=None)
async def score(body: ScoreRequest, request: Request, tenant: Tenant) -> Response:
    """vLLM's score: one score per (text_1, text_2) pair, on a scoring model."""
    return await pooling.answer(body, request, tenant)
