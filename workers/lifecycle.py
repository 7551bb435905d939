"""Start and stop the per-process machinery of an inference worker with Celery's own signals.

``worker_init`` runs before the consumer connects: the engine is built (and the demo model, if
needed) before the first message is taken, so a worker that cannot load its model never
reserves jobs. ``worker_shutdown`` runs after Celery's warm shutdown has let running tasks
finish; only then is the engine shut down, which also stops vLLM's engine processes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from typing import Any

from celery.signals import task_received, worker_init, worker_ready, worker_shutdown

from app.dispatch import RUN_JOBS_TASK
from app.settings import get_settings
from workers.control import ControlListener
from workers.engines import create_engine
from workers.executor import Executor
from workers.heartbeat import Heartbeat
from workers.intake import Intake
from workers.runner import Runner

log = logging.getLogger("inferq.worker")


class InferenceWorker:
    """Everything one inference worker process owns: runner, executor, heartbeat, listener."""

    def __init__(self) -> None:
        settings = get_settings()
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}"
        engine = create_engine(settings)
        self.runner = Runner.from_settings(engine, settings)
        self.intake = Intake.from_settings(settings)
        self.executor = Executor(
            self.runner,
            self.worker_id,
            settings,
            on_engine_dead=self._engine_dead,
            intake=self.intake,
        )
        info = {
            "worker_id": self.worker_id,
            "engine": engine.name,
            "model": engine.model_name,
            "batching": self.runner.batching,
            "lanes": settings.lanes,
            "concurrency": settings.worker_concurrency,
            "pid": os.getpid(),
        }
        self.heartbeat = Heartbeat(self.executor, settings, info)
        self.control = ControlListener(self.executor)

    def start(self) -> None:
        log.info("starting engine %s", self.runner.engine.name)
        self.runner.start()
        self.control.start()
        self.heartbeat.start()
        log.info(
            "engine %s ready (model %s, %s batching)",
            self.runner.engine.name,
            self.runner.engine.model_name,
            self.runner.batching,
        )

    def _engine_dead(self) -> None:
        # A dead engine serves nothing: stop taking jobs and exit (warm shutdown), so the
        # supervisor starts a fresh worker; held jobs were handed back to the queue.
        log.critical("the engine is dead; shutting this worker down")
        os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        self.heartbeat.stop()
        self.control.stop()
        self.runner.shutdown()


_current: InferenceWorker | None = None
_role = {"inference": False}


def enable_inference() -> None:
    """Called by ``workers.main`` before Celery starts: this process runs an engine."""
    _role["inference"] = True


def current() -> InferenceWorker:
    if _current is None:
        raise RuntimeError("this process has no engine (start it with `inferq worker`)")
    return _current


@worker_init.connect  # type: ignore[untyped-decorator]
def _on_worker_init(**_: Any) -> None:
    global _current
    if _role["inference"] and _current is None:
        _current = InferenceWorker()
        _current.start()


@worker_ready.connect  # type: ignore[untyped-decorator]
def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    # The sender is Celery's consumer: from now on the intake opens and closes lane queues.
    if _current is not None and sender is not None:
        _current.intake.bind(sender)


@task_received.connect  # type: ignore[untyped-decorator]
def _on_task_received(request: Any = None, **_: Any) -> None:
    # On the consumer's loop thread, before it polls the broker again: take the message's
    # slots now so that a lane without room is closed before another message is fetched.
    if _current is not None and request is not None and request.name == RUN_JOBS_TASK:
        job_ids, lane = request.args
        _current.intake.take(lane, len(set(job_ids)), key=request.id)


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _on_worker_shutdown(**_: Any) -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None
