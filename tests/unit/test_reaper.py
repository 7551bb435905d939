"""The reaper's marker in Redis (workers/ops/reaper.py, "Lost with Redis"): a first meeting with a
Redis is not a loss; a marker gone under jobs marked sent is, and they are sent again."""

from __future__ import annotations

import logging

import pytest

from app.core.messaging import clients
from app.core.messaging.names import EPOCH_KEY
from app.core.settings import Settings
from tests.unit.test_transitions import add, row
from workers.ops import reaper


def test_a_first_meeting_with_redis_is_no_loss(
    core: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    waiting = add(core)  # queued, not sent: nothing of it was in Redis
    caplog.set_level(logging.INFO, logger="inferq.reaper")
    assert reaper.sweep(core) == {}
    assert clients.redis_client().exists(EPOCH_KEY)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "marker set" in caplog.text
    assert row(waiting[0]).enqueued_at is None


def test_a_marker_gone_under_sent_jobs_is_a_loss(
    core: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    reaper.sweep(core)  # the marker, as a running stack has it
    sent = add(core, 2, direct=True)  # stamped sent: their messages were in Redis
    assert row(sent[0]).enqueued_at is not None
    clients.redis_client().flushdb()
    caplog.set_level(logging.INFO, logger="inferq.reaper")
    assert reaper.sweep(core) == {"resent": 2}
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        "Redis lost its data (restart or wipe): 2 queued job(s) whose messages it held are sent "
        "again"
    ]
    assert all(row(job_id).enqueued_at is None for job_id in sent)
    # The marker is back: the next sweep finds nothing lost.
    caplog.clear()
    assert reaper.sweep(core) == {}
    assert not [r for r in caplog.records if r.name == "inferq.reaper"]
