"""Who runs next: the dispatcher's fair share, weights, deadlines, prefixes and its safety, on
SQLite and on PostgreSQL (docs/scheduling.md, "Fair share").

A real API and real dispatchers, no inference worker: the test takes each queue's messages off
Redis itself, the way a worker's consumer does (BRPOP), so the order the dispatcher chose is
read exactly, message by message. With no worker announced, a queue is kept ``DEPTH`` jobs deep
(its margin, app/dispatcher/loop.py), so every message taken makes the dispatcher pick the next.
Each test has a model (a queue) and tenants of its own. The last test runs a real worker and
shows the share settled with the tokens the jobs really used.
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from sqlalchemy import bindparam, text

from tests.conftest import PostgresDatabases, backend_stack_for
from tests.support import Stack, wait_for_job, wait_until

MODELS = ["m-share", "m-weight", "m-cost", "m-edf", "m-expire", "m-prefix", "m-twice", "m-crash"]
RUN_MODEL = "m-run"
DEPTH = 2  # jobs in a realtime or standard queue with no worker: sent before any test looks


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def stack(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    postgres: PostgresDatabases,
) -> Iterator[Stack]:
    with backend_stack_for(
        request,
        tmp_path_factory,
        postgres,
        "fair",
        workers=0,
        accepted_models=",".join([*MODELS, RUN_MODEL]),
        require_auth="true",
        bulk_chunk_size=4,
    ) as s:
        yield s


def key(stack: Stack, tenant: str, weight: float | None = None) -> httpx.Client:
    """A client with a new key of ``tenant``."""
    args = ["keys", "create", "--tenant", tenant]
    if weight is not None:
        args += ["--weight", str(weight)]
    made = stack.cli(*args)
    assert made.returncode == 0, made.stderr
    return httpx.Client(
        base_url=stack.url,
        headers={"Authorization": f"Bearer {made.stdout.strip()}"},
        timeout=30,
    )


def submit(client: httpx.Client, bodies: list[dict[str, Any]]) -> list[str]:
    response = client.post("/v1/jobs/bulk", json={"jobs": bodies})
    assert response.status_code == 202, response.text
    return [job["id"] for job in response.json()["data"]]


def take(stack: Stack, queue: str, timeout: float = 10) -> list[str]:
    """The next message of ``queue`` (the oldest: kombu pushes left, consumers pop right): its
    job ids."""
    # A socket timeout past the command's own: redis-py 8 reads with a 5 s one by default, so
    # a longer BRPOP raised TimeoutError at 5 s (CI, a dispatcher slow to start beside two
    # other stacks).
    client = redis.Redis.from_url(stack.redis_url, socket_timeout=timeout + 5)
    popped = client.brpop([queue], timeout=timeout)
    assert popped is not None, f"no message on {queue} within {timeout} s"
    message = json.loads(popped[1])
    args, _kwargs, _embed = json.loads(base64.b64decode(message["body"]))
    return list(args[0])


def take_jobs(stack: Stack, queue: str, n: int) -> list[str]:
    """The next ``n`` jobs sent on ``queue``, in the order they were sent."""
    out: list[str] = []
    while len(out) < n:
        out += take(stack, queue)
    return out


def tenants_of(stack: Stack, ids: list[str]) -> list[str]:
    query = text("SELECT id, tenant FROM jobs WHERE id IN :ids").bindparams(
        bindparam("ids", expanding=True)
    )
    with stack.db().connect() as conn:
        rows = dict(conn.execute(query, {"ids": ids}).tuples().all())
    return [rows[i] for i in ids]


def body(model: str, lane: str = "standard", max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {
        "prompt": "same size",
        "model": model,
        "lane": lane,
        "params": {"max_tokens": max_tokens},
        **extra,
    }


def test_a_late_tenant_gets_an_equal_share_at_once(stack: Stack) -> None:
    """A has 120 jobs waiting; B's 40 arrive later, yet from then on they alternate."""
    a, b = key(stack, "share-a"), key(stack, "share-b")
    queue = "standard:m-share"
    submit(a, [body("m-share")] * 120)
    first = take_jobs(stack, queue, 10)  # A alone: all A
    assert set(tenants_of(stack, first)) == {"share-a"}
    submit(b, [body("m-share")] * 40)
    after = tenants_of(stack, take_jobs(stack, queue, 60))
    # The jobs already in the list are A's, then one each in turn.
    tail = after[DEPTH:]
    counts = Counter(tail)
    assert abs(counts["share-a"] - counts["share-b"]) <= 2, "".join(t[-1] for t in after)
    # B's 40 are all out before A's backlog is: B was not behind A's 110 waiting jobs.
    more = tenants_of(stack, take_jobs(stack, queue, 30))
    assert Counter(after + more)["share-b"] == 40


