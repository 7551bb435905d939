"""Admission control: per-tenant rate limits and per-lane backpressure.

Checked after a request is validated and before anything is written, so a refused request
leaves nothing behind (no row, no message). Admission always talks to Redis once (the rate
counters, or a PING when they are off): with Redis down a call is refused (503) before
anything is written, so a 202 is never a job that cannot start. A prompt longer than the
model's context is refused first (invalid, app/core/scheduling/tokens.py): bad input costs no rate
budget.

**Tenant limits** (over limit: 429 with ``Retry-After`` and the limit's name), shared by every
API replica through Redis:

- ``requests_per_minute``: calls that submit work (a job, a bulk request, a chat/completion
  call, a batch);
- ``tokens_per_minute``: prompt tokens (counted with the served model's tokenizer,
  app/core/scheduling/tokens.py; estimated where no worker has published one) plus ``max_tokens``,
  summed over the jobs submitted;
- ``max_queued``: the tenant's jobs queued at once (a count of its queued rows; while a
  tenant is under half its limit, a count at most ``BACKLOG_CACHE_S`` old, plus what this
  process admitted since, stands in for the query: near the limit every call counts).

The two rates are fixed windows of ``INFERQ_LIMIT_WINDOW_S`` (a Redis counter per tenant and
window; a request that would pass the limit is refunded and refused). Defaults come from
settings; an API key may override each one (``inferq keys create --rpm/--tpm/--max-queued``),
and counters are per tenant.

**Backpressure** (unavailable: 503 with ``Retry-After``): a lane refuses new jobs while the
jobs queued at or above its priority for the same model — the work a new job would wait behind
— reach ``INFERQ_LANE_MAX_QUEUED`` for that lane: realtime counts realtime, standard counts
realtime and standard, bulk counts everything, so under a general backlog bulk is shed first
and realtime last, and a backlog of one model never refuses another model's jobs. Depths are
read from the database at most once per ``BACKLOG_CACHE_S`` per API process.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.contract.jobs import JobCreate
from app.core.errors import BROKER_DOWN, DomainError, Kind, unavailable
from app.core.messaging import clients
from app.core.messaging.names import LIMIT_KEY_PREFIX
from app.core.models import LANE_PRIORITY, Job, JobStatus, live
from app.core.scheduling import backlog, tokens
from app.core.settings import get_settings

BACKLOG_CACHE_S = 1.0
BACKPRESSURE_RETRY_S = 5


@dataclass(frozen=True)
class Limits:
    """A caller's limits (0: none)."""

    requests_per_minute: int
    tokens_per_minute: int
    max_queued: int


def for_key(rpm: int | None, tpm: int | None, queued: int | None) -> Limits:
    """The limits of a key: its overrides, else the defaults in settings."""
    s = get_settings()
    return Limits(
        s.tenant_requests_per_minute if rpm is None else rpm,
        s.tenant_tokens_per_minute if tpm is None else tpm,
        s.tenant_max_queued if queued is None else queued,
    )


def defaults() -> Limits:
    return for_key(None, None, None)


def admit(
    session: Session,
    tenant: str,
    limits: Limits,
    bodies: Sequence[JobCreate] = (),
    models: Sequence[str] = (),
    field: str | None = None,
) -> list[int]:
    """Refuse (invalid, over limit, unavailable) or let through a call that submits ``bodies``
    (none: a batch) on ``models`` (each body's, as ``catalog.resolve`` resolved it). Returns
    each body's prompt tokens, as its model counts them (app/core/scheduling/tokens.py).

    ``field``: the list the bodies came in, for naming one in an error (``jobs``).
    """
    prompt_tokens = tokens.check(clients.redis_client(), models, bodies, field) if bodies else []
    routes = {(body.lane.value, model) for body, model in zip(bodies, models, strict=True)}
    for lane, model in sorted(routes, key=lambda route: (LANE_PRIORITY[route[0]], route[1])):
        _backpressure(session, lane, model)
    if limits.max_queued and bodies:
        _check_queued(session, tenant, limits.max_queued, len(bodies))
    cost = sum(prompt_tokens) + sum(body.most_output_tokens() for body in bodies)
    _take(tenant, limits, cost)
    return prompt_tokens


_queued_lock = threading.Lock()


def _queued() -> dict[str, tuple[float, int]]:
    """tenant -> (when counted, queued since): held with this process's clients."""
    return clients.held("limits.queued", dict)


def _check_queued(session: Session, tenant: str, limit: int, n: int) -> None:
    """The tenant's queued jobs plus ``n`` within ``limit``; counted in the database unless a
    recent count shows the tenant far below it (one query per call was a tenth of the API's
    work on the realtime path, for a limit almost never near)."""
    counted = _queued()
    with _queued_lock:
        at, queued = counted.get(tenant, (0.0, 0))
    if time.monotonic() - at >= BACKLOG_CACHE_S or queued + n > limit // 2:
        queued = (
            session.scalar(
                select(func.count())
                .select_from(Job)
                .where(Job.tenant == tenant, live(JobStatus.QUEUED))
            )
            or 0
        )
        at = time.monotonic()
        session.rollback()  # end the read; the caller's write opens its own transaction
        if queued + n > limit:
            raise _over(
                "max_queued",
                f"{queued} of this tenant's jobs are queued; at most {limit} may be",
                BACKPRESSURE_RETRY_S,
            )
    with _queued_lock:
        counted[tenant] = (at, queued + n)


