"""Admission (app/core/scheduling/limits.py) called directly, on a SQLite file and a real Redis:
tenant rate and token windows, the tenant's queued jobs, and each lane's backpressure per model."""

from __future__ import annotations

import time

import pytest

from app.core import db
from app.core.contract.jobs import JobCreate
from app.core.errors import DomainError, Kind
from app.core.lifecycle import jobs, transitions
from app.core.lifecycle.changes import changes
from app.core.scheduling import limits
from app.core.settings import Settings, get_settings


def body(lane: str = "standard", max_tokens: int = 10, words: int = 4) -> JobCreate:
    return JobCreate(prompt="w " * words, lane=lane, params={"max_tokens": max_tokens})


def admit(caller: limits.Limits, *bodies: JobCreate, model: str = "") -> None:
    model = model or get_settings().model_name
    with db.session_scope() as session:
        limits.admit(session, "t", caller, bodies, [model] * len(bodies))


def refused(caller: limits.Limits, *bodies: JobCreate, model: str = "") -> DomainError:
    with pytest.raises(DomainError) as caught:
        admit(caller, *bodies, model=model)
    return caught.value


def queue_jobs(n: int, lane: str = "standard", model: str = "") -> None:
    model = model or get_settings().model_name
    new = [jobs.new_job("t", body(lane), model) for _ in range(n)]
    with changes("api") as tx:
        transitions.create(tx, new)


def test_the_request_rate_is_counted_per_window_and_refused_past_it(core: Settings) -> None:
    caller = limits.Limits(requests_per_minute=2, tokens_per_minute=0, max_queued=0)
    admit(caller, body())
    admit(caller)  # a call that submits no job (a batch) counts too
    over = refused(caller, body())
    assert (over.kind, over.code, over.limit) == (
        Kind.OVER_LIMIT,
        "requests_per_minute_exceeded",
        "requests_per_minute",
    )
    assert over.retry_after_s is not None and over.retry_after_s >= 1


def test_a_refused_call_gives_back_what_it_took(core: Settings) -> None:
    caller = limits.Limits(requests_per_minute=0, tokens_per_minute=50, max_queued=0)
    admit(caller, body(max_tokens=30))  # about 2 prompt tokens + 30
    assert refused(caller, body(max_tokens=30)).code == "tokens_per_minute_exceeded"
    admit(caller, body(max_tokens=10))  # the refused call's tokens were refunded


def test_a_tenant_may_hold_only_so_many_queued_jobs(core: Settings) -> None:
    caller = limits.Limits(requests_per_minute=0, tokens_per_minute=0, max_queued=3)
    queue_jobs(2)
    admit(caller, body())
    over = refused(caller, body(), body())
    assert over.code == "max_queued_exceeded" and over.kind == Kind.OVER_LIMIT


def test_a_lane_sheds_by_the_work_ahead_of_it_on_its_own_model(
    core: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERQ_LANE_MAX_QUEUED", '{"realtime": 3, "bulk": 3}')
    monkeypatch.setenv("INFERQ_ACCEPTED_MODELS", "other")
    get_settings.cache_clear()
    caller = limits.defaults()
    queue_jobs(2, "realtime")
    queue_jobs(1, "standard")
    queue_jobs(5, "bulk", model="other")
    time.sleep(limits.BACKLOG_CACHE_S)
    admit(caller, body("realtime"))  # realtime counts realtime: 2 ahead
    full = refused(caller, body("bulk"))  # bulk counts every lane: 3 ahead
    assert (full.kind, full.code, full.param) == (Kind.UNAVAILABLE, "lane_overloaded", "lane")
    assert refused(caller, body("bulk"), model="other").code == "lane_overloaded"
    admit(caller, body("realtime"), model="other")  # another model's backlog is its own