def test_weights_divide_the_tokens(stack: Stack) -> None:
    """Weights 3 and 1: three of every four jobs are the heavier tenant's."""
    heavy, light = key(stack, "weight-a", 3), key(stack, "weight-b", 1)
    listed = stack.cli("keys", "list", "--tenant", "weight-a")
    assert "weight=3.0" in listed.stdout
    submit(heavy, [body("m-weight")] * 100)
    submit(light, [body("m-weight")] * 100)
    order = tenants_of(stack, take_jobs(stack, "standard:m-weight", 80 + DEPTH))[DEPTH:]
    counts = Counter(order)
    assert abs(counts["weight-a"] - 60) <= 2 and abs(counts["weight-b"] - 20) <= 2, counts


def test_the_share_is_of_tokens_not_jobs(stack: Stack) -> None:
    """Jobs twice as long cost twice as much: the other tenant gets two jobs for each one."""
    long, short = key(stack, "cost-a"), key(stack, "cost-b")
    submit(long, [body("m-cost", max_tokens=200)] * 60)
    submit(short, [body("m-cost", max_tokens=100)] * 120)
    counts = Counter(tenants_of(stack, take_jobs(stack, "standard:m-cost", 90 + DEPTH))[DEPTH:])
    assert abs(counts["cost-b"] - 2 * counts["cost-a"]) <= 3, counts


def test_a_tenants_jobs_go_earliest_deadline_first(stack: Stack) -> None:
    client = key(stack, "edf")
    queue = "standard:m-edf"
    broker = redis.Redis.from_url(stack.redis_url)
    blocker = submit(client, [body("m-edf")])  # sent alone: nothing else waits
    # The others must find it sent: a refill that saw them all would put it (no deadline) last.
    wait_until(lambda: broker.llen(queue) == 1, 10, "the first job sent")
    timeouts = [None, 300.0, 30.0, None, 120.0, 60.0]
    ids = submit(
        client,
        [body("m-edf", **({"timeout_s": t} if t else {})) for t in timeouts],
    )
    sent = take_jobs(stack, queue, 1 + len(ids))
    assert sent[0] == blocker[0]
    by_timeout = dict(zip(ids, timeouts, strict=True))
    assert [by_timeout[i] for i in sent[1:]] == [30.0, 60.0, 120.0, 300.0, None, None]
    assert set(sent[-2:]) == {ids[0], ids[3]}  # no deadline: last


def test_a_job_past_its_deadline_expires_without_being_sent(stack: Stack) -> None:
    client = key(stack, "expire")
    queue = "standard:m-expire"
    broker = redis.Redis.from_url(stack.redis_url)
    blockers = submit(client, [body("m-expire")] * DEPTH)
    wait_until(lambda: broker.llen(queue) == DEPTH, 10, "the queue at its depth")
    late = submit(client, [body("m-expire", timeout_s=1)])[0]  # waits: the queue is full
    keep = submit(client, [body("m-expire")])[0]
    time.sleep(1.5)
    assert sorted(take_jobs(stack, queue, DEPTH)) == sorted(blockers)
    assert take(stack, queue) == [keep]  # the late one was never sent
    # The refill that sent ``keep`` expired ``late`` in the same transaction, but sends its
    # messages before it commits (app/dispatcher/refill.py): the message can be taken before
    # the expiry is visible. CI read "queued" here once (PostgreSQL), a few ms early.
    job = wait_for_job(client, late, 10, {"expired"}, stack.procs)
    assert job["error"]["code"] == "deadline_exceeded"
    assert job["started_at"] is None and job["attempts"] == 0
    assert stack.scalar("SELECT enqueued_at FROM jobs WHERE id = :i", i=late) is None


def test_jobs_sharing_a_prefix_travel_together(stack: Stack) -> None:
    """Bulk messages of 4 here: lines alternating between two system prompts are sent as
    messages that each hold one prompt's lines."""
    client = key(stack, "prefix")
    systems = ["You answer in French. " * 20, "You answer in haiku. " * 20]
    lines = [
        {
            "model": "m-prefix",
            "lane": "bulk",
            "messages": [
                {"role": "system", "content": systems[i % 2]},
                {"role": "user", "content": f"question {i}"},
            ],
            "params": {"max_tokens": 8},
        }
        for i in range(16)
    ]
    ids = submit(client, lines)
    system_of = {job_id: i % 2 for i, job_id in enumerate(ids)}
    messages = []
    while sum(len(m) for m in messages) < 16:
        messages.append(take(stack, "bulk:m-prefix"))
    for message in messages:
        assert len({system_of[i] for i in message}) == 1, messages
    assert sorted(i for m in messages for i in m) == sorted(ids)


