"""`inferq up`'s logs are bounded: a child's output goes through copy_log into its file,
rotated past INFERQ_LOG_MAX_BYTES with INFERQ_LOG_BACKUPS old files kept (issue 56: one
50,000-line batch wrote about 12 MB to each of two logs, with no bound)."""

from __future__ import annotations

import sys
from pathlib import Path

from app.cli.stack import Child


def test_a_childs_log_rotates_and_keeps_its_backups(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "chatty.log"
    lines = 5000
    argv = [sys.executable, "-c", f"for i in range({lines}): print(f'line {{i:05d}} ' + 'x' * 90)"]
    child = Child("chatty", argv, log, log_max_bytes=50_000, log_backups=3)
    child.start()
    assert child.proc is not None
    child.proc.wait(30)
    child.stop(5)
    kept = sorted(p.name for p in log.parent.iterdir())
    assert kept == ["chatty.log", "chatty.log.1", "chatty.log.2", "chatty.log.3"]
    assert all(p.stat().st_size <= 50_000 for p in log.parent.iterdir())
    # The newest lines are in the current file, the last line last; older ones rotated away.
    current = log.read_text().splitlines()
    assert current[-1].startswith(f"line {lines - 1:05d} ")
    older = (log.parent / "chatty.log.1").read_text().splitlines()
    assert int(older[-1].split()[1]) + 1 == int(current[0].split()[1])


def test_without_a_bound_nothing_rotates(tmp_path: Path) -> None:
    log = tmp_path / "one.log"
    child = Child("one", [sys.executable, "-c", "print('a' * 100_000)"], log)
    child.start()
    assert child.proc is not None
    child.proc.wait(30)
    child.stop(5)
    assert [p.name for p in tmp_path.iterdir()] == ["one.log"]
    assert log.stat().st_size == 100_001
