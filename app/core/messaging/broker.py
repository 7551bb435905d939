"""What one inferq process sends another through Redis: Celery messages, the dispatcher's
wake-ups and the control channel. The only module that imports kombu.

Messages carry job ids, never payloads: the row is the truth. A ``run_jobs`` message
(:class:`RunJobs`) carries one job of the realtime and standard lanes, up to
``bulk_chunk_size`` of the bulk lane, so a backlog of a million bulk jobs is ~30k messages and
a worker claims a chunk in one transaction. Its shape is encoded and decoded here alone: by
the producer, by the worker's intake (the message as Celery received it) and by the
dispatcher taking messages back out of a list (the message as kombu stored it).

Every Celery app inferq builds, the workers', Flower's and the one that sends task events,
comes from :func:`celery_app`, with the broker options, the queue declarations and the Redis
transport below, so producers and consumers cannot disagree about them. Messages are pushed
onto their queues' lists as Celery's ``send_task`` would write them (:func:`task_message`),
several in one round trip, with Celery's ``task-sent`` event only while Flower watches. A
failed send never loses a job: its row is committed, and a job without a message is sent again
by the dispatcher (docs/architecture.md, "Fair share").
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery
from celery.utils.nodenames import anon_nodename
from kombu import Exchange, Queue, serialization
from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import redis as kombu_redis
from kombu.utils.scheduling import priority_cycle

from app.core.messaging import clients
from app.core.messaging.names import (
    CONTROL_CHANNEL,
    DELIVER_WEBHOOK_TASK,
    FINALIZE_BATCH_TASK,
    FLOWER_WATCHING_KEY,
    MAINTENANCE_QUEUE,
    OPS_QUEUES,
    OWN_QUEUES_KEY,
    RUN_JOBS_TASK,
    START_BATCH_TASK,
    WAKE_KEY,
    WAKE_MAX,
    WEBHOOK_QUEUE,
    lane_of,
    owner_of,
)
from app.core.settings import LANES, Settings, get_settings

log = logging.getLogger("inferq.broker")

# An inference worker's broker poll (BRPOP timeout): a poll that is already waiting does not
# see a lane its intake has just re-opened, so a short one bounds that delay, at the cost of
# ~20 polls a second when idle. Nothing else re-opens queues: other consumers (the ops worker)
# keep kombu's 1 s.
LANE_POLL_S = 0.05


# --- the run_jobs message ----------------------------------------------------------------------


# What RunJobs.of_stored raises for a list entry that is not a run_jobs message.
NOT_RUN_JOBS = (ValueError, KeyError, IndexError, TypeError)


@dataclass(frozen=True)
class RunJobs:
    """One ``run_jobs`` message: the ids of jobs of one lane (one queue) to claim and run."""

    job_ids: list[str]
    lane: str

    def args(self) -> list[Any]:
        """The task's positional arguments, as they travel."""
        return [self.job_ids, self.lane]

    @classmethod
    def of_args(cls, args: Sequence[Any]) -> RunJobs:
        """The message from the task's arguments (a worker received it)."""
        job_ids, lane = args
        return cls([str(job_id) for job_id in job_ids], str(lane))

    @classmethod
    def of_stored(cls, payload: bytes) -> RunJobs:
        """The message as kombu's Redis transport stores it in a list: a JSON envelope around
        the encoded body ``[args, kwargs, embed]``. Raises one of ``NOT_RUN_JOBS`` for anything
        else."""
        message = json.loads(payload)
        if message["headers"]["task"] != RUN_JOBS_TASK:
            raise ValueError(message["headers"]["task"])
        body = message["body"]
        if message.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, _kwargs, _embed = serialization.loads(
            body, message["content-type"], message["content-encoding"]
        )
        return cls.of_args(args)


MESSAGES_PER_WORKER = 4  # a bulk message is at most a quarter of what a worker holds


