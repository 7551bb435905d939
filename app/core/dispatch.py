"""The only place the API touches Celery and Redis: enqueue by task name, signal workers.

Messages carry job ids, never payloads: the row is the truth. A realtime or standard message
carries one job; bulk messages carry up to ``bulk_chunk_size`` jobs, so a backlog of a million
bulk jobs is ~30k messages and a worker claims a chunk in one transaction. Queue names and
broker options are defined here once and reused by ``workers/celery_app.py`` so that producer
and consumers cannot disagree about them.

A job's queue is its lane *of its model* (:func:`queue_of`: ``<lane>:<model>``): a worker
holds one model and consumes only that model's three lanes, still in strict lane order, so
a backlog of one model never stands in front of another model's jobs (docs/architecture.md,
"Many models").
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import redis
from celery import Celery
from kombu import Exchange, Queue, serialization
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.utils.scheduling import priority_cycle
from sqlalchemy import update

from app.core.models import Job, JobStatus
from app.core.settings import LANES, Settings, get_settings

log = logging.getLogger("inferq.dispatch")

RUN_JOBS_TASK = "inferq.run_jobs"
DELIVER_WEBHOOK_TASK = "inferq.deliver_webhook"
SWEEP_WEBHOOKS_TASK = "inferq.sweep_webhooks"
START_BATCH_TASK = "inferq.start_batch"
SWEEP_BATCHES_TASK = "inferq.sweep_batches"
REAP_TASK = "inferq.reap"
# Queues of the ops worker (`inferq ops`): deliveries, and the periodic sweeps beat sends.
WEBHOOK_QUEUE = "webhooks"
MAINTENANCE_QUEUE = "maintenance"
OPS_QUEUES: tuple[str, ...] = (WEBHOOK_QUEUE, MAINTENANCE_QUEUE)
CONTROL_CHANNEL = "inferq:control"
# Presence records (workers/presence.py), one prefix per role: readers of inference workers
# (`inferq up`, `inferq status`, the benchmarks) never see an ops worker as one of them.
WORKERS_KEY_PREFIX = "inferq:worker:"
OPS_KEY_PREFIX = "inferq:ops:"
DISPATCHER_KEY_PREFIX = "inferq:dispatcher:"
Role = Literal["inference", "ops", "dispatcher"]
PRESENCE_KEY_PREFIXES: dict[Role, str] = {
    "inference": WORKERS_KEY_PREFIX,
    "ops": OPS_KEY_PREFIX,
    "dispatcher": DISPATCHER_KEY_PREFIX,
}
BROKER_POLL_S = 0.05
# The dispatcher's wake-up list: queues with jobs to send (app/dispatcher), at most WAKE_MAX.
WAKE_KEY = "inferq:dispatch:wake"
WAKE_MAX = 1000

_lock = threading.Lock()
_producer: Celery | None = None
_redis: redis.Redis | None = None


def queue_of(lane: str, model: str) -> str:
    """The Celery queue (and Redis list) of ``model``'s jobs in ``lane``: a LoRA adapter's jobs
    are in its base model's queues, whose workers run them (README, "Many models")."""
    return f"{lane}:{get_settings().base_of(model)}"


def lane_of(queue: str) -> str:
    """The lane of a queue :func:`queue_of` named (an ops queue is its own name)."""
    return queue.split(":", 1)[0]


def task_queues(names: Iterable[str] = OPS_QUEUES) -> list[Queue]:
    """Queues in strict priority order: a worker polls them in exactly this order."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in names]


class LaneOrder(priority_cycle):  # type: ignore[misc]
    """kombu queue cycle that always polls lanes in priority order.

    Workers cancel and re-add lane consumers at run time (``workers/intake.py``); kombu's own
    "priority" cycle keeps the order in which queues were added, so a re-added realtime queue
    would end up behind bulk. Sorting by lane restores the order on every change.
    """

    def update(self, it: Iterable[str]) -> None:
        rank = {lane: i for i, lane in enumerate(LANES)}
        self.items[:] = sorted(it, key=lambda q: rank.get(lane_of(q), len(rank)))


class _RedisChannel(kombu_redis.Channel):  # type: ignore[misc]
    """kombu's Redis channel, with one client for the commands it sends outside a pipeline.

    kombu builds a new ``redis.Redis`` for every publish, acknowledgement and event (its
    ``conn_or_acquire``), and redis-py's client fills a table of about 170 response callbacks
    each time it is built: two of them were half the CPU of sending a message (profile in
    docs/benchmarks.md, "overhead"). The client is thread-safe; its connections still come
    from the channel's pool.
    """

    _shared_client: Any = None

    @contextlib.contextmanager
    def conn_or_acquire(self, client: Any = None) -> Iterator[Any]:
        if client:
            yield client
            return
        if self._shared_client is None:
            self._shared_client = self._create_client()
        yield self._shared_client


class RedisTransport(kombu_redis.Transport):  # type: ignore[misc]
    """kombu's Redis transport with :class:`_RedisChannel`."""

    Channel = _RedisChannel


