"""Which models this deployment serves: the models of live workers, and the models accepted
with no worker running (scaled to zero).

A worker holds one engine of one model and announces it in its presence record
(workers/presence.py) once the engine is up, so the live models are read from those records.
The accepted ones are the settings' (``INFERQ_MODEL``/``INFERQ_SERVED_MODEL_NAME`` and
``INFERQ_ACCEPTED_MODELS``); a LoRA adapter (``INFERQ_ADAPTERS``) runs on the workers of its
base model. A model is::

    known(m) = m in accepted or workers(m) > 0 or m is an adapter
    ready(m) = workers(base(m)) > 0          base(m) = the adapter's base, or m itself

A job for an unknown model is refused (404 ``model_not_found``, OpenAI's semantics) before
anything is written; a job for a known model with no worker is accepted and waits in its
queue, except an OpenAI call, which waits ``INFERQ_MODEL_WAIT_S`` for a worker and then
answers 503 (docs/architecture.md, "Many models"). The presence records are read at most once
per ``CATALOG_CACHE_S`` per process: the realtime path looks a model up on every call.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import redis

from app.core import clients, snapshot
from app.core.errors import DomainError, Kind
from app.core.names import CARD_KEY_PREFIX, queue_of
from app.core.settings import get_settings
from app.core.tokens import ModelCard

log = logging.getLogger("inferq.catalog")

CATALOG_CACHE_S = 2.0


@dataclass(frozen=True)
class Model:
    """One model as /v1/models shows it."""

    name: str
    workers: int  # live workers whose engine serves it (an adapter's: its base's)
    max_model_len: int | None  # from its model card (app/core/tokens.py), once a worker ran
    parent: str | None = None  # an adapter's base model, as vLLM's /v1/models shows it

    @property
    def ready(self) -> bool:
        return self.workers > 0


_lock = threading.Lock()


def _live_read() -> dict[str, tuple[float, dict[str, int]]]:
    """The last reading of the live models (held with this process's Redis clients)."""
    return clients.held("catalog.live", dict)


def counts(workers: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Workers per model in presence records (``snapshot.workers``)."""
    found: dict[str, int] = {}
    for record in workers:
        model = record.get("model")
        if isinstance(model, str) and model:
            found[model] = found.get(model, 0) + 1
    return found


def live(fresh: bool = False) -> dict[str, int]:
    """Live workers per model; ``fresh`` reads Redis now instead of a recent reading. Redis
    away: no live worker is known (what cannot be seen cannot be waited for)."""
    reading = _live_read()
    with _lock:
        cached = reading.get("live")
    if not fresh and cached is not None and time.monotonic() - cached[0] < CATALOG_CACHE_S:
        return cached[1]
    found: dict[str, int] = {}
    try:
        found = counts(snapshot.workers(clients.redis_client()))
    except redis.RedisError as exc:
        log.warning("could not read the workers' presence records: %s", exc)
    with _lock:
        reading["live"] = (time.monotonic(), found)
    return found


def names(workers: dict[str, int] | None = None) -> list[str]:
    """Every known base model (the ones with queues of their own): the accepted ones in the
    settings' order, then live ones by name (``workers``: live workers per model already read,
    else :func:`live`'s)."""
    accepted = get_settings().accepted
    return [*accepted, *sorted(set(live() if workers is None else workers) - set(accepted))]


def served_names(base: str) -> list[str]:
    """What jobs on ``base``'s workers may name: the base and its adapters."""
    return [base, *get_settings().adapters_of(base)]


def resolve(requested: str | None) -> str:
    """The model a job names: ``requested``, or the default model when it names none;
    refuses a model (or adapter) nobody serves or accepts (404, nothing written)."""
    settings = get_settings()
    if requested is None:
        return settings.model_name
    if requested in settings.accepted or requested in settings.adapters or requested in live():
        return requested
    raise DomainError(
        Kind.NOT_FOUND,
        "model_not_found",
        f"The model {requested!r} does not exist; GET /v1/models lists the served ones",
        param="model",
    )


def ready(model: str, fresh: bool = False) -> bool:
    """Whether a live worker runs ``model``'s jobs (an adapter's: one of its base)."""
    return bool(live(fresh).get(get_settings().base_of(model)))


def wait_ready(model: str, timeout_s: float) -> bool:
    """Whether ``model`` has a live worker within ``timeout_s`` (checked every half second)."""
    end = time.monotonic() + timeout_s
    if ready(model):
        return True
    while True:
        if ready(model, fresh=True):
            return True
        left = end - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(0.5, left))


def models() -> list[Model]:
    """Every known model with its workers and context length, then the adapters
    (GET /v1/models)."""
    counts = live()
    known = names()
    cards: list[Any] = []
    try:
        cards = clients.redis_client().mget([CARD_KEY_PREFIX + name for name in known])
    except redis.RedisError as exc:
        log.warning("could not read the model cards: %s", exc)
    found: list[Model] = []
    for i, name in enumerate(known):
        length = None
        raw = cards[i] if i < len(cards) else None
        if raw is not None:
            try:
                length = ModelCard(**json.loads(raw)).max_model_len or None
            except (TypeError, ValueError):
                length = None
        found.append(Model(name, counts.get(name, 0), length))
    lengths = {model.name: model.max_model_len for model in found}
    for name, adapter in sorted(get_settings().adapters.items()):
        base = adapter.base
        found.append(Model(name, counts.get(base, 0), lengths.get(base), parent=base))
    return found


def queues() -> list[str]:
    """The Celery queues of every known model, each model's lanes in priority order."""
    return [queue_of(lane, model) for lane, model in snapshot.routes(names())]
