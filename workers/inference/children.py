"""Engine child processes: recorded once the engine is up, killed when their worker is gone.

vLLM runs its engine core in processes of its own. A worker that stops normally shuts them down
(``Runner.shutdown``); one killed with SIGKILL cannot, and its children would keep the
accelerator's memory. So each worker records its children (pid and start time, which tells a
reused pid apart) in ``data_dir/engine-pids/<host>-<pid>.json``, and every worker that starts
first kills the recorded children of workers on this host that are no longer running.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from pathlib import Path

import psutil

log = logging.getLogger("inferq.children")


def _folder(data_dir: Path) -> Path:
    return data_dir / "engine-pids"


def _record_path(data_dir: Path, pid: int) -> Path:
    return _folder(data_dir) / f"{socket.gethostname()}-{pid}.json"


def _identity(process: psutil.Process) -> list[float]:
    return [process.pid, process.create_time()]


def record(data_dir: Path) -> int:
    """Write down this process's children (after the engine started); returns how many."""
    me = psutil.Process()
    children = [_identity(child) for child in me.children(recursive=True)]
    path = _record_path(data_dir, me.pid)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"worker": _identity(me), "children": children}))
    tmp.replace(path)
    return len(children)


def forget(data_dir: Path) -> None:
    """This worker shut its engine down: nothing of it is left to clean up."""
    with contextlib.suppress(FileNotFoundError):
        _record_path(data_dir, os.getpid()).unlink()


def _alive(identity: list[float]) -> psutil.Process | None:
    pid, started = int(identity[0]), float(identity[1])
    try:
        process = psutil.Process(pid)
        same = abs(process.create_time() - started) < 0.01
    except psutil.Error:
        return None
    return process if same else None


def reap_orphans(data_dir: Path) -> int:
    """Kill the recorded children of this host's dead workers; returns how many were killed."""
    folder = _folder(data_dir)
    if not folder.is_dir():
        return 0
    killed = 0
    for path in folder.glob(f"{socket.gethostname()}-*.json"):
        try:
            record_ = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if _alive(record_["worker"]) is not None:
            continue  # its worker still runs and owns them
        orphans = [p for p in map(_alive, record_["children"]) if p is not None]
        for process in orphans:
            log.warning("killing engine process %d left by a dead worker", process.pid)
            with contextlib.suppress(psutil.Error):
                process.kill()
        psutil.wait_procs(orphans, timeout=10)
        killed += len(orphans)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return killed
