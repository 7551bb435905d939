"""What every request body of the public contract follows: unknown fields refused, text that is
valid Unicode (any such text is stored as it is, NUL included), an explicit null read as the
field's default; and the bounds shared by
the job and batch bodies (metadata, a webhook URL's scheme), read from settings.

Bounds that operators may tune come from settings and are checked in validators, so an
out-of-bounds value is a 422 that names its field (docs/api.md, "HTTP API (v1)"). Unknown
fields are refused: a typo such as ``max_token`` must not be silently ignored.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from app.core.models import valid_text
from app.core.settings import get_settings

INVALID_TEXT = "text must be valid Unicode (a lone surrogate such as \\ud800 is not)"
# What holds no text: a list of only these (a prompt of token ids, thousands long) is passed over
# by one look at its items' types, not a call per item.
_NO_TEXT = frozenset({int, float, bool, type(None)})


def _check_text(value: Any) -> None:
    if isinstance(value, str):
        if not valid_text(value):
            raise ValueError(INVALID_TEXT)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)
    elif isinstance(value, list | tuple):
        if _NO_TEXT.issuperset(map(type, value)):
            return
        for item in value:
            _check_text(item)


class StrictModel(BaseModel):
    """Request bodies: unknown fields refused, every string valid Unicode, and an explicit
    null read as the field's default (OpenAI's semantics: ``"temperature": null`` asks for
    nothing)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in fields or fields[key].is_required()
        }

    @field_validator("*")
    @classmethod
    def _valid_text(cls, value: Any) -> Any:
        _check_text(value)
        return value


def check_webhook_scheme(value: str | None) -> str | None:
    if value is not None and not value.lower().startswith(("http://", "https://")):
        raise ValueError("webhook_url must be an http(s) URL")
    return value


def check_metadata(value: dict[str, str]) -> dict[str, str]:
    s = get_settings()
    if len(value) > s.metadata_max_pairs:
        raise ValueError(f"at most {s.metadata_max_pairs} metadata pairs are allowed")
    for key, item in value.items():
        if not key or len(key) > s.metadata_max_key_chars:
            raise ValueError(f"metadata keys must be 1 to {s.metadata_max_key_chars} chars")
        if len(item) > s.metadata_max_value_chars:
            raise ValueError(f"metadata values must be at most {s.metadata_max_value_chars}")
    return value


def secs(value: float | None) -> int | None:
    return None if value is None else int(value)
