"""One refill and one recall of a queue (app/dispatcher/refill.py), called directly on a SQLite
file and a real Redis: who goes next, how jobs are packed into messages, what is stamped and
charged, and what a recall gives back."""

from __future__ import annotations

import itertools
from typing import Any

from sqlalchemy import select

from app.core import broker, clients, db, fairshare, jobs, transitions
from app.core.changes import changes
from app.core.models import Job, now
from app.core.schemas import JobCreate
from app.core.settings import Settings
from app.dispatcher.loop import Dispatcher
from app.dispatcher.refill import Route, recall, refill

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
        weights=kw.pop("weights", {}),
        waited=kw.pop("waited", set()),
        client=clients.redis_client(),
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
    assert recall(route, 2) == 4
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
