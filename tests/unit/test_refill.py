"""One refill and one recall of a queue (app/dispatcher/refill.py), called directly on a SQLite
file and a real Redis: who goes next, how jobs are packed into messages, what is stamped and
charged, and what a recall gives back."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from sqlalchemy import select

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.messaging import broker, clients
from app.core.messaging.names import own_queue, own_queues
from app.core.models import Job, now
from app.core.scheduling import fairshare
from app.core.settings import Settings
from app.core.tenants import keys
from app.dispatcher.affinity import home
from app.dispatcher.loop import Dispatcher
from app.dispatcher.plan import LiveWorker
from app.dispatcher.refill import Affine, Route, recall, refill

# Submission times a millisecond apart, in the order of the calls (ids of one millisecond are
# ordered by their random bits, so a tenant's own order is read from the ids).
_TICKS = itertools.count()
_START = now()


def add(
    settings: Settings, tenant: str, n: int, *, lane: str = "standard", **body: Any
) -> list[str]:
    """``n`` jobs of ``tenant``, committed for the dispatcher, each submitted after the last;
    their ids in that order."""
    made = []
    for i in range(n):
        job = JobCreate(prompt=f"{tenant} {i}", lane=lane, params={"max_tokens": 8}, **body)
        created = _START + next(_TICKS) * 1e-3
        made.append(jobs.new_job(tenant, job, settings.model_name, created=created))
    with changes("api") as tx:
        transitions.create(tx, made)
    return [job.id for job in made]


def messages(route: Route) -> list[broker.RunJobs]:
    """The route's list, oldest message first (the end workers take from)."""
    raw = clients.redis_client().lrange(route.queue, 0, -1)
    return [broker.RunJobs.of_stored(payload) for payload in reversed(raw)]


def rows(ids: list[str]) -> dict[str, Any]:
    with db.transaction() as connection:
        found = connection.execute(select(Job.__table__).where(Job.id.in_(ids))).all()
    return {row.id: row for row in found}


def fill(route: Route, n: int, policy: str = "fair", unit: int = 1, **kw: Any) -> Any:
    return refill(
        route,
        n,
        policy=policy,
        unit=unit,
        waited=kw.pop("waited", set()),
        client=clients.redis_client(),
        affine=kw.pop("affine", None),
    )


def test_tenants_take_turns_and_each_pick_is_stamped_and_charged(core: Settings) -> None:
    route = Route("standard", core.model_name)
    a = sorted(add(core, "a", 10))  # a tenant's jobs go by id (no deadlines, no prefixes)
    b = add(core, "b", 3)
    done = fill(route, 6)
    assert (done.sent, done.expired, done.waiting) == (6, 0, {"a"})
    sent = [m.job_ids[0] for m in messages(route)]
    assert sorted(sent) == sorted(a[:3] + b)  # three each, each tenant's first three
    tenants = ["a" if job_id in a else "b" for job_id in sent]
    assert tenants.count("a") == tenants.count("b") == 3
    assert all(tenants[i] != tenants[i + 1] for i in range(0, 6, 2))  # interleaved in turns
    stored = rows(a + b)
    assert all(stored[i].enqueued_at is not None and stored[i].charged > 0 for i in sent)
    assert all(stored[i].enqueued_at is None for i in a[3:])
    counters = fairshare.counters(clients.redis_client(), route.lane, route.model)
    assert counters == {
        t: sum(stored[i].charged for i in sent if i in ids) for t, ids in (("a", a), ("b", b))
    }


def test_a_key_weight_counts_from_the_first_refill_after_it_is_created(core: Settings) -> None:
    """Weights are read in the refill's transaction: a tenant whose key of weight 3 was made
    a moment before its jobs arrived takes three turns to one at once (a copy read every few
    seconds gave it one to one until then)."""
    route = Route("standard", core.model_name)
    with db.session_scope() as session:
        keys.create_key(session, "heavy", weight=3)
    heavy = add(core, "heavy", 12)
    add(core, "light", 12)
    fill(route, 8)
    tenants = ["heavy" if m.job_ids[0] in heavy else "light" for m in messages(route)]
    assert (tenants.count("heavy"), tenants.count("light")) == (6, 2), tenants