# kombu picks a transport by the broker URL's scheme from this registry: in every process that
# imports this module (API, workers, ops worker, Flower), redis:// URLs get the transport
# above, and URLs stay as they are (Flower reads its broker's kind from the scheme).
TRANSPORT_ALIASES["redis"] = f"{__name__}:RedisTransport"


def broker_transport_options(settings: Settings) -> dict[str, Any]:
    return {
        # BRPOP the queues in strict lane order instead of kombu's default round robin.
        "queue_order_strategy": f"{__name__}:LaneOrder",
        "priority_steps": [0],
        # No redelivery bookkeeping in Redis (an unacked hash and index written for every
        # message received and cleared at its ack: 8 % of a worker's CPU per realtime call,
        # docs/benchmarks.md, "overhead"). The job row is what gets a job run again: a
        # dead worker's claimed jobs come back when their lease expires, a fetched message
        # that was never claimed is re-sent by the reaper once its lane's list is empty, and a
        # worker that stops hands its jobs back (README, "Reliability"). The bookkeeping's own
        # redelivery came after a visibility timeout of two days, later than the reaper.
        "ack_emulation": False,
        # A broker poll (BRPOP) that is already waiting does not see a lane the intake has
        # just re-opened; a short poll bounds that delay (at the cost of ~20 polls/s idle).
        "polling_interval": BROKER_POLL_S,
        "socket_connect_timeout": settings.dependency_timeout_s,
        "socket_timeout": max(30.0, settings.dependency_timeout_s),
    }


def _celery() -> Celery:
    global _producer
    with _lock:
        if _producer is None:
            settings = get_settings()
            app = Celery("inferq-api", broker=settings.redis_url, set_as_current=False)
            app.conf.update(
                task_queues=task_queues(),
                broker_transport_options=broker_transport_options(settings),
                broker_connection_timeout=settings.dependency_timeout_s,
                # A task-sent event per message (a Redis PUBLISH, dropped when nobody listens):
                # the only event that carries the routing key, i.e. the lane, to Flower.
                task_send_sent_event=True,
                task_publish_retry_policy={
                    "max_retries": 2,
                    "interval_start": 0.1,
                    "interval_step": 0.2,
                    "interval_max": 0.5,
                },
            )
            _producer = app
        return _producer


def reset() -> None:
    """Drop this process's Celery producer and Redis client; the next use builds them from the
    settings of that moment (tests that change ``INFERQ_REDIS_URL`` call it)."""
    global _producer, _redis
    with _lock:
        _producer = _redis = None


def redis_client() -> redis.Redis:
    global _redis
    with _lock:
        if _redis is None:
            timeout = get_settings().dependency_timeout_s
            _redis = redis.Redis.from_url(
                get_settings().redis_url,
                socket_connect_timeout=timeout,
                socket_timeout=timeout,
                health_check_interval=30,
            )
        return _redis


def redis_ok() -> bool:
    try:
        return bool(redis_client().ping())
    except redis.RedisError:
        return False


def enqueue_messages(batch: Iterable[tuple[str, list[str]]]) -> list[str]:
    """Send one ``run_jobs`` message per (queue, job ids), in order. Returns the ids that were
    not sent.

    A failure here never loses a job: its row is committed, and a job without a message is
    sent by the dispatcher (docs/architecture.md, "Fair share").
    """
    app = _celery()
    failed: list[str] = []
    with app.producer_or_acquire() as producer:
        for name, ids in batch:
            lane = lane_of(name)
            try:
                # A direct queue is published through the anonymous exchange (LPUSH onto the
                # queue's list), so delivery does not depend on kombu's binding keys in Redis.
                app.send_task(
                    RUN_JOBS_TASK,
                    args=[ids, lane],
                    queue=name,
                    producer=producer,
                    # What Flower shows as args; Celery's own safe repr of them cost more
                    # than the rest of the message.
                    argsrepr=repr([ids, lane]),
                    kwargsrepr="{}",
                )
            except Exception:  # kombu raises several connection error types
                log.exception("could not enqueue %d job(s) on %s", len(ids), name)
                failed.extend(ids)
    return failed


