"""One refill of one queue: which waiting jobs go next, sent in one transaction.

A queue is a lane of a model (``names.queue_of``); its waiting jobs are its ``queued`` rows
with no message out (``models.UNSENT``). A refill of ``n`` jobs:

1. expires the waiting jobs whose deadline has passed: they never reach an engine;
2. picks the next ``n`` by the policy. ``fair``: tenants take turns by virtual tokens
   (app/core/scheduling/fairshare.py), and a tenant's own jobs go earliest deadline first, then one
   prompt prefix together, then arrival::

       order within a tenant = (deadline_at, nulls last; prefix; id)

   ``arrival``: in submission order (a batch's lines in line order), whoever submitted them
   (the comparison of the ``fairness`` and ``prefix`` benchmarks);
3. stamps them sent and charged (``transitions.mark_sent``), sends their messages and commits
   - the sends inside the transaction, so that a dispatcher that dies in between leaves them
   unsent, to be sent again: at worst a job gets a second message, whose claim (a
   compare-and-set on ``queued``) takes nothing. The rows are taken with ``FOR UPDATE SKIP
   LOCKED`` on PostgreSQL and under SQLite's single write lock, so two dispatchers never pick
   the same job. The tenants are charged in Redis once it has committed.

The inverse, :func:`recall`: the newest messages of a queue are taken back out of its list and
their jobs marked unsent again (``transitions.take_back``, refunded), when a lane above it has
jobs waiting (app/dispatcher/plan.py says when).

Messages keep one tenant each and follow the turns: a tenant's chunk goes out at the virtual
tokens its first job was given, so the engine takes the tenants' work interleaved as it was
picked (docs/architecture.md, "Fair share").
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from sqlalchemy import ColumnElement, and_, func, select

from app.core.db import session_scope
from app.core.lifecycle import transitions
from app.core.lifecycle.after import Charge, Tx
from app.core.lifecycle.changes import changes
from app.core.messaging import broker
from app.core.messaging.names import own_queue, queue_of
from app.core.models import UNSENT, Job, JobStatus, live, now
from app.core.scheduling import catalog, fairshare
from app.dispatcher.affinity import Placement

log = logging.getLogger("inferq.dispatcher")

# What a pick returns of each job: enough to order and charge it.
PICKED = (
    Job.id,
    Job.tenant,
    Job.cost,
    Job.deadline_at,
    Job.prefix,
    Job.created_at,
    Job.batch_line,
)


@dataclass(frozen=True, order=True)
class Route:
    """A queue: a lane of a (base) model."""

    lane: str
    model: str

    @property
    def queue(self) -> str:
        return queue_of(self.lane, self.model)

    @classmethod
    def of_queue(cls, name: str) -> Route:
        lane, _, model = name.partition(":")
        return cls(lane, model)


@dataclass
class Refilled:
    """What a refill did: jobs sent and expired, and whether jobs still wait."""

    sent: int = 0
    expired: int = 0
    waiting: set[str] = field(default_factory=set)  # tenants with jobs left unsent
    sent_to: dict[str, int] = field(default_factory=dict)  # jobs sent to workers' own queues
    overflow: dict[str, int] = field(default_factory=dict)  # ... whose worker was past the bound


@dataclass
class Chosen:
    """What the policy picked: each tenant's rows in its order, the virtual tokens at which it
    got each of them (its turns), and what joining tenants' counters were lifted by."""

    rows: dict[str, list[Any]]
    turns: dict[str, list[float]]
    raised: dict[str, int] = field(default_factory=dict)


def _waiting(route: Route) -> ColumnElement[bool]:
    # UNSENT is the partial index's own predicate, written out, so PostgreSQL uses the index
    # whatever plan it caches for the statement.
    return and_(UNSENT, Job.lane == route.lane, Job.model.in_(catalog.served_names(route.model)))


def _running_charges(tx: Tx, route: Route, tenants: Sequence[str]) -> dict[str, float]:
    """What ``tenants``' jobs claimed by workers on ``route`` were charged: the work ahead of a
    tenant that joins, which it cannot pass (``fairshare.join``)."""
    rows = tx.connection.execute(
        select(Job.tenant, func.coalesce(func.sum(Job.charged), 0))
        .where(
            live(JobStatus.RUNNING),
            Job.lane == route.lane,
            Job.model.in_(catalog.served_names(route.model)),
            Job.tenant.in_(tenants),
        )
        .group_by(Job.tenant)
    )
    return {tenant: float(total) for tenant, total in rows}


def _in_order(rows: Sequence[Any]) -> list[Any]:
    """A tenant's picked rows in its own order (an UPDATE returns them in any order)."""
    return sorted(
        rows,
        key=lambda r: (r.deadline_at is None, r.deadline_at or 0.0, r.prefix, r.id),
    )


