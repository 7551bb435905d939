"""OpenAI-compatible realtime endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Each call is a job, served by app/api/completions.py; the models are app/core/catalog.py's.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import completions
from app.api.auth import Tenant
from app.api.schemas import ErrorBody
from app.core import catalog
from app.core.openai_format import ChatCompletionRequest, CompletionRequest

router = APIRouter(prefix="/v1", tags=["openai"], responses={"default": {"model": ErrorBody}})


def _model(model: catalog.Model) -> dict[str, Any]:
    """OpenAI's model object, with what a caller of a job platform also needs to know."""
    return {
        "id": model.name,
        "object": "model",
        "created": 0,
        "owned_by": "inferq",
        "ready": model.ready,  # a live worker serves it; if not, jobs wait (calls get 503)
        "workers": model.workers,
        "max_model_len": model.max_model_len,  # None until a worker of it has run
        "parent": model.parent,  # a LoRA adapter's base model (vLLM's field), else None
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
