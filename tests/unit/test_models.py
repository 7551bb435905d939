"""Status machine and identifiers."""

from __future__ import annotations

import time

import pytest

from app.core.lifecycle.transitions import compare_and_set
from app.core.models import TERMINAL, TRANSITIONS, JobStatus, can_transition, live, new_id


def test_terminal_states_have_no_way_out() -> None:
    for status in TERMINAL:
        for target in JobStatus:
            assert not can_transition(status, target)


def test_running_can_finish_every_way_or_be_handed_back() -> None:
    assert TRANSITIONS[JobStatus.RUNNING] == {
        JobStatus.SUCCEEDED,
        JobStatus.FAILED,
        JobStatus.CANCELLED,
        JobStatus.EXPIRED,
        JobStatus.QUEUED,
    }
    assert can_transition(JobStatus.QUEUED, JobStatus.RUNNING)
    assert not can_transition(JobStatus.QUEUED, JobStatus.SUCCEEDED)


def test_ids_sort_by_creation_time() -> None:
    first = new_id("job")
    time.sleep(0.002)
    second = new_id("job")
    assert first.startswith("job_") and len(first) == 30
    assert first < second
    assert len({new_id("job") for _ in range(1000)}) == 1000


def test_compare_and_set_refuses_transitions_the_machine_does_not_allow() -> None:
    with pytest.raises(ValueError, match="cannot go from succeeded to running"):
        compare_and_set("job_x", expect=JobStatus.SUCCEEDED, to=JobStatus.RUNNING)
    statement = compare_and_set("job_x", expect=JobStatus.RUNNING, to=JobStatus.QUEUED, token=3)
    sql = str(statement.compile(compile_kwargs={"literal_binds": True}))
    # The status test is not one ix_jobs_status_lane answers (models.status_is).
    assert "(jobs.status || '') = 'running'" in sql and "jobs.lease_token = 3" in sql


def test_a_live_status_test_names_only_live_statuses() -> None:
    """``models.live`` writes ``status IN ('queued', 'running')`` into the statement; a
    finished status there would find nothing, so it is refused where it is written."""
    assert "status IN ('queued', 'running')" in str(live(JobStatus.QUEUED))
    for wrong in ((JobStatus.SUCCEEDED,), (JobStatus.QUEUED, JobStatus.FAILED), ()):
        with pytest.raises(ValueError, match="not live statuses"):
            live(*wrong)