def _window_key(tenant: str, limit: str, slot: int) -> str:
    """The Redis counter of ``tenant``'s ``limit`` in window ``slot``."""
    return f"{LIMIT_KEY_PREFIX}{tenant}:{limit}:{slot}"


def window_usage(tenants: Sequence[str]) -> dict[str, tuple[int, int]]:
    """What each tenant has used of its two rates in the window going on: (requests, tokens)
    (counted only while a limit applies to the tenant; the console's Tenants page)."""
    slot = int(time.time() // get_settings().limit_window_s)
    keys = [
        _window_key(tenant, limit, slot)
        for tenant in tenants
        for limit in ("requests_per_minute", "tokens_per_minute")
    ]
    values = clients.redis_client().mget(keys) if keys else []
    counts = [int(v or 0) for v in values]
    return {tenant: (counts[2 * i], counts[2 * i + 1]) for i, tenant in enumerate(tenants)}


def _take(tenant: str, limits: Limits, tokens: int) -> None:
    """Count one request and ``tokens`` in this window; refunded and refused when over."""
    window = get_settings().limit_window_s
    now = time.time()
    slot = int(now // window)
    retry_after = max(1, math.ceil((slot + 1) * window - now))
    wanted = [
        ("requests_per_minute", 1, limits.requests_per_minute),
        ("tokens_per_minute", tokens, limits.tokens_per_minute),
    ]
    wanted = [(name, amount, limit) for name, amount, limit in wanted if limit and amount]
    keys = [_window_key(tenant, name, slot) for name, _, _ in wanted]
    try:
        if not wanted:
            clients.redis_client().ping()  # no counter to take: Redis must still be there
            return
        pipe = clients.redis_client().pipeline(transaction=True)
        for key, (_, amount, _) in zip(keys, wanted, strict=True):
            pipe.incrby(key, amount)
            pipe.expire(key, int(window) + 5)
        counts = pipe.execute()[::2]
        over = [
            (name, limit)
            for (name, _, limit), count in zip(wanted, counts, strict=True)
            if count > limit
        ]
        if over:
            refund = clients.redis_client().pipeline(transaction=True)
            for key, (_, amount, _) in zip(keys, wanted, strict=True):
                refund.decrby(key, amount)
            refund.execute()
    except redis.RedisError:
        raise unavailable(*BROKER_DOWN) from None
    if over:
        name, limit = over[0]
        raise _over(
            name,
            f"this tenant's {name.replace('_', ' ')} limit ({limit} per "
            f"{window:g} s window) is used up",
            retry_after,
        )


def clear_windows(client: redis.Redis) -> int:
    """Forget every tenant's rate-limit windows (``inferq up`` does when it stops: a window
    it left behind would count against the next run); returns how many keys went."""
    keys = list(client.scan_iter(match=LIMIT_KEY_PREFIX + "*", count=1000))
    return int(client.delete(*keys)) if keys else 0


def _over(limit: str, message: str, retry_after: int) -> DomainError:
    return DomainError(
        Kind.OVER_LIMIT, f"{limit}_exceeded", message, retry_after_s=retry_after, limit=limit
    )


_backlog_lock = threading.Lock()


def _depths(session: Session) -> dict[tuple[str, str], int]:
    """Queued jobs per (lane, model), cached for ``BACKLOG_CACHE_S`` (with the clients)."""
    reading: dict[str, tuple[float, dict[tuple[str, str], int]]]
    reading = clients.held("limits.backlog", dict)
    with _backlog_lock:
        at, depths = reading.get("depths", (-BACKLOG_CACHE_S, {}))
        if time.monotonic() - at < BACKLOG_CACHE_S:
            return depths
    depths = backlog.queued_jobs(session)
    session.rollback()
    with _backlog_lock:
        reading["depths"] = (time.monotonic(), depths)
    return depths


def _backpressure(session: Session, lane: str, model: str) -> None:
    top = get_settings().lane_max_queued.get(lane, 0)
    if not top:
        return
    depths = _depths(session)
    ahead = sum(
        n
        for (other, of), n in depths.items()
        if of == model and LANE_PRIORITY[other] <= LANE_PRIORITY[lane]
    )
    if ahead >= top:
        raise DomainError(
            Kind.UNAVAILABLE,
            "lane_overloaded",
            f"the {lane} lane of {model} is full: {ahead} jobs are queued ahead of a new one "
            f"(at most {top}); retry later",
            param="lane",
            retry_after_s=BACKPRESSURE_RETRY_S,
        )
