"""One worker per GPU: `inferq worker --gpus 0,1,2,3` (``INFERQ_WORKER_GPUS``) runs this
supervisor, which starts one inference worker process per listed GPU and keeps it running.

Each child is a whole worker (``python -m workers.inference``) that sees only its own GPU
(``CUDA_VISIBLE_DEVICES``), so it builds its engine on "the" GPU like a worker started by hand.
Its /metrics port is its own: the system picks a free one (the default), or, with
``INFERQ_WORKER_METRICS_PORT=P``, child ``i`` binds ``P + i``; every child announces its
address (docs/observability.md), so Prometheus finds all of them.

A child that exits while the supervisor is not stopping (its engine died, it was killed) is
started again after ``RESTART_DELAY_S``: the others keep serving meanwhile, and the jobs the
dead one held come back through their leases like any lost worker's. SIGTERM or SIGINT is passed
to every child (each finishes or hands back its jobs, docs/reliability.md, "Reliability contract")
and the supervisor
exits once all of them have.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from app.core.processes import lifeline
from app.core.settings import Settings, get_settings

log = logging.getLogger("inferq.gpus")

RESTART_DELAY_S = 5.0
POLL_S = 0.5


def child_env(settings: Settings, index: int, gpu: str) -> dict[str, str]:
    """The environment of the worker of ``gpu``, the ``index``-th listed."""
    env = {**os.environ, "INFERQ_WORKER_GPUS": "", "CUDA_VISIBLE_DEVICES": gpu}
    if settings.worker_metrics_port:
        env["INFERQ_WORKER_METRICS_PORT"] = str(settings.worker_metrics_port + index)
    return env


class Supervisor:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.gpus = settings.gpus
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping = False

    def start(self, index: int, gpu: str) -> None:
        argv = [sys.executable, "-m", "workers.inference"]
        child = subprocess.Popen(
            argv,
            env=child_env(self.settings, index, gpu),
            preexec_fn=lifeline.dies_with_parent(),  # SIGTERM when this supervisor dies
        )
        self.children[gpu] = child
        log.info("worker of GPU %s started (pid %d)", gpu, child.pid)

    def stop(self, signum: int, _frame: FrameType | None = None) -> None:
        self.stopping = True
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signum)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        for index, gpu in enumerate(self.gpus):
            self.start(index, gpu)
        restart_at: dict[str, float] = {}
        while True:
            time.sleep(POLL_S)
            alive = [c for c in self.children.values() if c.poll() is None]
            if self.stopping:
                if not alive:
                    return 0
                continue
            for index, gpu in enumerate(self.gpus):
                code = self.children[gpu].poll()
                if code is None:
                    continue
                if gpu not in restart_at:
                    log.error("worker of GPU %s exited (%s); restarting it", gpu, code)
                    restart_at[gpu] = time.monotonic() + RESTART_DELAY_S
                elif time.monotonic() >= restart_at[gpu]:
                    del restart_at[gpu]
                    self.start(index, gpu)


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    sys.exit(Supervisor(get_settings()).run())


if __name__ == "__main__":
    main()
