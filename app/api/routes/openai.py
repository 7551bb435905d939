"""OpenAI-compatible realtime endpoints: /v1/chat/completions, /v1/completions, /v1/models.

Each call is a job, served by app/api/completions.py.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from app.api import completions
from app.api.auth import Tenant
from app.api.schemas import ErrorBody
from app.core import jobs
from app.core.openai_format import ChatCompletionRequest, CompletionRequest
from app.core.settings import get_settings

router = APIRouter(prefix="/v1", tags=["openai"], responses={"default": {"model": ErrorBody}})


def _model_card() -> dict[str, Any]:
    return {"id": get_settings().model_name, "object": "model", "created": 0, "owned_by": "inferq"}


@router.get("/models")
def list_models(_tenant: Tenant) -> dict[str, Any]:
    """The served model (one per deployment)."""
    return {"object": "list", "data": [_model_card()]}


@router.get("/models/{model_id:path}")
def get_model(model_id: str, _tenant: Tenant) -> dict[str, Any]:
    jobs.check_model(model_id)
    return _model_card()


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