def _pick(
    tx: Tx,
    waiting: ColumnElement[bool],
    n: int,
    stamp: float,
    tenant: str | None,
) -> list[Any]:
    """Stamp the next ``n`` ``waiting`` jobs of ``tenant`` (None: anyone's, by arrival) sent
    and charged; returns them."""
    which = [waiting]
    if tenant is None:
        # Submission order: a request's jobs share created_at, a batch's lines keep theirs.
        order: tuple[Any, ...] = (Job.created_at, Job.batch_line, Job.id)
    else:
        which.append(Job.tenant == tenant)
        order = (Job.deadline_at.asc().nulls_last(), Job.prefix, Job.id)
    # A CTE, materialized: PostgreSQL may run a LIMIT ... SKIP LOCKED subquery of an IN once
    # per outer row, each run skipping the rows the last one locked, and so update more than n.
    chosen = (
        select(Job.id)
        .where(*which)
        .order_by(*order)
        .limit(n)
        .with_for_update(skip_locked=True)
        .cte("chosen")
        .prefix_with("MATERIALIZED", dialect="postgresql")
    )
    return transitions.mark_sent(tx, select(chosen.c.id), stamp, PICKED)


def _messages(
    unit: int, rows: Mapping[str, list[Any]], turns: Mapping[str, list[float]]
) -> list[tuple[str, list[str]]]:
    """Each tenant's jobs in messages of at most ``unit``, the messages in the order of their
    first job's turn, each with the prompt prefix its jobs share ('' for none). Jobs that share
    a prompt prefix in this pick go together, one prefix a message; jobs with no prefix, or with
    one no other job of the pick shares, fill messages of their own. (A message for each such
    job would make every message one job, while the plan counts a queue's jobs as ``unit`` a
    message: app/dispatcher/plan.py. Long prompts that differ in their first characters, a
    batch's usual lines, would then starve the workers.) A message of one job keeps its prefix:
    prefix affinity sends it to the worker that holds it (app/dispatcher/affinity.py)."""
    keyed: list[tuple[float, str, str, list[str]]] = []
    for tenant, picked in rows.items():
        at = turns.get(tenant) or [0.0]
        sharing = Counter(row.prefix for row in picked)
        filling: dict[str, tuple[float, list[str]]] = {}  # prefix -> (first turn, message)
        for i, row in enumerate(picked):
            prefix = row.prefix if sharing[row.prefix] > 1 or unit == 1 else ""
            turn, message = filling.setdefault(prefix, (at[min(i, len(at) - 1)], []))
            message.append(row.id)
            if len(message) == unit:
                keyed.append((turn, tenant, prefix, message))
                del filling[prefix]
        keyed.extend((turn, tenant, prefix, message) for prefix, (turn, message) in filling.items())
    keyed.sort(key=lambda item: (item[0], item[1]))
    return [(prefix, ids) for _, _, prefix, ids in keyed]


@dataclass(frozen=True)
class Affine:
    """What the loop saw for prefix affinity on a route: the live workers that consume its own
    queues, the jobs listed in each one's own queue and in the shared queue, and ``c``."""

    workers: list[str]
    listed: dict[str, int]
    shared: int
    factor: float


def _running(tx: Tx, route: Route, workers: Sequence[str]) -> dict[str, int]:
    """The jobs of ``route``'s model each of ``workers`` runs now (its claimed jobs): load."""
    rows = tx.connection.execute(
        select(Job.lease_owner, func.count())
        .where(
            live(JobStatus.RUNNING),
            Job.model.in_(catalog.served_names(route.model)),
            Job.lease_owner.in_(workers),
        )
        .group_by(Job.lease_owner)
    )
    return {str(owner): int(n) for owner, n in rows}


def _placed(
    tx: Tx, route: Route, messages: list[tuple[str, list[str]]], affine: Affine | None
) -> tuple[list[tuple[str, list[str]]], Placement | None]:
    """Each message with its queue: a worker's own (prefix affinity) or the route's."""
    if affine is None or len(affine.workers) < 2:
        return [(route.queue, ids) for _, ids in messages], None
    placement = Placement.of(
        affine.workers,
        _running(tx, route, affine.workers),
        affine.listed,
        affine.shared,
        affine.factor,
    )
    batch = []
    for prefix, ids in messages:
        worker = placement.place(prefix, len(ids))
        queue = route.queue if worker is None else own_queue(route.lane, route.model, worker)
        batch.append((queue, ids))
    return batch, placement


