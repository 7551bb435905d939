"""The timing invariant: a combination under which a live job could be taken for a lost one
refuses to start, saying which."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.core.settings import Settings
from tests.support import run_cli


def test_a_lease_shorter_than_a_heartbeat_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="heartbeat_s < lease_ttl_s"):
        Settings(data_dir=tmp_path, heartbeat_s=20, lease_ttl_s=10)


def test_the_defaults_hold(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.heartbeat_s < s.lease_ttl_s


def test_a_worker_with_bad_timings_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env |= {"INFERQ_DATA_DIR": str(tmp_path), "INFERQ_HEARTBEAT_S": "90"}
    done = run_cli("worker", "--engine", "simulated", env=env, timeout=60)
    assert done.returncode == 1
    assert "invalid settings" in done.stderr
    assert "heartbeat_s < lease_ttl_s (got 90.0 < 60.0" in done.stderr
    assert "Traceback" not in done.stderr