def test_two_dispatchers_never_send_a_job_twice(stack: Stack) -> None:
    """A second dispatcher races the first for every message taken: each job is sent once."""
    second = stack.start_dispatcher("dispatch-2")
    try:
        clients = [key(stack, f"twice-{n}") for n in range(3)]
        ids = [i for c in clients for i in submit(c, [body("m-twice")] * 100)]
        sent = take_jobs(stack, "standard:m-twice", len(ids))
        assert len(sent) == len(set(sent)) == len(ids)
        assert set(sent) == set(ids)
        time.sleep(0.5)  # nothing more comes
        assert redis.Redis.from_url(stack.redis_url).llen("standard:m-twice") == 0
    finally:
        second.stop()


CRASH = """
import os
from app.core.messaging import broker, clients
from app.dispatcher import refill

send = broker.send_jobs

def send_then_die(batch):
    send(batch)
    os._exit(1)  # after the messages went out, before the transaction committed

broker.send_jobs = send_then_die
refill.refill(refill.Route("standard", "m-crash"), 5, policy="fair", unit=1,
              waited=set(), client=clients.redis_client())
"""


def test_a_dispatcher_that_dies_mid_send_loses_nothing(stack: Stack) -> None:
    queue = "standard:m-crash"
    broker = redis.Redis.from_url(stack.redis_url)
    live = next(p for p in stack.procs if p.name == "dispatch" and p.alive())
    live.stop()  # this test's own dispatcher decides when jobs are sent
    ids = submit(key(stack, "crash"), [body("m-crash")] * 5)
    crashed = stack.python(CRASH)
    assert crashed.returncode == 1, crashed.stderr
    # Its messages went out, but its transaction never committed: the jobs are still unsent.
    assert broker.llen(queue) == 5
    unsent = "SELECT count(*) FROM jobs WHERE model = 'm-crash' AND enqueued_at IS NULL"
    assert stack.scalar(unsent) == 5
    # A dispatcher started again sends them again: nothing is lost, and each job has at most
    # one message too many (a second message claims nothing: docs/reliability.md, "Reliability
    # contract").
    stack.start_dispatcher()
    # A process to start first (two Python starts: `inferq dispatch` execs the loop's own), which
    # took more than 10 s beside the other two xdist workers' stacks on two cores.
    seen = [job_id for _ in range(10) for job_id in take(stack, queue, timeout=60)]
    assert Counter(seen) == dict.fromkeys(ids, 2)
    wait_until(lambda: stack.scalar(unsent) == 0, 10, "every job stamped sent")


def test_a_worker_settles_each_tenants_share_with_what_it_used(stack: Stack) -> None:
    """With a real worker: every job runs once, and each tenant's counter ends at the tokens
    its jobs really used (charged the estimate when sent, settled at the end)."""
    worker = stack.start_worker(served_model_name=RUN_MODEL, worker_concurrency=4)
    try:
        a, b = key(stack, "run-a"), key(stack, "run-b")
        mine = {
            a: submit(a, [body(RUN_MODEL, lane="bulk", max_tokens=12)] * 30),
            b: submit(b, [body(RUN_MODEL, lane="bulk", max_tokens=6)] * 30),
        }
        for client, ids in mine.items():
            for job_id in ids:
                wait_for_job(client, job_id, 60, {"succeeded"}, stack.procs)
        fair = redis.Redis.from_url(stack.redis_url)
        used = {
            tenant: int(
                stack.scalar(
                    "SELECT sum(prompt_tokens + completion_tokens) FROM jobs WHERE tenant = :t",
                    t=tenant,
                )
            )
            for tenant in ("run-a", "run-b")
        }
        # Charged cost(job) when sent, settled by used - cost at the end: what it used. B,
        # which may have joined while A's jobs waited, starts from A's level (join), not 0.
        # Settled once the outcome has committed (app/core/lifecycle/changes.py): the last
        # job can read succeeded a moment before.

        def settled() -> Any:
            found = fair.hgetall(f"inferq:fair:bulk:{RUN_MODEL}")
            return found if int(found.get(b"run-a", 0)) == used["run-a"] else None

        counters = wait_until(settled, 10, f"run-a's counter at {used['run-a']}")
        assert int(counters[b"run-b"]) >= used["run-b"]
        assert stack.scalar("SELECT max(attempts) FROM jobs WHERE model = :m", m=RUN_MODEL) == 1
    finally:
        worker.stop()
