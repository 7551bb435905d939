"""The timing invariants: a combination under which a live job could be taken for a lost one
(or run twice because Redis redelivered its message) refuses to start, saying which."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.core.settings import Settings
from tests.support import run_cli


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"heartbeat_s": 20, "lease_ttl_s": 10}, "heartbeat_s < lease_ttl_s"),
        ({"lease_ttl_s": 4000, "visibility_timeout_s": 3600}, "lease_ttl_s < visibility_timeout_s"),
        ({"visibility_timeout_s": 3600}, "INFERQ_MAX_TIMEOUT_S"),
        (
            {"visibility_timeout_s": 3600, "max_timeout_s": 600, "batch_max_window_s": 7200},
            "INFERQ_BATCH_MAX_WINDOW_S",
        ),
        (
            {
                "visibility_timeout_s": 3600,
                "max_timeout_s": 600,
                "batch_max_window_s": 600,
                "lane_default_timeout_s": {"bulk": 3600},
            },
            "INFERQ_LANE_DEFAULT_TIMEOUT_S[bulk]",
        ),
    ],
)
def test_bad_timings_are_refused(tmp_path: Path, values: dict[str, object], named: str) -> None:
    with pytest.raises(ValidationError, match=named.replace("[", r"\[").replace("]", r"\]")):
        Settings(data_dir=tmp_path, **values)  # type: ignore[arg-type]


def test_the_defaults_hold(tmp_path: Path) -> None:
    s = Settings(data_dir=tmp_path)
    assert s.heartbeat_s < s.lease_ttl_s < s.visibility_timeout_s
    assert max(s.max_timeout_s, s.batch_max_window_s) < s.visibility_timeout_s


def test_a_worker_with_bad_timings_does_not_start(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERQ_")}
    env |= {"INFERQ_DATA_DIR": str(tmp_path), "INFERQ_HEARTBEAT_S": "90"}
    done = run_cli("worker", "--engine", "simulated", env=env, timeout=60)
    assert done.returncode == 1
    assert "invalid settings" in done.stderr
    assert "heartbeat_s < lease_ttl_s < visibility_timeout_s (got 90.0 < 60.0" in done.stderr
    assert "Traceback" not in done.stderr
