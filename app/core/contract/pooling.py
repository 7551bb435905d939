"""A pooled job's body: what to embed or to score, and how (docs/openai.md, "Embeddings, rerank
and score").

An embedding job's ``input`` is OpenAI's: a string, a list of strings, a list of token ids or
a list of lists of them; a scoring job has a ``query`` (one, or one per document) and its
``documents``. Either is at most ``INFERQ_POOL_MAX_INPUTS`` items (OpenAI's 2,048); an item is
never empty. ``pooling`` holds vLLM's options for the pooler; a pooled job has no sampling
``params``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from pydantic import Field

from app.core.contract.base import StrictModel
from app.core.models import POOLED_DTYPE
from app.core.settings import get_settings

EmbedInput = str | list[str] | list[int] | list[list[int]]
# What a pooled job stores as ``Job.inputs``: the texts or token lists to embed, or the pairs
# to score ({"queries": [...], "documents": [...]}).
Inputs = list[str] | list[list[int]] | dict[str, list[str]]


class PoolingOptions(StrictModel):
    """vLLM's pooling parameters a caller may set (``PoolingParams``)."""

    dimensions: int | None = Field(
        None,
        ge=1,
        description="Embeddings: cut each vector to this many dimensions (a matryoshka model "
        "only), then normalise it; the model's own size, on any model, cuts nothing.",
    )
    truncate_prompt_tokens: int | None = Field(
        None,
        ge=-1,
        description="Cut each input to its last this many tokens (-1: the model's limit); "
        "unset, an input longer than the model's limit is refused.",
    )
    use_activation: bool | None = Field(
        None,
        description="The pooler's activation: normalisation for embeddings, the sigmoid for "
        "scores; unset, the model's default.",
    )

    def stored(self) -> dict[str, Any]:
        """What a job keeps: only what the caller set."""
        return self.model_dump(exclude_none=True)


def check_items(items: list[Any], field: str) -> None:
    """At most ``INFERQ_POOL_MAX_INPUTS`` items, none empty, every text storable in length."""
    settings = get_settings()
    if not items:
        raise ValueError(f"{field} must not be empty")
    if len(items) > settings.pool_max_inputs:
        raise ValueError(f"{field} holds at most {settings.pool_max_inputs} items")
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ValueError(f"{field} must not hold an empty string")
            if len(item) > settings.max_prompt_chars:
                raise ValueError(f"an item of {field} is longer than {settings.max_prompt_chars}")
        elif isinstance(item, list):
            if not item:
                raise ValueError(f"{field} must not hold an empty list of token ids")
            if min(item) < 0:  # min, not a loop: a prompt may be 100,000 ids
                raise ValueError(f"token ids in {field} must not be negative")


def embed_items(value: EmbedInput) -> list[str] | list[list[int]]:
    """OpenAI's ``input`` as a list of items: a string, or one list of token ids, is one item."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(v, int) for v in value):
        return [value]  # type: ignore[list-item,return-value]
    return value  # type: ignore[return-value]


def score_pairs(query: str | list[str], documents: list[str]) -> dict[str, list[str]]:
    """A scoring job's inputs: one query for every document, or one query per document."""
    queries = [query] if isinstance(query, str) else query
    if len(queries) not in (1, len(documents)):
        raise ValueError(
            f"give one query, or one per document ({len(documents)}): got {len(queries)}"
        )
    return {"queries": queries, "documents": documents}


def input_count(inputs: Any) -> int:
    """How many vectors or scores a pooled job produces."""
    if isinstance(inputs, dict):
        return len(inputs["documents"])
    return len(inputs)


def pack(values: Sequence[float]) -> bytes:
    """Float values as ``Job.pooled`` stores them: little-endian float32 (POOLED_DTYPE)."""
    return np.asarray(values, dtype=POOLED_DTYPE).tobytes()


def rows(data: bytes, width: int) -> np.ndarray:
    """``Job.pooled``'s rows of ``width`` values: n x width float32, a view of the bytes."""
    return np.frombuffer(data, dtype=POOLED_DTYPE).reshape(-1, width)


def unpack(data: bytes, width: int) -> list[list[float]]:
    """``Job.pooled``'s rows of ``width`` values, as Python floats."""
    unpacked: list[list[float]] = rows(data, width).tolist()
    return unpacked
