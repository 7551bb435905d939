"""Which models this deployment serves: the models of live workers, and the models accepted
with no worker running (scaled to zero).

A worker holds one engine of one model and announces it in its presence record
(app/core/processes/presence.py) once the engine is up, so the live models are read from those
records.
The accepted ones are the settings' (``INFERQ_MODEL``/``INFERQ_SERVED_MODEL_NAME`` and
``INFERQ_ACCEPTED_MODELS``); a LoRA adapter (``INFERQ_ADAPTERS``) runs on the workers of its
base model. A model is::

    known(m) = m in accepted or workers(m) > 0 or m is an adapter
    ready(m) = workers(base(m)) > 0          base(m) = the adapter's base, or m itself

A served model has one task (``JobKind``: generate, embed or score), announced by its
workers once their engine has resolved it and kept in its model card; before any worker has
run, the settings say it (``INFERQ_MODEL_TASKS``, ``INFERQ_MODEL_TASK``), else it generates. A
job of another kind than its model's task is refused (400 ``wrong_task``, nothing written).

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

from app.core.errors import DomainError, Kind
from app.core.messaging import clients
from app.core.messaging.names import CARD_KEY_PREFIX, queue_of, routes
from app.core.models import JobKind
from app.core.processes import presence
from app.core.scheduling import tokens
from app.core.scheduling.tokens import ModelCard
from app.core.settings import get_settings

log = logging.getLogger("inferq.catalog")

CATALOG_CACHE_S = 2.0
TASKS = frozenset(JobKind)
_NOUN: dict[str, str] = {
    JobKind.GENERATE: "generation",
    JobKind.EMBED: "embedding",
    JobKind.SCORE: "scoring",
}
_VERB: dict[str, str] = {
    JobKind.GENERATE: "generate text",
    JobKind.EMBED: "embed",
    JobKind.SCORE: "score",
}


@dataclass(frozen=True)
class Model:
    """One model as /v1/models shows it."""

    name: str
    workers: int  # live workers whose engine serves it (an adapter's: its base's)
    # From its model card (app/core/scheduling/tokens.py), once a worker ran.
    max_model_len: int | None
    parent: str | None = None  # an adapter's base model, as vLLM's /v1/models shows it
    task: str = JobKind.GENERATE  # what it does (task_of)

    @property
    def ready(self) -> bool:
        return self.workers > 0


_lock = threading.Lock()


def _live_read() -> dict[str, tuple[float, dict[str, int], dict[str, str]]]:
    """The last reading of the live models (held with this process's Redis clients)."""
    return clients.held("catalog.live", dict)


def counts(workers: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Workers per model in presence records (``presence.workers``)."""
    found: dict[str, int] = {}
    for record in workers:
        model = record.get("model")
        if isinstance(model, str) and model:
            found[model] = found.get(model, 0) + 1
    return found


def tasks(workers: Iterable[dict[str, Any]]) -> dict[str, str]:
    """The task each model's live workers announce (``presence.workers``)."""
    return {
        record["model"]: record["task"]
        for record in workers
        if isinstance(record.get("model"), str) and record.get("task") in TASKS
    }


def live(fresh: bool = False) -> dict[str, int]:
    """Live workers per model; ``fresh`` reads Redis now instead of a recent reading. Redis
    away: no live worker is known (what cannot be seen cannot be waited for)."""
    return _live(fresh)[0]


def _live(fresh: bool = False) -> tuple[dict[str, int], dict[str, str]]:
    """(live workers per model, the task they announce), read at most every
    ``CATALOG_CACHE_S``."""
    reading = _live_read()
    with _lock:
        cached = reading.get("live")
    if not fresh and cached is not None and time.monotonic() - cached[0] < CATALOG_CACHE_S:
        return cached[1], cached[2]
    records: list[dict[str, Any]] = []
    try:
        records = presence.workers(clients.redis_client())
    except redis.RedisError as exc:
        log.warning("could not read the workers' presence records: %s", exc)
    found, announced = counts(records), tasks(records)
    with _lock:
        reading["live"] = (time.monotonic(), found, announced)
    return found, announced


def task_of(model: str) -> str:
    """What ``model`` does (an adapter: its base): what its live workers announce, else its
    model card's task, else the settings' (``INFERQ_MODEL_TASKS``; ``INFERQ_MODEL_TASK`` for
    this process's own model), else generate."""
    settings = get_settings()
    base = settings.base_of(model)
    announced = _live()[1].get(base)
    if announced is not None:
        return announced
    found = tokens.counter(clients.redis_client(), base)
    if found is not None and found.card.task in TASKS:
        return found.card.task
    if base in settings.model_tasks:
        return settings.model_tasks[base]
    if base == settings.model_name and settings.model_task != "auto":
        return settings.model_task
    return JobKind.GENERATE


def check_task(model: str, kind: str) -> None:
    """Refuse a job whose kind is not its model's task (400, nothing written)."""
    task = task_of(model)
    if task != kind:
        raise DomainError(
            Kind.MALFORMED,
            "wrong_task",
            f"the model {model!r} is a {_NOUN[task]} model: it cannot {_VERB[kind]} "
            f"(GET /v1/models says each model's task)",
            param="model",
        )


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
        found.append(Model(name, counts.get(name, 0), length, task=task_of(name)))
    lengths = {model.name: model.max_model_len for model in found}
    for name, adapter in sorted(get_settings().adapters.items()):
        base = adapter.base
        found.append(
            Model(name, counts.get(base, 0), lengths.get(base), parent=base, task=task_of(base))
        )
    return found


def queues() -> list[str]:
    """The Celery queues of every known model, each model's lanes in priority order."""
    return [queue_of(lane, model) for lane, model in routes(names())]
