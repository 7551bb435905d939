"""workers/inference/children.py with real processes: a killed worker's engine children are
found and stopped by the next worker on the host; a live worker's are left alone."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.support import wait_until
from workers.inference import children

# A stand-in worker: starts a long-lived child (as vLLM starts its engine core), records it,
# prints both pids, then waits to be killed.
WORKER = """
import subprocess, sys, time
from pathlib import Path
from workers.inference import children
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
children.record(Path(sys.argv[1]))
print(child.pid, flush=True)
time.sleep(600)
"""


def start_worker(data_dir: Path) -> tuple[subprocess.Popen[str], int]:
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, str(data_dir)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert worker.stdout is not None
    return worker, int(worker.stdout.readline())


def test_children_of_a_killed_worker_are_killed_at_the_next_start(tmp_path: Path) -> None:
    worker, child = start_worker(tmp_path)
    alive, alive_child = start_worker(tmp_path)
    try:
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        time.sleep(0.2)
        assert psutil.pid_exists(child), "the orphan outlives its killed worker"
        assert children.reap_orphans(tmp_path) == 1
        wait_until(lambda: not psutil.pid_exists(child), 10, "the orphan to be gone")
        # The live worker's child is its own business.
        assert psutil.Process(alive_child).is_running()
        assert len(list((tmp_path / "engine-pids").glob("*.json"))) == 1
        assert children.reap_orphans(tmp_path) == 0
    finally:
        alive.kill()
        alive.wait(10)
        for pid in (child, alive_child):
            if psutil.pid_exists(pid):
                psutil.Process(pid).kill()


def test_a_reused_pid_is_not_killed(tmp_path: Path) -> None:
    worker, child = start_worker(tmp_path)
    try:
        record = next((tmp_path / "engine-pids").glob("*.json"))
        # Same pid, another start time: not the process that was recorded.
        text = record.read_text().replace(str(psutil.Process(child).create_time()), "1.0")
        record.write_text(text)
        worker.send_signal(signal.SIGKILL)
        worker.wait(10)
        assert children.reap_orphans(tmp_path) == 0
        assert psutil.Process(child).is_running()
    finally:
        if psutil.pid_exists(child):
            psutil.Process(child).kill()
