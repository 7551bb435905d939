"""Every name that processes share: Celery task names, queues, and the Redis keys and channels.

Producers and consumers read their names from here, so the API, the dispatcher, the workers
and `inferq status` cannot disagree about them (arq keeps its keys in one ``constants.py`` for
the same reason). A job's queue is its lane *of its model* (:func:`queue_of`:
``<lane>:<model>``): a worker holds one model and consumes only that model's three lanes, in
strict lane order, so a backlog of one model never stands in front of another model's jobs
(docs/architecture.md, "Many models"). With prefix affinity each worker also consumes a queue
of its own in each affine lane (:func:`own_queue`, ``<lane>:<model>@<worker id>``), before the
lane's shared queue.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

from app.core.settings import LANES, get_settings

if TYPE_CHECKING:
    import redis

# --- Celery tasks (messages carry ids, never payloads: the row is the truth) -------------------
RUN_JOBS_TASK = "inferq.run_jobs"  # inference workers: run one message's jobs
DELIVER_WEBHOOK_TASK = "inferq.deliver_webhook"  # the ops worker's tasks from here on
SWEEP_WEBHOOKS_TASK = "inferq.sweep_webhooks"
START_BATCH_TASK = "inferq.start_batch"
FINALIZE_BATCH_TASK = "inferq.finalize_batch"
SWEEP_BATCHES_TASK = "inferq.sweep_batches"
EXPIRE_FILES_TASK = "inferq.expire_files"
REAP_TASK = "inferq.reap"
SWEEP_HISTORY_TASK = "inferq.sweep_history"
TASKS = (
    RUN_JOBS_TASK,
    DELIVER_WEBHOOK_TASK,
    SWEEP_WEBHOOKS_TASK,
    START_BATCH_TASK,
    FINALIZE_BATCH_TASK,
    SWEEP_BATCHES_TASK,
    EXPIRE_FILES_TASK,
    REAP_TASK,
    SWEEP_HISTORY_TASK,
)

# --- queues ------------------------------------------------------------------------------------
# The ops worker's (`inferq ops`): deliveries, and the periodic sweeps beat sends. The job
# queues are named by queue_of.
WEBHOOK_QUEUE = "webhooks"
MAINTENANCE_QUEUE = "maintenance"
OPS_QUEUES: tuple[str, ...] = (WEBHOOK_QUEUE, MAINTENANCE_QUEUE)

# --- Redis keys and channels -------------------------------------------------------------------
# Cancels of running jobs, broadcast to every inference worker (workers/inference/control.py).
CONTROL_CHANNEL = "inferq:control"
# A waiting API call's channel is this prefix + its process (app/core/messaging/relay.py).
REPLY_CHANNEL_PREFIX = "inferq:reply:"
# A background streamed response's kept relay messages, a Redis stream per response, that any
# API process reads (app/core/messaging/relay.py, "kept logs").
RESPONSE_EVENTS_PREFIX = "inferq:response-events:"
# The ops worker's gauge of the backlog's drain estimate (workers/ops/autoscale.py), which the
# console reads from its /metrics (app/core/observe/snapshot.py).
DRAIN_METRIC = "inferq_backlog_drain_seconds"
# A console sign-in, by the SHA-256 of its cookie (app/api/console/sessions.py).
CONSOLE_SESSION_PREFIX = "inferq:console:session:"
# Presence records (app/core/processes/presence.py), one prefix per role: readers of inference
# workers (`inferq up`, `inferq status`, the dispatcher) never see an ops worker as one of them.
WORKERS_KEY_PREFIX = "inferq:worker:"
OPS_KEY_PREFIX = "inferq:ops:"
DISPATCHER_KEY_PREFIX = "inferq:dispatcher:"
Role = Literal["inference", "ops", "dispatcher"]
PRESENCE_KEY_PREFIXES: dict[Role, str] = {
    "inference": WORKERS_KEY_PREFIX,
    "ops": OPS_KEY_PREFIX,
    "dispatcher": DISPATCHER_KEY_PREFIX,
}
# The dispatcher's wake-up list: queues with jobs to send (app/dispatcher), at most WAKE_MAX.
WAKE_KEY = "inferq:dispatch:wake"
WAKE_MAX = 1000
# Each tenant's virtual token counter in one queue: a hash per queue
# (app/core/scheduling/fairshare.py).
FAIR_COUNTERS_PREFIX = "inferq:fair:"
# Rate-limit windows: prefix + tenant:limit:window (app/core/scheduling/limits.py).
LIMIT_KEY_PREFIX = "inferq:limit:"
# A model's card and the tokenizers cards name (app/core/scheduling/tokens.py).
CARD_KEY_PREFIX = "inferq:model:"
TOKENIZER_KEY_PREFIX = "inferq:tokenizer:"
# A model's measured worker rate (cost per second, app/core/scheduling/backlog.py): a hint that lets
# a restarted ops worker size a fleet before it has measured again.
AUTOSCALE_RATE_PREFIX = "inferq:autoscale:rate:"
# Set while Flower runs (app/core/messaging/broker.py, ``mark_watched``): senders add task-sent
# events.
FLOWER_WATCHING_KEY = "inferq:flower:watching"
# The reaper's marker: gone means Redis lost its data (workers/ops/reaper.py).
EPOCH_KEY = "inferq:epoch"

# Every worker's own queue a dispatcher has sent to (a Redis set): a queue whose worker is gone
# is emptied back into the fair order (app/dispatcher/loop.py), and counted with its lane's
# queue by the reaper and `inferq status` (app/core/observe/snapshot.py).
OWN_QUEUES_KEY = "inferq:queues:own"
# Jobs sent to each worker's own queue by prefix affinity, and those whose prefix's worker was
# past the load bound and went to the shared queue: hashes, worker id -> jobs (the dispatcher's
# count, shown by /metrics, `inferq status` and the console).
AFFINITY_SENT_KEY = "inferq:affinity:sent"
AFFINITY_OVERFLOW_KEY = "inferq:affinity:overflow"
OWN_SEP = "@"  # <lane>:<model>@<worker id>: a worker's own queue of a lane (:func:`own_queue`)

Route = tuple[str, str]  # (lane, model): one Celery queue (:func:`queue_of`)


def queue_of(lane: str, model: str) -> str:
    """The Celery queue (and Redis list) of ``model``'s jobs in ``lane``: a LoRA adapter's jobs
    are in its base model's queues, whose workers run them (docs/scheduling.md, "Many models")."""
    return f"{lane}:{get_settings().base_of(model)}"


