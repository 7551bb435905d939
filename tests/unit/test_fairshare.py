"""The fair-share rules as functions: turns by virtual tokens, joining, cost and prefixes
(app/core/scheduling/fairshare.py), and the slots a lane below a waiting lane gets
(app/dispatcher/loop.py). The dispatcher that uses them is tested on real databases in
tests/integration/test_fairshare.py."""

from __future__ import annotations

from collections import Counter

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.lifecycle import jobs
from app.core.messaging import clients
from app.core.scheduling import fairshare, limits, tokens
from app.core.settings import Settings
from app.dispatcher.loop import LiveWorker


def test_turns_follow_weights_and_costs() -> None:
    # Equal costs, weights 3:1: three jobs of A for each of B.
    turns = fairshare.allocate(
        400, {"a": (1000, 10.0), "b": (1000, 10.0)}, {}, {"a": 3.0, "b": 1.0}
    )
    counts = Counter(tenant for tenant, _ in turns)
    assert counts == {"a": 300, "b": 100}
    # Equal weights, B's jobs half the cost: two of B's for each of A's.
    turns = fairshare.allocate(300, {"a": (1000, 20.0), "b": (1000, 10.0)}, {}, {})
    assert Counter(tenant for tenant, _ in turns) == {"a": 100, "b": 200}


def test_turns_start_from_what_was_charged_and_stop_at_what_waits() -> None:
    # A was charged 100 tokens more: B goes first until it has caught up.
    turns = fairshare.allocate(12, {"a": (50, 10.0), "b": (50, 10.0)}, {"a": 100.0}, {})
    assert [tenant for tenant, _ in turns[:10]] == ["b"] * 10
    # Nobody gets more jobs than it has waiting.
    turns = fairshare.allocate(10, {"a": (3, 10.0), "b": (50, 10.0)}, {}, {})
    assert Counter(tenant for tenant, _ in turns) == {"a": 3, "b": 7}


def test_a_tenant_joining_starts_at_the_level_of_those_waiting() -> None:
    charged = {"a": 5000.0, "b": 10.0}
    lifted = fairshare.join(charged, ["a", "b"], {"a"}, {"b": 2.0})
    # b (weight 2) joins at a's virtual tokens (5000), i.e. 10000 charged tokens, less one:
    # among equals the newcomer goes first.
    assert lifted == {"b": 9999.0} and charged["b"] == 9999.0
    turns = fairshare.allocate(2, {"a": (5, 10.0), "b": (5, 10.0)}, charged, {"b": 2.0})
    assert [tenant for tenant, _ in turns] == ["b", "a"]
    # A tenant already waiting is never lifted; one above the level is not lowered.
    assert fairshare.join({"a": 1.0, "b": 99.0}, ["a", "b"], {"a"}, {}) == {}
    # Nobody waited before: the newcomers start level with the highest of them.
    assert fairshare.join({"a": 7.0}, ["a", "b"], set(), {}) == {"b": 7.0}


def test_a_tenant_joins_at_what_the_engines_served_of_the_others() -> None:
    """The jobs the others have inside the workers were charged when sent but are still ahead
    of the newcomer: it joins below them, and the next jobs are its until it has as much in."""
    charged = {"a": 5000.0, "c": 4000.0}
    running = {"a": 2000.0, "c": 500.0}
    lifted = fairshare.join(charged, ["a", "c", "b"], {"a", "c"}, {}, running)
    # a has served 3000, c 3500: the level is the lower.
    assert lifted == {"b": 2999.0}
    turns = fairshare.allocate(
        25, {"a": (50, 100.0), "b": (50, 100.0), "c": (50, 100.0)}, charged, {}
    )
    # b takes the turns up to c's served level ... then up to a's counter with c, in turn.
    assert [t for t, _ in turns[:10]] == ["b"] * 10
    assert {t for t, _ in turns[10:20]} == {"b", "c"}
    # With nothing running it is the counters' level, as before.
    assert fairshare.join({"a": 5000.0}, ["a", "b"], {"a"}, {}, {}) == {"b": 4999.0}
    # A newcomer whose own jobs still run (its last refill sent all it had) joins with them on
    # top: served at the level, and they stay charged.
    rejoined = {"a": 5000.0, "b": 2500.0}
    assert fairshare.join(rejoined, ["a", "b"], {"a"}, {}, {"a": 2000.0, "b": 1000.0}) == {
        "b": 3999.0
    }
    # One whose served level is already at the others' is not lifted.
    assert (
        fairshare.join(
            {"a": 5000.0, "b": 4500.0}, ["a", "b"], {"a"}, {}, {"a": 2000.0, "b": 1000.0}
        )
        == {}
    )


def test_cost_and_prefix_of_a_job() -> None:
    chat = JobCreate(
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "hi"},
        ],
        params={"max_tokens": 20, "n": 2},
    )
    other_user = JobCreate(
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "something else"},
        ]
    )
    assert fairshare.cost(chat) > 2 * 20  # the prompt, and every choice's max_tokens
    assert fairshare.prefix_of(chat) == fairshare.prefix_of(other_user) != ""
    assert fairshare.prefix_of(JobCreate(messages=[{"role": "user", "content": "hi"}])) == ""
    long = "x" * 300
    assert fairshare.prefix_of(JobCreate(prompt=long + "a")) == fairshare.prefix_of(
        JobCreate(prompt=long + "b")
    )
    assert fairshare.prefix_of(JobCreate(prompt="short")) == ""


def test_a_job_is_charged_the_prompt_tokens_its_model_counts(core: Settings) -> None:
    """With a model card published, a submitted job's charge is its prompt as the model counts
    it plus max_tokens, not four characters a token: a tenant overcharged at its join would win
    the difference back from the tenant that joined at its level (fairshare.join)."""
    tokens.publish(clients.redis_client(), core.model_name, 4096, tokens.WORDS)
    prompt = "fair share " + "context " * 200  # 202 words, 1,611 characters
    bodies = [JobCreate(prompt=prompt, lane="bulk", params={"max_tokens": 64})]
    with db.session_scope() as session:
        single, _ = jobs.submit(session, "t", bodies[0], core.model_name, limits.defaults())
        [many] = jobs.submit_many(session, "t", bodies, [core.model_name], limits.defaults())
    assert single.cost == many.cost == 202 + 64
    assert fairshare.cost(bodies[0]) == 403 + 64  # the estimate, without a card


def test_a_lane_below_a_waiting_lane_gets_only_the_slots_reserved_for_it() -> None:
    record = {
        "model": "m",
        "lanes": ["realtime", "standard", "bulk"],
        "concurrency": 16,
        "intake": {"reserved": {"realtime": 1, "standard": 0, "bulk": 2}},
    }
    shared = LiveWorker.of(record)
    bulk_only = LiveWorker.of({**record, "lanes": ["bulk"]})
    # Nothing waits above: bulk may have every slot.
    assert shared.slots_for("bulk", set()) == 16
    # Realtime waits: the shared worker's realtime work takes all but bulk's reservation; a
    # worker that does not consume realtime keeps all its slots for bulk.
    assert shared.slots_for("bulk", {"realtime"}) == 2
    assert shared.slots_for("standard", {"realtime"}) == 0
    assert bulk_only.slots_for("bulk", {"realtime", "standard"}) == 16
    assert bulk_only.slots_for("standard", set()) == 0
