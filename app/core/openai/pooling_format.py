"""Embeddings, rerank and score on the wire: request bodies in, pooled jobs out, and a pooled
job back to the response (docs/openai.md, "Embeddings, rerank and score").

``POST /v1/embeddings`` is OpenAI's (and vLLM's ``EmbeddingCompletionRequest``); ``/v1/rerank``
and ``/v1/score`` are vLLM's (``RerankRequest``, ``ScoreTextRequest``). Every field of vLLM's
classes is taken or refused by name with a reason, as for chat (tests/unit/test_pooling.py
enumerates them). One request is one job, its inputs sent to the engine together; a batch
line is the same body (``REQUEST_TYPES``), and its output line the same response.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import orjson
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.core.contract.jobs import JobCreate
from app.core.contract.pooling import EmbedInput, check_items, embed_items
from app.core.contract.pooling import rows as stored_rows
from app.core.errors import DomainError, Kind, named, pydantic_error
from app.core.openai.openai_format import Tiered

EMBEDDINGS = "/v1/embeddings"
RERANK = "/v1/rerank"
SCORE = "/v1/score"
ENDPOINTS = (EMBEDDINGS, RERANK, SCORE)

_MULTIMODAL = "inferq serves text: multimodal inputs are not accepted"
_TOKENIZING = "the engine tokenizes with the model's defaults"
_POOLED: dict[str, tuple[Any, str]] = {
    "padding": (None, _TOKENIZING),
    "truncation_side": (None, "an input is cut on the tokenizer's own side"),
    "request_id": (None, "the job's id is the request's id (the `inferq-job-id` header)"),
    "priority": (0, "the lane decides the priority (`lane`: realtime, standard or bulk)"),
    "mm_processor_kwargs": (None, _MULTIMODAL),
    "cache_salt": (None, "pooling models keep no prefix cache to salt"),
}
EMBEDDING_REFUSED: dict[str, tuple[Any, str]] = {
    **_POOLED,
    "add_special_tokens": (True, _TOKENIZING),
    "embed_dtype": ("float32", "vectors are float32, as stored"),
    "endianness": ("native", "base64 vectors are little-endian float32, as OpenAI's"),
}
_SCORING: dict[str, tuple[Any, str]] = {
    **_POOLED,
    "max_tokens_per_query": (0, "truncate_prompt_tokens cuts the pair"),
    "max_tokens_per_doc": (0, "truncate_prompt_tokens cuts the pair"),
    "instruction": (None, "the worker renders the pair with the model's own template, unchanged"),
    "chat_template_kwargs": (None, "the worker renders the pair with the model's own template"),
}
RERANK_REFUSED = _SCORING
SCORE_REFUSED = _SCORING


class _Pooled(Tiered):
    """The fields every pooled endpoint shares: the model, OpenAI's ``user``, the lane and
    tier (``Tiered``), inferq's metadata and timeout, and vLLM's pooling options."""

    model: str = Field(min_length=1, max_length=256)
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] = Field(default_factory=dict)
    timeout_s: float | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    use_activation: bool | None = None

    @property
    def stream(self) -> bool:
        """A pooled call is answered whole."""
        return False

    def pooling_options(self) -> dict[str, Any]:
        """The pooling options this body sets, as a job keeps them."""
        options = {
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "use_activation": self.use_activation,
        }
        return {k: v for k, v in options.items() if v is not None}

    def _job(self, fields: dict[str, Any]) -> JobCreate:
        """The job body, with the jobs API's bounds; errors name the endpoint's field."""
        try:
            return JobCreate.model_validate(
                {
                    "lane": self.lane_used,
                    "model": self.model,
                    "metadata": self.metadata,
                    "timeout_s": self.timeout_s,
                    "user": self.user,
                    "pooling": self.pooling_options() or None,
                    **fields,
                }
            )
        except ValidationError as exc:
            code, param, message = pydantic_error(exc.errors()[0])
            if param is not None:
                param = param.removeprefix("pooling.")
            raise DomainError(Kind.INVALID, code, named(param, message), param=param) from None


class EmbeddingRequest(_Pooled):
    refused = EMBEDDING_REFUSED

    input: EmbedInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _input_bounds(cls, value: EmbedInput) -> EmbedInput:
        # The job's own bounds, here too: a batch's embedding lines are grouped into jobs
        # without a job body of their own (app/batches/validation.py).
        check_items(embed_items(value), "input")
        return value

    def items(self) -> list[str] | list[list[int]]:
        """The inputs, as a list (a string or one list of token ids is one input)."""
        return embed_items(self.input)

    def pooling_options(self) -> dict[str, Any]:
        """The pooling options this body sets, ``dimensions`` among them."""
        options = super().pooling_options()
        if self.dimensions is not None:
            options["dimensions"] = self.dimensions
        return options

    @model_validator(mode="before")
    @classmethod
    def _chat_input(cls, data: Any) -> Any:
        if isinstance(data, dict) and "messages" in data:
            raise PydanticCustomError(
                "unsupported_parameter",
                "messages: embeddings of chat conversations are not offered; give `input`",
                {"fields": "messages"},
            )
        return data

    def job(self, items: list[Any] | None = None) -> JobCreate:
        """The job of this body (``items``: the inputs of several lines, grouped)."""
        given: Any = self.input if items is None else items
        return self._job({"input": given})


class RerankRequest(_Pooled):
    refused = RERANK_REFUSED

    query: str = Field(min_length=1)
    documents: str | list[str]
    top_n: int = Field(0, ge=0, description="The best this many results; 0: every document.")
    return_documents: bool = Field(
        True, description="Each result carries its document's text (vLLM's answer does)."
    )

    def job(self) -> JobCreate:
        documents = [self.documents] if isinstance(self.documents, str) else self.documents
        return self._job({"query": self.query, "documents": documents})


class ScoreRequest(_Pooled):
    refused = SCORE_REFUSED

    text_1: str | list[str]
    text_2: str | list[str]

    def job(self) -> JobCreate:
        documents = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        return self._job({"query": self.text_1, "documents": documents})


PooledRequest = EmbeddingRequest | RerankRequest | ScoreRequest
REQUEST_TYPES: dict[str, type[PooledRequest]] = {
    EMBEDDINGS: EmbeddingRequest,
    RERANK: RerankRequest,
    SCORE: ScoreRequest,
}


@dataclass(frozen=True)
class Pooled:
    """A pooled job's outcome as a response needs it: its rows and what they cost."""

    id: str
    created_at: float
    model: str
    rows: np.ndarray  # n x width float32, a view of the packed bytes (POOLED_DTYPE)
    prompt_tokens: int


