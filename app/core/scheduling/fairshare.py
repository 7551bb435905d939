"""Fair share between tenants inside a lane: what a job costs, what a tenant has been charged,
and whose turn it is (docs/architecture.md, "Fair share").

Every route (a lane of a model, ``names.queue_of``) keeps, per tenant, the tokens charged to
it: a Redis hash ``inferq:fair:<lane>:<model>``. A tenant's *virtual tokens* are what it was
charged over its weight::

    v(t) = charged(t) / weight(t)

The dispatcher gives the next job to the waiting tenant with the smallest ``v(t)`` and charges
it the job's cost; the worker that ends the job settles the charge with what it really used::

    cost(job)   = prompt tokens (estimated at submission) + most output tokens (n * max_tokens)
    at dispatch:  charged(t) += cost(job)
    at its end:   charged(t) += used(job) - cost(job)      used = prompt + completion tokens

(a job sent straight from the API was charged nothing, so its end charges all it used; a job
handed back or re-queued is refunded what it was charged, and charged again when sent again).
Over any stretch in which tenants keep jobs waiting, each one's tokens grow at the rate of its
weight: the virtual token counter of Sheng et al., "Fairness in Serving Large Language Models"
(OSDI 2024). A tenant that had nothing waiting joins at the level of those that had, as far as
the engines have served it::

    served(u)  = charged(u) - running(u)      running(u): what u's claimed jobs were charged
    charged(t) <- max(charged(t), weight(t) * min served(u) / weight(u) over those waiting)

so that time spent idle is not saved up as credit against the others, and the jobs the others
have inside the workers, which the newcomer cannot pass, count against them as they are served.
VTC's counters grow as tokens are generated; ours are charged a job's whole cost when it is
sent, so without ``running`` a newcomer would join ahead of the work it waits behind
(start-time fair queuing's rule, Goyal et al., SIGCOMM 1996: a flow that becomes busy starts at
the tag of the work in service; docs/architecture.md, "Fair share").

The counters are a hint like every Redis value here: lost with Redis, they start again from zero
and the shares from then on are fair again.
"""

from __future__ import annotations

import hashlib
import heapq
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import redis
from prometheus_client import Counter
from sqlalchemy import Connection, func, select
from sqlalchemy.orm import Session

from app.core.contract.jobs import JobCreate
from app.core.messaging import clients
from app.core.messaging.names import FAIR_COUNTERS_PREFIX, queue_of
from app.core.models import ApiKey, JobKind
from app.core.scheduling import tokens
from app.core.settings import get_settings

log = logging.getLogger("inferq.fairshare")

PREFIX_CHARS = 256  # a completion prompt's first characters: its shared prefix, if longer

TOKENS_SERVED = Counter(
    "inferq_tenant_tokens_served",
    "Prompt + completion tokens of the jobs a worker finished, by lane, model and tenant.",
    ["lane", "model", "tenant"],
)


def cost(body: JobCreate, prompt_tokens: int | None = None) -> int:
    """What a job is expected to cost its tenant: its prompt tokens (as the model counts them,
    ``prompt_tokens``; else about four characters each) and every token it may generate. Its
    end settles the real count; the closer the charge, the less a tenant's share moves when
    its jobs settle after another tenant has joined at its level (:func:`join`)."""
    prompt = tokens.estimate(body) if prompt_tokens is None else prompt_tokens
    if body.kind != JobKind.GENERATE:
        return prompt  # a pooler generates nothing: a pooled job costs its inputs' tokens
    return prompt + body.most_output_tokens()


def prefix_of(body: JobCreate) -> str:
    """The hash of the part of a job's prompt that other jobs are likely to share: a chat's
    leading system (or developer) messages, or the first ``PREFIX_CHARS`` characters of a longer
    completion prompt; '' when it has none. Jobs with the same prefix are sent together, so
    vLLM's prefix cache holds it for all of them (docs/architecture.md, "Fair share")."""
    if body.kind != JobKind.GENERATE:
        # Routed by load only: an embedding model's engine keeps no prefix cache (encoder-only
        # models have none), and a score's pairs rarely share a prefix worth grouping.
        return ""
    if body.messages is not None:
        lead = []
        for message in body.messages:
            if message.role not in ("system", "developer"):
                break
            lead.append(message.text())
        shared = "\x00".join(lead)
    else:
        # One text prompt; token ids and several prompts are not grouped.
        prompt = body.prompt if isinstance(body.prompt, str) else ""
        shared = prompt[:PREFIX_CHARS] if len(prompt) > PREFIX_CHARS else ""
    if not shared:
        return ""
    return hashlib.blake2b(shared.encode(), digest_size=8).hexdigest()


def counters_key(lane: str, model: str) -> str:
    return f"{FAIR_COUNTERS_PREFIX}{queue_of(lane, model)}"


def weights(db: Session | Connection, tenants: Iterable[str] | None = None) -> dict[str, float]:
    """Each tenant's weight (of ``tenants`` only, when given): its heaviest live key's (a key
    without one weighs 1; a tenant with no key is missing, and weighs 1 where it is read)."""
    query = (
        select(ApiKey.tenant, func.max(func.coalesce(ApiKey.weight, 1.0)))
        .where(ApiKey.revoked_at.is_(None))
        .group_by(ApiKey.tenant)
    )
    if tenants is not None:
        query = query.where(ApiKey.tenant.in_(list(tenants)))
    rows = db.execute(query).all()
    return {tenant: float(weight) for tenant, weight in rows}


def counters(client: redis.Redis, lane: str, model: str) -> dict[str, float]:
    """The tokens charged to each tenant in a route."""
    raw: Mapping[bytes, bytes] = client.hgetall(counters_key(lane, model))  # type: ignore[assignment]
    return {k.decode(): float(v) for k, v in raw.items()}