def take_back(name: str, messages: int) -> list[list[str]]:
    """Take up to ``messages`` of the newest ``run_jobs`` messages out of a queue's list before
    a worker takes them; returns each one's job ids, which then have no message (the caller
    marks them unsent: ``transitions.unsend``). A worker pops the oldest end of the list and
    this the newest, so the two never get the same message; what is not a ``run_jobs``
    message goes back where it was."""
    client = redis_client()
    taken: list[list[str]] = []
    payloads: list[bytes] = client.lpop(name, messages) or []  # type: ignore[assignment]
    for payload in payloads:
        try:
            taken.append(_job_ids(payload))
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("left a message that is not run_jobs on %s: %r", name, exc)
            client.lpush(name, payload)
    return taken


def _job_ids(payload: bytes) -> list[str]:
    """The job ids of a ``run_jobs`` message as kombu's Redis transport stores it (a JSON
    envelope around the encoded body ``[args, kwargs, embed]``, args ``[job_ids, lane]``)."""
    message = json.loads(payload)
    if message["headers"]["task"] != RUN_JOBS_TASK:
        raise ValueError(message["headers"]["task"])
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = serialization.loads(
        body, message["content-type"], message["content-encoding"]
    )
    return [str(job_id) for job_id in args[0]]


def queue_is_empty(name: str) -> bool:
    """Whether a queue's list holds no message (Redis away: False, so nothing is sent past
    the dispatcher)."""
    try:
        return not redis_client().llen(name)
    except redis.RedisError:
        return False


def send(jobs: list[tuple[str, str]]) -> None:
    """Send committed jobs whose rows say they are sent already (the API's own sends,
    ``transitions.create(direct=True)``); a job whose message could not go out is marked unsent
    again, for the dispatcher. If that fails too, the reaper finds the job queued with no
    message and marks it. One message a job: the API sends a job alone (the dispatcher makes
    the bulk messages)."""
    failed = enqueue_messages([(name, [job_id]) for job_id, name in jobs])
    if not failed:
        return
    from app.core.db import transaction  # only on this rare path: the API's Redis is away

    try:
        with transaction() as connection:
            connection.execute(
                update(Job)
                .where(Job.id.in_(failed), Job.status == JobStatus.QUEUED)
                .values(enqueued_at=None)
            )
    except Exception as exc:
        log.warning("could not mark %d unsent job(s); the reaper will: %s", len(failed), exc)
    wake({name for _, name in jobs})


def wake(queues: Iterable[str]) -> None:
    """Tell the dispatcher that ``queues`` have jobs to send (it also looks by itself every
    second, so a wake-up lost with Redis only delays them)."""
    names = sorted(set(queues))
    if not names:
        return
    try:
        pipe = redis_client().pipeline(transaction=False)
        pipe.lpush(WAKE_KEY, *names)
        pipe.ltrim(WAKE_KEY, 0, WAKE_MAX - 1)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not wake the dispatcher for %s: %s", names, exc)


def deliver_webhooks(event_ids: Iterable[str]) -> list[str]:
    """Send one delivery message per committed webhook event; returns the ids not sent."""
    app = _celery()
    ids = list(event_ids)
    with app.producer_or_acquire() as producer:
        for i, event_id in enumerate(ids):
            try:
                app.send_task(
                    DELIVER_WEBHOOK_TASK, args=[event_id], queue=WEBHOOK_QUEUE, producer=producer
                )
            except Exception:
                # The broker is down: the rest would fail the same way, slowly.
                log.exception("could not enqueue %d webhook event(s)", len(ids) - i)
                return ids[i:]
    return []


def start_batch(batch_id: str) -> bool:
    """Ask the ops worker to validate a batch's file and start its jobs; False if not sent."""
    try:
        _celery().send_task(START_BATCH_TASK, args=[batch_id], queue=MAINTENANCE_QUEUE)
    except Exception:
        log.exception("could not enqueue batch %s; the batch sweep will", batch_id)
        return False
    return True


def publish_control(action: str, **fields: Any) -> int:
    """Broadcast a control message (e.g. cancel a running job) to every worker."""
    message = json.dumps({"action": action, **fields})
    return int(redis_client().publish(CONTROL_CHANNEL, message))