def refill(
    route: Route,
    n: int,
    *,
    policy: str,
    unit: int,
    waited: set[str],
    client: redis.Redis,
    affine: Affine | None = None,
) -> Refilled:
    """Send up to ``n`` of ``route``'s waiting jobs (``unit`` a message), chosen by ``policy``.
    ``waited``: the tenants that had jobs waiting at this route's last refill (a tenant not
    among them joins the share now: ``fairshare.join``). ``affine``: the route's jobs go by
    prefix affinity (app/dispatcher/affinity.py), else all to its shared queue."""
    stamp = now()
    done = Refilled()
    spent: dict[str, int] = {}  # tenant -> tokens charged by this refill
    waiting = _waiting(route)
    with changes("dispatcher") as tx:
        done.expired = transitions.expire_queued(tx, and_(waiting, Job.deadline_at <= stamp), stamp)
        backlog = {
            row.tenant: (int(row.jobs), float(row.cost) / max(1, int(row.jobs)))
            for row in tx.connection.execute(
                select(
                    Job.tenant,
                    func.count().label("jobs"),
                    func.coalesce(func.sum(Job.cost), 0).label("cost"),
                )
                .where(waiting)
                .group_by(Job.tenant)
            )
        }
        if backlog:
            chosen = _choose(tx, route, waiting, n, stamp, policy, backlog, waited, client)
            batch, placement = _placed(
                tx, route, _messages(unit, chosen.rows, chosen.turns), affine
            )
            failed = set(broker.send_jobs(batch))
            if placement is not None and not failed:
                done.sent_to, done.overflow = placement.sent, placement.overflow
            transitions.send_failed(tx, failed)
            left = {t: jobs for t, (jobs, _) in backlog.items()}
            for row in (row for picked in chosen.rows.values() for row in picked):
                if row.id not in failed:
                    spent[row.tenant] = spent.get(row.tenant, 0) + int(row.cost)
                    left[row.tenant] -= 1
                    done.sent += 1
            done.waiting = {t for t, jobs in left.items() if jobs > 0}
            tx.after.charges.append(Charge(route.lane, route.model, spent, chosen.raised))
    return done


def _choose(
    tx: Tx,
    route: Route,
    waiting: ColumnElement[bool],
    n: int,
    stamp: float,
    policy: str,
    backlog: Mapping[str, tuple[int, float]],
    waited: set[str],
    client: redis.Redis,
) -> Chosen:
    """Pick (and stamp) up to ``n`` of the ``waiting`` jobs by ``policy``. The waiting tenants'
    weights are read here, in the refill's transaction: a key created (or revoked) a moment
    before its jobs arrive counts from their first refill. (A copy kept for seconds gave a
    new tenant of weight 3 the share of weight 1 until it was read again.)"""
    if policy == "arrival":
        picked = _pick(tx, waiting, n, stamp, None)
        in_order = sorted(picked, key=lambda r: (r.created_at, r.batch_line or 0, r.id))
        return Chosen({"": in_order}, {"": [0.0]})
    charged = fairshare.counters(client, route.lane, route.model)
    weights = fairshare.weights(tx.connection, backlog)
    old, new = fairshare.joining(backlog, waited)
    running = _running_charges(tx, route, [*old, *new]) if new and old else {}
    read = dict(charged)  # join lifts the joining tenants' counters in place
    lifted = fairshare.join(charged, backlog, waited, weights, running)
    turns: dict[str, list[float]] = {}
    for tenant, v in fairshare.allocate(n, backlog, charged, weights):
        turns.setdefault(tenant, []).append(v)
    rows = {
        tenant: _in_order(_pick(tx, waiting, len(given), stamp, tenant))
        for tenant, given in turns.items()
    }
    return Chosen(rows, turns, fairshare.raises(read, lifted))


def must_make_way(route: Route, waited: set[str], queues: Sequence[str]) -> bool:
    """Whether a tenant with jobs waiting to be sent on ``route``, not among ``waited`` (those
    waiting at its last refill), would wait behind another tenant's messages in its lists
    ``queues`` (the shared one and the workers' own)."""
    with session_scope() as session:
        joined = set(session.scalars(select(Job.tenant).where(_waiting(route)).distinct()))
        joined -= waited
        if not joined:
            return False
        ids = [
            job_id
            for name in queues
            for message in broker.listed(name)
            for job_id in message.job_ids
        ]
        if not ids:
            return False
        listed = session.scalars(select(Job.tenant).where(Job.id.in_(ids)).distinct())
        return any(tenant not in joined for tenant in listed)


def recall(queues: Sequence[str], messages: int) -> int:
    """Take up to ``messages`` of the newest messages out of the lists ``queues``, in that
    order (a route's shared list, then the workers' own lists of it); their jobs wait unsent
    again, for a later refill. Returns how many jobs. A dispatcher that dies between the two
    steps leaves jobs marked sent with no message: the reaper finds them when the lists are
    empty, as any lost message (workers/ops/reaper.py)."""
    taken: list[broker.RunJobs] = []
    for name in queues:
        if len(taken) >= messages:
            break
        taken += broker.take_newest(name, messages - len(taken))
    ids = [job_id for message in taken for job_id in message.job_ids]
    if not ids:
        return 0
    with changes("dispatcher") as tx:
        transitions.take_back(tx, ids)
    return len(ids)
