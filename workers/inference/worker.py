"""Start and stop the per-process machinery of an inference worker with Celery's own signals.

``worker_init`` runs before the consumer connects: the engine is built (and the demo model, if
needed) before the first message is taken, so a worker that cannot load its model never
reserves jobs. On SIGTERM Celery stops taking messages (warm shutdown) and ``worker_shutting_down``
gives the running jobs ``INFERQ_SHUTDOWN_GRACE_S`` to finish before the rest are handed back to
the queue; ``worker_shutdown`` then runs after every task has returned, and only then is the
engine shut down, which also stops vLLM's engine processes (workers/children.py covers a worker
that was killed instead).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import redis
from celery.signals import (
    task_received,
    worker_init,
    worker_ready,
    worker_shutdown,
    worker_shutting_down,
)
from prometheus_client import REGISTRY

from app.core import dispatch, tokens
from app.core.dispatch import RUN_JOBS_TASK
from app.core.settings import get_settings
from workers import children, metrics
from workers.control import ControlListener
from workers.engines import create_engine
from workers.executor import Executor
from workers.heartbeat import Heartbeat
from workers.intake import Intake
from workers.presence import process_id
from workers.runner import Runner

log = logging.getLogger("inferq.worker")


class InferenceWorker:
    """Everything one inference worker process owns: runner, executor, heartbeat, listener."""

    def __init__(self) -> None:
        settings = get_settings()
        self.worker_id = process_id()
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
            "engine": engine.name,
            "model": engine.model_name,
            "batching": self.runner.batching,
            "lanes": settings.lanes,
            "concurrency": settings.worker_concurrency,
            # The GPUs this worker sees (`inferq worker --gpus` pins one per worker).
            "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }
        self.heartbeat = Heartbeat(self.executor, settings, info)
        self.control = ControlListener(self.executor)
        engine.on_step = metrics.observe_step
        REGISTRY.register(
            metrics.WorkerCollector(
                self.runner.stats,
                self.runner.in_flight,
                {"worker": self.worker_id, "engine": engine.name, "model": engine.model_name},
            )
        )

    def start(self) -> None:
        settings = get_settings()
        data_dir = settings.data_dir
        # Before the engine: a port already taken stops the worker at once, saying so.
        self.heartbeat.info["metrics_url"] = metrics.serve(
            settings.metrics_host, settings.worker_metrics_port, settings.metrics_advertise_host
        )
        killed = children.reap_orphans(data_dir)
        if killed:
            log.warning("killed %d engine process(es) left behind by dead workers", killed)
        log.info("starting engine %s", self.runner.engine.name)
        self.runner.start()
        if self.runner.engine.own_processes:
            log.info("recorded %d engine process(es)", children.record(data_dir))
        self._publish_card()
        self.control.start()
        self.heartbeat.start()
        log.info(
            "engine %s ready (model %s, %s batching)",
            self.runner.engine.name,
            self.runner.engine.model_name,
            self.runner.batching,
        )

    def _publish_card(self) -> None:
        # The API counts prompt tokens with what this publishes (app/core/tokens.py); without it
        # the engine alone refuses prompts longer than the context.
        engine = self.runner.engine
        try:
            card = tokens.publish(
                dispatch.redis_client(),
                engine.model_name,
                engine.max_model_len,
                engine.tokenizer_json(),
                engine.tool_parser,
            )
        except redis.RedisError as exc:
            log.warning("could not publish the model card (%s); the API will not count tokens", exc)
            return
        log.info("model card: context %d tokens, tokenizer %s", card.max_model_len, card.tokenizer)

    def _engine_dead(self) -> None:
        # A dead engine serves nothing: stop taking jobs and exit (warm shutdown), so the
        # supervisor starts a fresh worker; held jobs were handed back to the queue.
        log.critical("the engine is dead; shutting this worker down")
        os.kill(os.getpid(), signal.SIGTERM)

    def drain(self) -> None:
        """SIGTERM: Celery takes no more messages and waits for the running tasks; give them
        ``shutdown_grace_s`` to finish, then hand what is left back to the queue."""
        grace = get_settings().shutdown_grace_s

        def hand_back() -> None:
            held = self.executor.held()
            if held:
                log.warning("shutdown grace over: handing %d job(s) back", len(held))
            for job_id in held:
                self.executor.request_abort(job_id, "shutdown")

        log.info("shutting down: finishing held jobs (grace %.0f s)", grace)
        timer = threading.Timer(grace, hand_back)
        timer.daemon = True
        timer.start()

    def stop(self) -> None:
        self.heartbeat.stop()
        self.control.stop()
        self.runner.shutdown()
        children.forget(get_settings().data_dir)


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
    if not _role["inference"] or _current is not None:
        return
    try:
        _current = InferenceWorker()
        _current.start()
    except Exception:
        # Celery logs an exception from a signal handler and starts consuming anyway: a worker
        # without its engine (or its metrics port) would take messages it cannot run.
        log.critical("the worker cannot start; exiting", exc_info=True)
        if _current is not None:
            with contextlib.suppress(Exception):
                _current.stop()
        raise SystemExit(1) from None


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


@worker_shutting_down.connect  # type: ignore[untyped-decorator]
def _on_worker_shutting_down(**_: Any) -> None:
    if _current is not None:
        _current.drain()


@worker_shutdown.connect  # type: ignore[untyped-decorator]
def _on_worker_shutdown(**_: Any) -> None:
    global _current
    if _current is not None:
        _current.stop()
        _current = None