@dataclass(frozen=True, slots=True)
class Usage:
    """A settlement: what a job was charged when it was sent, and what it used (0: none,
    e.g. handed back to be sent again)."""

    lane: str
    model: str
    tenant: str
    charged: int
    used: int


def charge(
    client: redis.Redis,
    lane: str,
    model: str,
    amounts: Mapping[str, int],
    raised: Mapping[str, int] | None = None,
) -> None:
    """Add ``amounts`` (tenant -> tokens) to a route's counters, and what the tenants that
    joined were lifted by (``raised``: :func:`raises`). Added, never set: a worker settling the
    tenant's jobs (:func:`settle`) between the refill's read and this write adds its own
    correction, which a counter set to the lifted level would lose."""
    raised = raised or {}
    if not amounts and not raised:
        return
    pipe = client.pipeline(transaction=False)
    key = counters_key(lane, model)
    for tenant in {*amounts, *raised}:
        pipe.hincrby(key, tenant, amounts.get(tenant, 0) + raised.get(tenant, 0))
    pipe.execute()


def raises(read: Mapping[str, float], lifted: Mapping[str, float]) -> dict[str, int]:
    """What each lifted tenant's counter goes up by: its level from :func:`join` less its
    counter as it was ``read``."""
    return {tenant: int(level) - int(read.get(tenant, 0.0)) for tenant, level in lifted.items()}


def settle(usages: Iterable[Usage]) -> None:
    """Settle ended or returned jobs: count the tokens served, and correct each tenant's
    counter by what its jobs used minus what they were charged. Redis away: logged (the
    shares drift by these jobs until the counters start again)."""
    deltas: dict[tuple[str, str, str], int] = {}
    for usage in usages:
        base = get_settings().base_of(usage.model)
        if usage.used:
            TOKENS_SERVED.labels(usage.lane, base, usage.tenant).inc(usage.used)
        route = (usage.lane, base, usage.tenant)
        deltas[route] = deltas.get(route, 0) + usage.used - usage.charged
    deltas = {route: delta for route, delta in deltas.items() if delta}
    if not deltas:
        return
    try:
        pipe = clients.redis_client().pipeline(transaction=False)
        for (lane, base, tenant), delta in deltas.items():
            pipe.hincrby(counters_key(lane, base), tenant, delta)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not settle %d tenant charge(s): %s", len(deltas), exc)


def joining(waiting: Iterable[str], before: set[str]) -> tuple[list[str], list[str]]:
    """The tenants waiting now that already waited (in ``before``), and those that join."""
    waiting = list(waiting)
    return [t for t in waiting if t in before], [t for t in waiting if t not in before]


def join(
    charged: dict[str, float],
    waiting: Iterable[str],
    before: set[str],
    weight: Mapping[str, float],
    running: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """Lift the tenants that start waiting now (not in ``before``) to just below the served
    level of those already waiting (their counters less ``running``: tenant -> what its claimed
    jobs were charged; a newcomer's own running jobs stay charged on top), or, when none was,
    to the highest among themselves. Changes ``charged`` in place and returns the lifted
    counters, to be written back."""
    old, new = joining(waiting, before)
    if not new:
        return {}
    running = running or {}

    def v(tenant: str) -> float:
        return charged.get(tenant, 0.0) / weight.get(tenant, 1.0)

    def served(tenant: str) -> float:
        return max(0.0, charged.get(tenant, 0.0) - running.get(tenant, 0.0)) / weight.get(
            tenant, 1.0
        )

    level = min(served(t) for t in old) if old else max(v(t) for t in new)
    lifted: dict[str, float] = {}
    for tenant in new:
        # A token below the level: among equals, the tenant that has had nothing yet goes
        # first (a tie would otherwise go by name).
        floor = (
            max(0.0, level * weight.get(tenant, 1.0) - 1.0)
            if old
            else level * weight.get(tenant, 1.0)
        )
        # Its own jobs still running (a tenant whose last refill sent all it had rejoins while
        # they run) are ahead of it too: its served level is lifted, they stay charged.
        own = running.get(tenant, 0.0) if old else 0.0
        if charged.get(tenant, 0.0) - own < floor:
            charged[tenant] = lifted[tenant] = floor + own
    return lifted


def allocate(
    n: int,
    waiting: Mapping[str, tuple[int, float]],
    charged: Mapping[str, float],
    weight: Mapping[str, float],
) -> list[tuple[str, float]]:
    """The next ``n`` jobs' tenants, in turn: each goes to the waiting tenant with the least
    virtual tokens, which then grow by its average job's cost over its weight. ``waiting``:
    tenant -> (jobs waiting, average cost). Returns (tenant, its virtual tokens when it got
    the job) per job, in the order given."""
    heap: list[tuple[float, str]] = []
    left: dict[str, int] = {}
    for tenant, (jobs, _) in waiting.items():
        if jobs > 0:
            heapq.heappush(heap, (charged.get(tenant, 0.0) / weight.get(tenant, 1.0), tenant))
            left[tenant] = jobs
    out: list[tuple[str, float]] = []
    while heap and len(out) < n:
        v, tenant = heapq.heappop(heap)
        out.append((tenant, v))
        left[tenant] -= 1
        if left[tenant]:
            step = max(1.0, waiting[tenant][1]) / weight.get(tenant, 1.0)
            heapq.heappush(heap, (v + step, tenant))
    return out


def by_turn(picked: Sequence[tuple[str, float]]) -> dict[str, int]:
    """Jobs per tenant in an allocation."""
    counts: dict[str, int] = {}
    for tenant, _ in picked:
        counts[tenant] = counts.get(tenant, 0) + 1
    return counts
