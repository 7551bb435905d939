"""The inference worker's composition root: every part of the process is built here, from one
settings object, and passed in (vLLM's ``init_app_state``, Celery's bootsteps).

::

    settings ─► engine ─► runner ───────────────┐
                intake ─────────────────────────┤
                Redis client ─► relay publisher ┤
                webhook announcer ─► recorder ──┴─► executor ─► heartbeat, control listener
                                                       │
    Celery app (workers/celery_app.py) ◄── run_jobs ───┘ (workers/inference/tasks.py)

Nothing is started while the parts are built: the worker starts them on Celery's
``worker_init`` (workers/inference/worker.py). The worker consumes its model's queues only
(``names.queue_of``), its lanes in strict priority order whatever order they were given in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from app.core.messaging import clients, relay
from app.core.settings import Settings, get_settings
from app.core.webhooks import outbox
from workers import celery_app, metrics
from workers.engines import create_engine
from workers.inference import tasks
from workers.inference.control import ControlListener
from workers.inference.executor import Executor
from workers.inference.heartbeat import Heartbeat
from workers.inference.intake import Intake
from workers.inference.recorder import Recorder
from workers.inference.runner import Runner
from workers.inference.worker import InferenceWorker, stop_this_worker
from workers.presence import process_id

log = logging.getLogger("inferq.worker")

# Threads beyond the slots: the intake keeps jobs within worker_concurrency slots, and the
# spare threads absorb the message or two fetched while a lane closes.
SPARE_THREADS = 8


def build_executor(
    runner: Runner,
    worker_id: str,
    settings: Settings,
    *,
    intake: Intake | None = None,
    on_engine_dead: Callable[[], None] = lambda: None,
) -> Executor:
    """An executor on ``runner`` with its recorder, the recorder's relay publisher and webhook
    announcer, and an intake (``intake``, else one from ``settings``); not started."""
    publisher = relay.Publisher(
        clients.redis_client(), settings.relay_merge_ms, settings.response_events_keep_s
    )
    recorder = Recorder(worker_id, publisher, outbox.Announcer())
    return Executor(
        runner,
        recorder,
        intake or Intake.from_settings(settings, worker_id),
        settings,
        on_engine_dead=on_engine_dead,
    )


def build(settings: Settings) -> InferenceWorker:
    """Every part of an inference worker process, built and wired, none started."""
    engine = create_engine(settings)
    runner = Runner.from_settings(engine, settings)
    executor = build_executor(runner, process_id(), settings, on_engine_dead=stop_this_worker)
    # Each engine step: the metrics, and the intake's look at what waits in the engine
    # (workers/inference/intake.py), on the engine's own thread.
    intake = executor.intake

    def load() -> tuple[int, int]:
        stats = engine.stats()
        return stats.running, stats.waiting

    def on_step(decoding: int, emitted: int) -> None:
        metrics.observe_step(decoding, emitted)
        intake.on_step(decoding, emitted)

    engine.on_step = on_step
    info = {
        "engine": engine.name,
        "model": engine.model_name,
        "batching": runner.batching,
        "lanes": settings.lanes,
        "concurrency": settings.worker_concurrency,
        # The lanes whose own queue it consumes before the shared one: the dispatcher sends
        # those lanes' jobs to it by prefix affinity (docs/scheduling.md, "Prefix affinity").
        "own_lanes": intake.own_lanes,
        # The GPUs this worker sees (`inferq worker --gpus` pins one per worker).
        "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    heartbeat = Heartbeat(executor, settings, info)
    # A new capacity reaches the dispatcher at once: the heartbeat announces it.
    intake.watch(load, heartbeat.poke)
    client = clients.redis_client()
    return InferenceWorker(
        settings,
        executor,
        heartbeat,
        ControlListener(executor, client),
        client,
    )


def main() -> None:
    celery_app.log_to_stderr(task_lines=False)
    settings = get_settings()
    try:
        worker = build(settings)  # the engine's model found, or the demo model made
    except Exception:
        log.critical("the worker cannot start; exiting", exc_info=True)
        raise SystemExit(1) from None
    worker.connect()
    app = celery_app.create("worker", settings)
    tasks.register(app, worker.executor)
    celery_app.run_worker(
        app,
        "worker",
        worker.executor.intake.all_queues(),
        settings.worker_concurrency + SPARE_THREADS,
    )