def pooled_of(
    job_id: str, created_at: float, model: str, data: bytes, width: int, prompt_tokens: int | None
) -> Pooled:
    return Pooled(job_id, created_at, model, stored_rows(data, width), prompt_tokens or 0)


def _usage(pooled: Pooled) -> dict[str, int]:
    return {"prompt_tokens": pooled.prompt_tokens, "total_tokens": pooled.prompt_tokens}


def _base64(row: np.ndarray) -> str:
    return base64.b64encode(row.tobytes()).decode()  # little-endian float32, as stored


def embedding_response(pooled: Pooled, encoding_format: str = "float") -> dict[str, Any]:
    """OpenAI's embedding list (with vLLM's ``id`` and ``created``)."""
    return {
        "id": pooled.id,
        "object": "list",
        "created": int(pooled.created_at),
        "model": pooled.model,
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": _base64(row) if encoding_format == "base64" else row,
            }
            for index, row in enumerate(pooled.rows)
        ],
        "usage": _usage(pooled),
    }


def rerank_response(
    pooled: Pooled, documents: list[str], top_n: int = 0, return_documents: bool = True
) -> dict[str, Any]:
    """vLLM's rerank answer: results by relevance, best first, ``top_n`` of them (0: all)."""
    scores = pooled.rows[:, 0].tolist()
    ranked = sorted(range(len(scores)), key=lambda i: -scores[i])
    if top_n:
        ranked = ranked[:top_n]
    return {
        "id": pooled.id,
        "model": pooled.model,
        "usage": _usage(pooled),
        "results": [
            {
                "index": i,
                "document": {"text": documents[i]} if return_documents else None,
                "relevance_score": scores[i],
            }
            for i in ranked
        ],
    }


def score_response(pooled: Pooled) -> dict[str, Any]:
    """vLLM's score answer: one score per pair, in the documents' order."""
    return {
        "id": pooled.id,
        "object": "list",
        "created": int(pooled.created_at),
        "model": pooled.model,
        "data": [
            {"index": i, "object": "score", "score": score}
            for i, score in enumerate(pooled.rows[:, 0].tolist())
        ],
        "usage": _usage(pooled),
    }


def dumps(body: dict[str, Any]) -> bytes:
    """A pooled answer as JSON: vectors straight from their float32 rows (orjson writes each
    value's shortest float32 form, "0.05273030", not a double's "0.05273030325770378")."""
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