def jobs_per_message(lane: str, bulk_chunk: int, holds: int = 0) -> int:
    """The jobs in one ``run_jobs`` message of ``lane``, for workers that hold at most
    ``holds`` jobs now (0: not known): one for realtime and standard; for bulk a chunk, but at
    most a quarter of ``holds``, so a worker whose engine runs few sequences takes bulk in
    steps of the fair order (docs/architecture.md, "Fair share"). The dispatcher sizes its
    messages with it for the smallest worker, and a worker its room for one with its own."""
    if lane != "bulk":
        return 1
    if holds <= 0:
        return bulk_chunk
    return max(1, min(bulk_chunk, holds // MESSAGES_PER_WORKER))


# --- queues, lane order and the transport: every Celery app of inferq ------------------------


def task_queues(names: Iterable[str] = OPS_QUEUES) -> list[Queue]:
    """Queues in strict priority order: a worker polls them in exactly this order."""
    return [Queue(name, Exchange(name, type="direct"), routing_key=name) for name in names]


class LaneOrder(priority_cycle):  # type: ignore[misc]
    """kombu queue cycle that always polls lanes in priority order.

    Workers cancel and re-add lane consumers at run time (``workers/inference/intake.py``);
    kombu's own "priority" cycle keeps the order in which queues were added, so a re-added
    realtime queue would end up behind bulk. Sorting by lane restores the order on every change;
    within a lane a worker's own queue comes before the shared one (prefix affinity, then work
    stealing: docs/scheduling.md, "Prefix affinity"), and never before a lane above.
    """

    def update(self, it: Iterable[str]) -> None:
        rank = {lane: i for i, lane in enumerate(LANES)}
        self.items[:] = sorted(
            it, key=lambda q: (rank.get(lane_of(q), len(rank)), owner_of(q) is None)
        )


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


class _SentinelChannel(_RedisChannel, kombu_redis.SentinelChannel):  # type: ignore[misc]
    """kombu's Sentinel channel (each connection asks the sentinels for the master) with
    :class:`_RedisChannel`'s one client."""


class SentinelTransport(kombu_redis.SentinelTransport):  # type: ignore[misc]
    """kombu's Sentinel transport with :class:`_SentinelChannel` (``sentinel://`` URLs)."""

    Channel = _SentinelChannel


def broker_transport_options(settings: Settings, poll_s: float | None = None) -> dict[str, Any]:
    """kombu's options for inferq's queues; ``poll_s``: the BRPOP timeout (None: kombu's 1 s)."""
    options = {
        # BRPOP the queues in strict lane order instead of kombu's default round robin.
        "queue_order_strategy": f"{__name__}:LaneOrder",
        "priority_steps": [0],
        # No redelivery bookkeeping in Redis (an unacked hash and index written for every
        # message received and cleared at its ack: 8 % of a worker's CPU per realtime call,
        # docs/benchmarks.md, "overhead"). The job row is what gets a job run again: a
        # dead worker's claimed jobs come back when their lease expires, a fetched message
        # that was never claimed is re-sent by the reaper once its lane's list is empty, and a
        # worker that stops hands its jobs back (docs/reliability.md, "Reliability contract").
        # The bookkeeping's own redelivery came after a visibility timeout of two days, later
        # than the reaper.
        "ack_emulation": False,
        "socket_connect_timeout": settings.dependency_timeout_s,
        "socket_timeout": max(30.0, settings.dependency_timeout_s),
    }
    if poll_s is not None:
        options["polling_interval"] = poll_s
    return options


def celery_app(
    name: str, settings: Settings, *, poll_s: float | None = None, **config: Any
) -> Celery:
    """A Celery app on ``settings``' Redis with inferq's queues and broker options; ``config``
    adds to (or overrides) them; ``poll_s`` is its consumer's BRPOP timeout (None: kombu's).
    kombu picks a transport by the broker URL's scheme, so the schemes ``redis`` and
    ``sentinel`` are pointed at :class:`RedisTransport` and :class:`SentinelTransport` here,
    before the app connects; URLs keep their scheme (Flower reads its broker's kind from it).
    A ``sentinel://`` setting becomes kombu's form of it."""
    TRANSPORT_ALIASES["redis"] = f"{__name__}:RedisTransport"
    TRANSPORT_ALIASES["sentinel"] = f"{__name__}:SentinelTransport"
    sentinel = settings.redis_sentinel
    options = broker_transport_options(settings, poll_s)
    if sentinel is not None:
        options["master_name"] = sentinel.master
    broker = settings.redis_url if sentinel is None else sentinel.kombu_url()
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(
        task_queues=task_queues(),
        broker_transport_options=options,
        task_serializer="json",
        accept_content=["json"],
        **config,
    )
    return app


def _producer() -> Celery:
    """This process's Celery app for what it sends beside ``run_jobs`` messages' lists: the
    task-sent events while Flower watches (dropped by ``clients.reset``)."""

    def build() -> Celery:
        settings = get_settings()
        # A caller waits on a send: no longer than on any dependency.
        return celery_app(
            "inferq-producer", settings, broker_connection_timeout=settings.dependency_timeout_s
        )

    return clients.held("producer", build)


@dataclass(frozen=True)
class _Origin:
    """What every message this process sends says of its sender, as Celery's ``send_task``
    says it: ``origin`` (an anonymous node name, ``gen<pid>@<host>``) and ``reply_to`` (an id
    of the process, used only by result backends, which inferq has none of)."""

    node: str
    reply_to: str


def _origin() -> _Origin:
    return clients.held("origin", lambda: _Origin(anon_nodename(), str(uuid.uuid4())))


def task_message(queue: str, task: str, args: list[Any]) -> tuple[str, bytes]:
    """A task's message and its id: Celery's task message (protocol 2) as kombu's Redis
    transport stores it in a queue's list, the bytes ``send_task`` pushes there.

    Built here in one step: ``send_task``'s layers (routing, signals, kombu's declare, ensure
    and prepare, a task-sent event whether or not anybody listens) were three quarters of the
    API's CPU of sending a realtime job (docs/benchmarks.md, "CPU per realtime call").
    tests/unit/test_broker.py holds it to what ``send_task`` writes, field by field.
    """
    task_id = str(uuid.uuid4())
    origin = _origin()
    argsrepr = repr(args)  # what Flower shows as args
    body = json.dumps([args, {}, _EMBED]).encode()
    envelope = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": task,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": argsrepr,
            "kwargsrepr": "{}",
            "origin": origin.node,
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": origin.reply_to,
            "delivery_mode": 2,
            # A direct queue is published through the anonymous exchange (LPUSH onto the
            # queue's list), so delivery does not depend on kombu's binding keys in Redis.
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return task_id, json.dumps(envelope).encode()


_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@dataclass(frozen=True)
class _Sent:
    queue: str
    task: str
    args: list[Any]
    task_id: str


def _push(messages: Sequence[tuple[str, str, list[Any]]]) -> bool:
    """Push (queue, task, args) messages onto their queues' lists, in order, in one round trip;
    False if Redis did not take them (some may be there: a job sent twice is claimed once).
    While Flower watches, each also gets Celery's ``task-sent`` event, the only event that
    carries its queue (its lane) to Flower's task list.

    One LPUSH per queue, with its messages in order (LPUSH of several values pushes them one
    after the other, as several LPUSHes would)."""
    if not messages:
        return True
    sent: list[_Sent] = []
    by_queue: dict[str, list[bytes]] = {}
    for queue, task, args in messages:
        task_id, payload = task_message(queue, task, args)
        by_queue.setdefault(queue, []).append(payload)
        sent.append(_Sent(queue, task, args, task_id))
    try:
        pipe = clients.redis_client().pipeline(transaction=False)
        for queue, payloads in by_queue.items():
            pipe.lpush(queue, *payloads)
        own = [queue for queue in by_queue if owner_of(queue) is not None]
        if own:
            # Noted with the send: a worker's own queue is found when its worker goes away
            # (app/dispatcher/loop.py) and counted with its lane's (app/core/observe/snapshot.py).
            pipe.sadd(OWN_QUEUES_KEY, *own)
        pipe.execute()
    except redis.RedisError:
        log.exception("could not enqueue %d message(s)", len(messages))
        return False
    if watched():
        _sent_events(sent)
    return True


def _sent_events(sent: Sequence[_Sent]) -> None:
    """Celery's ``task-sent`` events of ``sent``, with the fields ``send_task`` gives them."""
    app = _producer()
    dispatcher = clients.held("sent-events", lambda: app.events.Dispatcher(enabled=False))
    try:
        with app.producer_or_acquire() as producer:
            for message in sent:
                fields = {
                    "uuid": message.task_id,
                    "root_id": message.task_id,
                    "parent_id": None,
                    "name": message.task,
                    "args": repr(message.args),
                    "kwargs": "{}",
                    "retries": 0,
                    "eta": None,
                    "expires": None,
                    "queue": message.queue,
                    "exchange": "",
                    "routing_key": message.queue,
                }
                dispatcher.publish("task-sent", fields, producer)
    except Exception as exc:  # kombu raises several connection error types; events are a view
        log.warning("could not send %d task-sent event(s): %s", len(sent), exc)


# --- whether Flower watches --------------------------------------------------------------------

WATCH_TTL_S = 30.0  # Flower marks itself watching this long, again every third of it
WATCH_LOOK_S = 2.0  # a sender looks at the mark at most this often


def mark_watched() -> None:
    """Say that Flower watches (``inferq flower`` does, every ``WATCH_TTL_S / 3``): senders
    then add task-sent events to what they send."""
    clients.redis_client().set(FLOWER_WATCHING_KEY, "1", px=int(WATCH_TTL_S * 1000))


@dataclass
class _Look:
    at: float = float("-inf")
    watched: bool = False


def watched() -> bool:
    """Whether Flower watches now (looked at in Redis at most every ``WATCH_LOOK_S``): task
    events cost every message a Redis PUBLISH that nobody reads while nobody watches, as
    workers send theirs only then (workers/celery_app.py)."""
    look = clients.held("watch-look", _Look)
    stamp = time.monotonic()
    if stamp - look.at >= WATCH_LOOK_S:
        look.at = stamp
        try:
            look.watched = bool(clients.redis_client().exists(FLOWER_WATCHING_KEY))
        except redis.RedisError:
            look.watched = False
    return look.watched


# --- sending -----------------------------------------------------------------------------------


def send_jobs(batch: Iterable[tuple[str, list[str]]]) -> list[str]:
    """Send one ``run_jobs`` message per (queue, job ids), in order, in one round trip.
    Returns the ids that were not sent (all of them when Redis did not answer)."""
    messages = [(name, RUN_JOBS_TASK, RunJobs(ids, lane_of(name)).args()) for name, ids in batch]
    if _push(messages):
        return []
    return [job_id for _, _, (ids, _lane) in messages for job_id in ids]


def take_newest(name: str, messages: int) -> list[RunJobs]:
    """Take up to ``messages`` of the newest ``run_jobs`` messages out of a queue's list before
    a worker takes them; their jobs then have no message (the caller marks them unsent:
    ``transitions.take_back``). A worker pops the oldest end of the list and this the newest,
    so the two never get the same message; what is not a ``run_jobs`` message goes back where
    it was."""
    client = clients.redis_client()
    taken: list[RunJobs] = []
    payloads: list[bytes] = client.lpop(name, messages) or []  # type: ignore[assignment]
    for payload in payloads:
        try:
            taken.append(RunJobs.of_stored(payload))
        except NOT_RUN_JOBS as exc:
            log.warning("left a message that is not run_jobs on %s: %r", name, exc)
            client.lpush(name, payload)
    return taken


def forget_own(name: str) -> bool:
    """Forget a gone worker's own queue once its list is empty; False while it holds messages.
    Watched: a message pushed between the look and the forgetting (the send notes the queue
    again in the same round trip) makes it a no, so a queue with messages is never forgotten."""
    with clients.redis_client().pipeline(transaction=True) as pipe:
        try:
            pipe.watch(name)  # type: ignore[no-untyped-call]
            if pipe.llen(name):
                return False
            pipe.multi()
            pipe.srem(OWN_QUEUES_KEY, name)
            pipe.execute()
        except redis.WatchError:
            return False
    return True


def listed(name: str) -> list[RunJobs]:
    """The ``run_jobs`` messages in a queue's list now, oldest first; a look, nothing taken."""
    payloads: list[bytes] = clients.redis_client().lrange(name, 0, -1)  # type: ignore[assignment]
    messages = (_run_jobs(payload) for payload in reversed(payloads))
    return [message for message in messages if message is not None]


def _run_jobs(payload: bytes) -> RunJobs | None:
    """A stored list entry as a ``run_jobs`` message; None for any other message (no job of
    anyone's)."""
    try:
        return RunJobs.of_stored(payload)
    except NOT_RUN_JOBS:
        return None


def queue_is_empty(name: str) -> bool:
    """Whether a queue's list holds no message (Redis away: False, so nothing is sent past
    the dispatcher)."""
    try:
        return not clients.redis_client().llen(name)
    except redis.RedisError:
        return False


def send_webhooks(event_ids: Iterable[str]) -> list[str]:
    """Send one delivery message per committed webhook event; returns the ids not sent."""
    ids = list(event_ids)
    if _push([(WEBHOOK_QUEUE, DELIVER_WEBHOOK_TASK, [event_id]) for event_id in ids]):
        return []
    return ids


def send_start_batch(batch_id: str) -> bool:
    """Ask the ops worker to validate a batch's file and start its jobs; False if not sent
    (the batch sweep will)."""
    return _push([(MAINTENANCE_QUEUE, START_BATCH_TASK, [batch_id])])


def send_finalize_batch(batch_id: str) -> bool:
    """Ask the ops worker to finalize a batch whose last jobs ended; False if not sent (the
    batch sweep will)."""
    return _push([(MAINTENANCE_QUEUE, FINALIZE_BATCH_TASK, [batch_id])])


def wake(queues: Iterable[str]) -> None:
    """Tell the dispatcher that ``queues`` have jobs to send (it also looks by itself every
    second, so a wake-up lost with Redis only delays them)."""
    names = sorted(set(queues))
    if not names:
        return
    try:
        pipe = clients.redis_client().pipeline(transaction=False)
        pipe.lpush(WAKE_KEY, *names)
        pipe.ltrim(WAKE_KEY, 0, WAKE_MAX - 1)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("could not wake the dispatcher for %s: %s", names, exc)


def publish_control(action: str, **fields: Any) -> int:
    """Broadcast a control message (e.g. cancel a running job) to every worker."""
    message = json.dumps({"action": action, **fields})
    return int(clients.redis_client().publish(CONTROL_CHANNEL, message))