def own_queue(lane: str, model: str, worker_id: str) -> str:
    """The queue of ``model``'s ``lane`` that only the worker ``worker_id`` consumes, before the
    lane's shared queue (docs/scheduling.md, "Prefix affinity")."""
    return f"{queue_of(lane, model)}{OWN_SEP}{worker_id}"


def own_queues(client: redis.Redis) -> set[str]:
    """Every worker's own queue that messages were sent to and that was not yet forgotten
    (the send notes it, app/core/messaging/broker.py; the dispatcher forgets a gone worker's).
    Here, not in the broker, so that `inferq status` reads them without importing Celery."""
    members: set[bytes] = client.smembers(OWN_QUEUES_KEY)  # type: ignore[assignment]
    return {m.decode() if isinstance(m, bytes) else str(m) for m in members}


def shared_of(queue: str) -> str:
    """The shared queue of a lane that ``queue`` belongs to (itself if it is one)."""
    return queue.split(OWN_SEP, 1)[0]


def owner_of(queue: str) -> str | None:
    """The worker whose own queue ``queue`` is; None for a shared queue."""
    _, sep, worker = queue.partition(OWN_SEP)
    return worker if sep else None


def lane_queues(lane: str, model: str, worker_id: str, affine: Iterable[str]) -> list[str]:
    """The queues of ``model``'s ``lane`` a worker consumes, in the order it tries them: its
    own first (when the lane is ``affine``), then the shared one it helps with."""
    shared = queue_of(lane, model)
    return [own_queue(lane, model, worker_id), shared] if lane in affine else [shared]


def lane_of(queue: str) -> str:
    """The lane of a queue :func:`queue_of` named (an ops queue is its own name)."""
    return queue.split(":", 1)[0]


def routes(models: Iterable[str], found: Iterable[Route] = ()) -> list[Route]:
    """Every lane of ``models``, and the ``found`` routes of other models, in display order:
    model by model (``models`` first), each model's lanes in priority order."""
    order = list(dict.fromkeys([*models, *sorted({model for _, model in found})]))
    return [(lane, model) for model in order for lane in LANES]