def test_a_settlement_during_a_refill_that_lifts_its_tenant_is_kept(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant that joins is lifted to the others' level, from its counter as the refill read
    it; a worker settling that tenant's earlier jobs meanwhile adds to the counter in Redis.
    The lift is added too, so the settlement stays (it was set, and the settlement was lost)."""
    route = Route("standard", core.model_name)
    client = clients.redis_client()
    fairshare.charge(client, route.lane, route.model, {"a": 5000, "b": 10})
    add(core, "a", 3)
    b = add(core, "b", 3)
    weights = fairshare.weights

    def settled_meanwhile(*args: Any, **kwargs: Any) -> dict[str, float]:
        # After the refill read the counters: b's earlier job charged 100 used 40.
        fairshare.settle([fairshare.Usage(route.lane, route.model, "b", charged=100, used=40)])
        return weights(*args, **kwargs)

    monkeypatch.setattr(fairshare, "weights", settled_meanwhile)
    fill(route, 4, waited={"a"})  # b joins: lifted to a's level less one token, 4999
    stored = rows(b)
    spent = sum(stored[i].charged for i in b if stored[i].enqueued_at is not None)
    assert spent > 0
    counters = fairshare.counters(client, route.lane, route.model)
    assert counters["b"] == 4999 - 60 + spent


def test_arrival_order_sends_the_oldest_whoever_submitted_them(core: Settings) -> None:
    route = Route("standard", core.model_name)
    a = add(core, "a", 5)
    add(core, "b", 3)
    fill(route, 4, policy="arrival")
    assert [m.job_ids[0] for m in messages(route)] == a[:4]


def test_bulk_messages_carry_one_tenant_and_one_prompt_prefix_each(core: Settings) -> None:
    route = Route("bulk", core.model_name)
    system = "You are a careful assistant. " * 20
    shared = [{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    chats = []
    for _ in range(5):
        body = JobCreate(messages=shared, lane="bulk", params={"max_tokens": 8})
        chats.append(jobs.new_job("a", body, core.model_name))
    with changes("api") as tx:
        transitions.create(tx, chats)
    plain = add(core, "a", 3, lane="bulk")
    fill(route, 8, unit=4)
    sent = messages(route)
    assert all(len(m.job_ids) <= 4 and m.lane == "bulk" for m in sent)
    for message in sent:  # never a chat of the shared system prompt beside a plain prompt
        kinds = {job_id in plain for job_id in message.job_ids}
        assert len(kinds) == 1
    assert sorted(i for m in sent for i in m.job_ids) == sorted([c.id for c in chats] + plain)


def test_long_prompts_that_share_nothing_fill_whole_messages(core: Settings) -> None:
    """Each of these prompts has a prefix (longer than fairshare.PREFIX_CHARS) that no other
    job shares: they are packed unit a message, not one a message (the plan counts a queue's
    jobs as unit a message)."""
    route = Route("bulk", core.model_name)
    ids = []
    for i in range(8):
        body = JobCreate(prompt=f"line {i} " + "context " * 60, lane="bulk")
        ids.append(jobs.new_job("a", body, core.model_name))
    with changes("api") as tx:
        transitions.create(tx, ids)
    assert len({job.prefix for job in ids}) == 8 and all(job.prefix for job in ids)
    fill(route, 8, unit=4)
    assert sorted(len(m.job_ids) for m in messages(route)) == [4, 4]


def test_an_overdue_job_expires_in_the_refill_unsent(core: Settings) -> None:
    route = Route("standard", core.model_name)
    [late] = add(core, "a", 1, timeout_s=0.001)
    [fresh] = add(core, "a", 1)
    done = fill(route, 5)
    assert (done.sent, done.expired) == (1, 1)
    stored = rows([late, fresh])
    assert stored[late].status == "expired" and stored[late].enqueued_at is None
    assert [m.job_ids for m in messages(route)] == [[fresh]]


def test_a_recall_takes_the_newest_messages_back_and_refunds_them(core: Settings) -> None:
    route = Route("bulk", core.model_name)
    ids = sorted(add(core, "a", 6, lane="bulk"))
    fill(route, 6, unit=2)
    before = fairshare.counters(clients.redis_client(), route.lane, route.model)["a"]
    assert recall([route.queue], 2) == 4
    left = messages(route)
    assert [sorted(m.job_ids) for m in left] == [ids[:2]]  # the oldest message stays
    stored = rows(ids)
    taken = ids[2:]
    assert all(stored[i].enqueued_at is None and stored[i].charged == 0 for i in taken)
    refunded = sum(rows(ids[:2])[i].charged for i in ids[:2])
    after = fairshare.counters(clients.redis_client(), route.lane, route.model)["a"]
    assert before > after == refunded


def test_a_tenant_that_starts_waiting_gets_the_list_refilled_in_the_fair_order(
    core: Settings,
) -> None:
    """A's messages fill the list; B submits: the dispatcher takes the list back and the next
    refill sends B's first job before A's (app/dispatcher/loop.py, ``_make_way``)."""
    route = Route("bulk", core.model_name)
    client = clients.redis_client()
    dispatcher = Dispatcher(core, client)
    add(core, "a", 20, lane="bulk")
    done = fill(route, 12, unit=4)
    dispatcher.waited[route] = done.waiting
    assert client.rpop(route.queue)  # a worker took A's first message: it stays charged
    assert done.waiting == {"a"} and len(messages(route)) == 2
    # Nobody new: the list stays.
    assert dispatcher._make_way({route}, {route: 2}) == {route: 2}
    # A tenant whose own messages are all the list holds waits behind nobody else's: it stays.
    alone = Route("standard", core.model_name)
    [listed] = add(core, "solo", 1)
    fill(alone, 1)
    add(core, "solo", 2)
    assert dispatcher._make_way({alone}, {alone: 1}) == {alone: 1}
    assert [m.job_ids for m in messages(alone)] == [[listed]]
    b = add(core, "b", 4, lane="bulk")
    assert dispatcher._make_way({route}, {route: 2}) == {route: 0}
    assert dispatcher.recalled == 8
    done = fill(route, 8, unit=4, waited=dispatcher.waited[route])
    first = messages(route)[0]
    assert sorted(first.job_ids) == sorted(b), "the newcomer goes first among equals"
    # At most once a MAKE_WAY_S a queue.
    add(core, "c", 4, lane="bulk")
    assert dispatcher._make_way({route}, {route: 2}) == {route: 2}


# --- prefix affinity: where the messages go (app/dispatcher/affinity.py) -------------------------

WORKERS = ["vm:101", "vm:202"]


def chats(settings: Settings, tenant: str, prompts: list[str]) -> list[str]:
    """Standard chat jobs of ``tenant``, one per system prompt in ``prompts``."""
    made = []
    for i, system in enumerate(prompts):
        messages_ = [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]
        body = JobCreate(messages=messages_, lane="standard", params={"max_tokens": 8})
        made.append(jobs.new_job(tenant, body, settings.model_name))
    with changes("api") as tx:
        transitions.create(tx, made)
    return [job.id for job in made]


def own_messages(route: Route, worker: str) -> list[list[str]]:
    raw = clients.redis_client().lrange(own_queue(route.lane, route.model, worker), 0, -1)
    return [broker.RunJobs.of_stored(payload).job_ids for payload in reversed(raw)]


def test_a_refill_sends_each_prefix_to_its_home_and_the_rest_to_the_shared_queue(
    core: Settings,
) -> None:
    route = Route("standard", core.model_name)
    prompts = [f"policy {i} " + "rules " * 80 for i in range(6)]
    ids = chats(core, "a", prompts)
    [plain] = add(core, "a", 1)  # a short prompt: no prefix
    affine = Affine(WORKERS, {}, 0, 10.0)  # a loose bound: every prefix goes home
    done = fill(route, 7, affine=affine)
    assert done.sent == 7 and sum(done.sent_to.values()) == 6 and not done.overflow
    by_id = rows(ids)
    for worker in WORKERS:
        for [job_id] in own_messages(route, worker):
            assert home(by_id[job_id].prefix, WORKERS) == worker
    assert [m.job_ids for m in messages(route)] == [[plain]]
    assert set(own_queues(clients.redis_client())) == {
        own_queue("standard", core.model_name, w) for w in done.sent_to
    }


def test_past_the_bound_the_shared_queue(core: Settings) -> None:
    """Eight jobs of one prefix: its home takes them while under c x the mean (the others run
    nothing), the rest go to the shared queue and count as its overflow."""
    route = Route("standard", core.model_name)
    chats(core, "a", ["hot " + "rules " * 80] * 8)
    done = fill(route, 8, affine=Affine(WORKERS, {}, 0, 1.25))
    [(hot, sent)] = done.sent_to.items()
    assert sent + done.overflow[hot] == 8 and 0 < sent < 8
    assert len(messages(route)) == done.overflow[hot]


def test_a_gone_workers_own_queue_is_taken_back_and_forgotten(core: Settings) -> None:
    route = Route("standard", core.model_name)
    ids = chats(core, "a", [f"policy {i} " + "rules " * 80 for i in range(6)])
    fill(route, 6, affine=Affine(WORKERS, {}, 0, 1.25))
    dispatcher = Dispatcher(core, clients.redis_client())
    alive = LiveWorker(
        core.model_name, frozenset({"standard"}), 8, {}, WORKERS[0], frozenset({"standard"})
    )
    gone = own_queue("standard", core.model_name, WORKERS[1])
    held = [job_id for [job_id] in own_messages(route, WORKERS[1])]
    assert held
    dispatcher._take_back_gone([alive])
    assert clients.redis_client().llen(gone) == 0 and gone not in own_queues(clients.redis_client())
    assert all(rows(held)[i].enqueued_at is None for i in held)  # unsent: sent again
    kept = [i for i in ids if i not in held]
    assert all(rows(kept)[i].enqueued_at is not None for i in kept)
    assert route in dispatcher.backlog and dispatcher.recalled == len(held)


def test_a_long_own_queue_is_halved_for_a_worker_with_nothing_listed(core: Settings) -> None:
    route = Route("standard", core.model_name)
    client = clients.redis_client()
    prompts = [f"policy {i} " + "rules " * 80 for i in range(40)]
    mine = [p for p in prompts if home(fairshare_prefix(p), WORKERS) == WORKERS[0]][:6]
    chats(core, "a", mine)
    fill(route, 6, affine=Affine(WORKERS, {}, 0, 10.0))
    dispatcher = Dispatcher(core, client)
    dispatcher._own = {route: {WORKERS[0]: 6, WORKERS[1]: 0}}
    dispatcher._shared = {route: 0}
    depths = dispatcher._rebalance({route: 6})
    assert depths == {route: 3} and len(own_messages(route, WORKERS[0])) == 3
    assert dispatcher.rebalanced == 3 and route in dispatcher.backlog
    # At most once a REBALANCE_S.
    dispatcher._own = {route: {WORKERS[0]: 3, WORKERS[1]: 0}}
    assert dispatcher._rebalance({route: 3}) == {route: 3}


def fairshare_prefix(system: str) -> str:
    body = JobCreate(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "q"}]
    )
    return fairshare.prefix_of(body)
