"""What a status snapshot holds, and its JSON form: the shapes that app/core/observe/snapshot.py
fills from Redis and the database, that ``GET /v1/admin/status`` sends (docs/api.md, "Status")
and that `inferq status` draws.

Nothing here imports more than the settings do: `inferq status` reads a snapshot from the API
without loading what the reads themselves need (SQLAlchemy, redis-py and the models cost most
of its start-up; docs/benchmarks.md, "`inferq status`").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from app.core.messaging.names import Route

TenantRoute = tuple[str, str, str]  # (lane, model, tenant): one tenant's jobs in one queue


@dataclass(frozen=True)
class LaneJobs:
    queued: int = 0
    running: int = 0
    oldest_queued_age_s: float = 0.0


@dataclass(frozen=True)
class Throughput:
    window_s: float
    finished: dict[str, int] = field(default_factory=dict)
    completion_tokens: int = 0

    @property
    def jobs_per_s(self) -> float:
        return sum(self.finished.values()) / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.window_s


@dataclass(frozen=True)
class TenantJobs:
    """One tenant's queued and running jobs in one model's lane, and the tokens of its jobs
    there that finished in the last ``window_s`` seconds."""

    window_s: float
    queued: int = 0
    running: int = 0
    # Prompt + completion tokens: what serving the tenant cost, the unit its fair share is
    # settled in (app/core/scheduling/fairshare.py).
    tokens_served: int = 0
    completion_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_served / self.window_s


@dataclass(frozen=True)
class Affinity:
    """A worker's prefix-affinity counts, by the dispatchers (app/dispatcher/loop.py)."""

    sent: int = 0  # jobs sent to its own queue
    overflow: int = 0  # jobs whose prefix is its own, sent to the shared queue (load bound)


@dataclass(frozen=True)
class Snapshot:
    taken_at: float
    messages: dict[Route, int]
    lanes: dict[Route, LaneJobs]
    workers: list[dict[str, Any]]
    throughput: Throughput
    ops: list[dict[str, Any]] = field(default_factory=list)
    tenants: dict[TenantRoute, TenantJobs] = field(default_factory=dict)
    dispatchers: list[dict[str, Any]] = field(default_factory=list)
    # Parts of the deployment whose work waits with no live process (app/core/observe/missing.py).
    warnings: list[str] = field(default_factory=list)
    # Jobs sent to each worker by prefix affinity, and those whose worker was past the load
    # bound (snapshot.affinity_counts).
    affinity: dict[str, Affinity] = field(default_factory=dict)
    # The Redis, database and file store it was read from (snapshot.sources).
    sources: str = ""


def prefix_hit_rate(record: dict[str, Any]) -> float | None:
    """A worker's prefix-cache hit rate since its engine started: prompt tokens found in the
    cache over prompt tokens looked up (its presence record; None before any lookup)."""
    cache = record.get("prefix_cache") or {}
    queries = float(cache.get("queries") or 0)
    return float(cache.get("hits") or 0) / queries if queries else None


def to_json(snap: Snapshot) -> dict[str, Any]:
    """The snapshot as JSON: a queue's or a tenant's figures are one object each, its lane,
    model (and tenant) among them, in the snapshot's order (docs/api.md, "Status")."""
    return {
        "taken_at": snap.taken_at,
        "messages": [
            {"lane": lane, "model": model, "messages": n}
            for (lane, model), n in snap.messages.items()
        ],
        "lanes": [
            {"lane": lane, "model": model, **asdict(jobs)}
            for (lane, model), jobs in snap.lanes.items()
        ],
        "tenants": [
            {"lane": lane, "model": model, "tenant": tenant, **asdict(jobs)}
            for (lane, model, tenant), jobs in snap.tenants.items()
        ],
        "workers": snap.workers,
        "ops_workers": snap.ops,
        "dispatchers": snap.dispatchers,
        "throughput": asdict(snap.throughput),
        "affinity": {worker: asdict(counts) for worker, counts in snap.affinity.items()},
        "warnings": snap.warnings,
        "sources": snap.sources,
    }


def from_json(body: dict[str, Any]) -> Snapshot:
    """The snapshot :func:`to_json` wrote (a ``KeyError`` or ``TypeError`` for anything else)."""
    return Snapshot(
        taken_at=float(body["taken_at"]),
        messages={(m["lane"], m["model"]): int(m["messages"]) for m in body["messages"]},
        lanes={(j.pop("lane"), j.pop("model")): LaneJobs(**j) for j in _copies(body["lanes"])},
        tenants={
            (j.pop("lane"), j.pop("model"), j.pop("tenant")): TenantJobs(**j)
            for j in _copies(body["tenants"])
        },
        workers=list(body["workers"]),
        ops=list(body["ops_workers"]),
        dispatchers=list(body["dispatchers"]),
        throughput=Throughput(**body["throughput"]),
        affinity={worker: Affinity(**counts) for worker, counts in body["affinity"].items()},
        warnings=[str(line) for line in body["warnings"]],
        sources=str(body["sources"]),
    )


def _copies(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [dict(item) for item in items]
