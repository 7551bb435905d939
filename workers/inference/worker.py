"""One inference worker process's parts, started and stopped with Celery's own signals.

The parts are built by the composition root (workers/inference/main.py: the engine's model
found, or the demo model made, before Celery starts) and handed to an
:class:`InferenceWorker`, which :meth:`~InferenceWorker.connect` s its methods to this
process's Celery signals. ``worker_init`` runs before the consumer connects: the engine is
started before the first message is taken, so a worker that cannot load its model never
reserves jobs. On SIGTERM Celery stops taking messages (warm
shutdown) and ``worker_shutting_down`` gives the running jobs ``INFERQ_SHUTDOWN_GRACE_S`` to
finish before the rest are handed back to the queue; ``worker_shutdown`` then runs after every
task has returned, and only then is the engine shut down, which also stops vLLM's engine
processes (workers/inference/children.py covers a worker that was killed instead).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from typing import Any

import redis
from celery import signals
from prometheus_client import REGISTRY

from app.core.messaging import broker, clients
from app.core.messaging.names import RUN_JOBS_TASK
from app.core.scheduling import tokens
from app.core.settings import Settings
from workers import metrics
from workers.inference import children
from workers.inference.control import ControlListener
from workers.inference.executor import Executor
from workers.inference.heartbeat import Heartbeat

log = logging.getLogger("inferq.worker")


def stop_this_worker() -> None:
    """A dead engine serves nothing: stop taking jobs and exit (warm shutdown), so the
    supervisor starts a fresh worker; the executor handed its jobs back already."""
    log.critical("the engine is dead; shutting this worker down")
    os.kill(os.getpid(), signal.SIGTERM)


class InferenceWorker:
    """Everything one inference worker process owns: its executor (and the executor's runner
    and intake), heartbeat, control listener, and the Redis client they share."""

    def __init__(
        self,
        settings: Settings,
        executor: Executor,
        heartbeat: Heartbeat,
        control: ControlListener,
        client: redis.Redis,
    ) -> None:
        self.settings = settings
        self.executor = executor
        self.runner = executor.runner
        self.intake = executor.intake
        self.heartbeat = heartbeat
        self.control = control
        self.client = client
        self.worker_id = executor.worker_id

    def connect(self) -> None:
        """Start and stop with this process's Celery worker (its signals)."""
        for signal_, handler in (
            (signals.worker_init, self._on_init),
            (signals.worker_ready, self._on_ready),
            (signals.task_received, self._on_task_received),
            (signals.worker_shutting_down, self._on_shutting_down),
            (signals.worker_shutdown, self._on_shutdown),
        ):
            # One handler each, however often this is called: the uid names the process's.
            signal_.connect(handler, weak=False, dispatch_uid=f"inferq.inference.{signal_.name}")

    def start(self) -> None:
        settings = self.settings
        engine = self.runner.engine
        # Before the engine: a port already taken stops the worker at once, saying so.
        self.heartbeat.info["metrics_url"] = metrics.serve(
            settings.metrics_host,
            settings.worker_metrics_port,
            settings.metrics_advertise_host,
            health=self.heartbeat.health,
        )
        REGISTRY.register(
            metrics.WorkerCollector(
                self.runner.stats,
                self.runner.in_flight,
                {"worker": self.worker_id, "engine": engine.name, "model": engine.model_name},
            )
        )
        clients.warn_if_not_durable()
        killed = children.reap_orphans(settings.data_dir)
        if killed:
            log.warning("killed %d engine process(es) left behind by dead workers", killed)
        log.info("starting engine %s", engine.name)
        self.runner.start()
        # What the model does is known once the engine is up (vLLM resolves ``auto``).
        self.heartbeat.info["task"] = engine.task
        if engine.own_processes:
            log.info("recorded %d engine process(es)", children.record(settings.data_dir))
        self._publish_card()
        self.executor.start()
        self.control.start()
        self.heartbeat.start()
        log.info(
            "engine %s ready (model %s, %s batching)",
            engine.name,
            engine.model_name,
            self.runner.batching,
        )

    def _publish_card(self) -> None:
        # The API counts prompt tokens with what this publishes (app/core/scheduling/tokens.py);
        # without it the engine alone refuses prompts longer than the context.
        engine = self.runner.engine
        try:
            card = tokens.publish(
                self.client,
                engine.model_name,
                engine.max_model_len,
                engine.tokenizer_json(),
                engine.tool_parser,
                engine.task,
                engine.embed_dim,
                engine.matryoshka,
                engine.chat_template(),
            )
        except redis.RedisError as exc:
            log.warning("could not publish the model card (%s); the API will not count tokens", exc)
            return
        log.info("model card: context %d tokens, tokenizer %s", card.max_model_len, card.tokenizer)

    def drain(self) -> None:
        """SIGTERM: Celery takes no more messages and waits for the running tasks; give them
        ``shutdown_grace_s`` to finish, then hand what is left back to the queue."""
        grace = self.settings.shutdown_grace_s

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
        children.forget(self.settings.data_dir)

    # --- Celery's signals -----------------------------------------------------------------------

    def _on_init(self, **_: Any) -> None:
        try:
            self.start()
        except Exception:
            # Celery logs an exception from a signal handler and starts consuming anyway: a
            # worker without its engine (or its metrics port) would take messages it cannot run.
            log.critical("the worker cannot start; exiting", exc_info=True)
            with contextlib.suppress(Exception):
                self.stop()
            raise SystemExit(1) from None

    def _on_ready(self, sender: Any = None, **_: Any) -> None:
        # The sender is Celery's consumer: from now on the intake opens and closes lane queues.
        if sender is not None:
            self.intake.bind(sender)

    def _on_task_received(self, request: Any = None, **_: Any) -> None:
        # On the consumer's loop thread, before it polls the broker again: take the message's
        # slots now so that a lane without room is closed before another message is fetched.
        if request is not None and request.name == RUN_JOBS_TASK:
            message = broker.RunJobs.of_args(request.args)
            self.intake.take(message.lane, len(set(message.job_ids)), key=request.id)

    def _on_shutting_down(self, **_: Any) -> None:
        self.drain()

    def _on_shutdown(self, **_: Any) -> None:
        self.stop()
