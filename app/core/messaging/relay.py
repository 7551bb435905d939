"""Relaying a running job's output from its worker to the API call that waits for it.

A job submitted through ``/v1/chat/completions`` or ``/v1/completions`` is still a job: the row
is the truth, and the relay only makes waiting fast. Each API process subscribes once, at its
first call, to a Redis pub/sub channel of its own; a waiting call registers a key there and
writes ``<channel>/<key>`` into its job's ``reply_to``. The worker that holds the job publishes
to that channel, as JSON:

- ``{"k": key, "t": <lease token>, "d": <text>}`` for each piece of output (``relay="tokens"``),
  the first one at once and later ones merged while they queue up; a piece of a choice other
  than the first (``n`` > 1) says which: ``"i": <index>``; a job with tools relays its
  message's content as ``"d"`` and pieces of its calls as ``"c"``: OpenAI's
  ``delta.tool_calls`` entries (workers/inference/tools.py); a job with logprobs relays its
  tokens' as ``"l"`` (``token_logprob`` items, one per token of the piece);
- ``{"k": key, "t": <lease token>, "end": {...}}`` once the job's outcome is committed (every
  relayed job), carrying the committed outcome, so the call answers without reading the row.

**Kept logs.** A background streamed response (app/core/openai/responses.py) has nobody waiting on a
channel, and its client may read from any API process, now or after a lost connection: its
``reply_to`` names a Redis stream of its own (``RESPONSE_EVENTS_PREFIX`` + a random key),
where the same messages are appended (``XADD``), kept ``INFERQ_RESPONSE_EVENTS_KEEP_S`` after
the last one, and read with :func:`read_log` (docs/openai.md, "Responses").

Pub/sub rather than a stream per job: the subscription exists before the job is submitted, so
nothing is published before it is heard; one subscriber per process reads every call's output
from one connection (a blocking read per call, per piece, was most of the API's CPU on the
realtime path: docs/benchmarks.md, "overhead"); and nothing is left in Redis afterwards. A
message lost while Redis or the connection is away delays an answer but never loses it: a
quiet call reads the row every few seconds, and the final text always equals the row's.

The worker side (:class:`Publisher`) runs on a thread of its own: the engine's loop thread only
puts pieces on a queue. The API side (:class:`Replies`) is one per process, held with the
process's Redis clients (app/core/messaging/clients.py) and dropped with them.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import math
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from app.core.messaging import clients
from app.core.messaging.names import REPLY_CHANNEL_PREFIX, RESPONSE_EVENTS_PREFIX
from app.core.settings import get_settings

log = logging.getLogger("inferq.relay")

POLL_S = 1.0  # a waiting call is told each time this passes quietly
READ_COUNT = 512
MAX_PENDING = 100_000  # pieces waiting for Redis in one worker
# A kept log's bound: a response's pieces are merged every relay_merge_ms, so this is far more
# than a response's output (max_tokens_limit tokens at most, a piece each at worst).
LOG_MAX_ENTRIES = 100_000


# The most bytes of a column an end message carries (a pooled job's vectors, base64): beyond
# it the message would be megabytes through pub/sub, whose client buffers Redis bounds.
END_BYTES_MAX = 1 << 20


def _jsonable(outcome: dict[str, Any]) -> dict[str, Any]:
    """``outcome`` with its bytes as base64 text, or left out when larger than
    ``END_BYTES_MAX`` (the caller then reads them from the row)."""
    out = dict(outcome)
    for column, value in outcome.items():
        if isinstance(value, bytes):
            if len(value) <= END_BYTES_MAX:
                out[column] = base64.b64encode(value).decode()
            else:
                del out[column]
    return out


def split(address: str) -> tuple[str, str]:
    """``<channel>/<key>`` -> (channel, key)."""
    channel, _, key = address.rpartition("/")
    return channel, key


# --- worker side ------------------------------------------------------------------------------


class Publisher:
    """Publishes relay messages from any thread; a failed write is logged, never raised.

    A streamed job's first piece goes out at once (it is the caller's time to first token);
    later pieces wait up to ``relay_merge_ms`` and go out together, which divides the work of
    the worker, Redis, the API and the client by the pieces merged (docs/architecture.md,
    relay). An end message sends what is pending of its job first.
    """

    def __init__(self, client: redis.Redis, merge_ms: float, keep_s: float = 3600.0) -> None:
        self._client = client
        self._merge_s = merge_ms / 1000
        self._keep_s = max(1, int(keep_s))  # a kept log's life after its last message
        # (reply_to, lease token, choice index, a piece, or the outcome for the end message)
        self._queue: queue.SimpleQueue[tuple[str, int, int, Piece | dict[str, Any]]] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name="relay", daemon=True)
        self._connection: Any = None  # redis-py's connection (its methods are untyped)

    def start(self) -> None:
        self._thread.start()

    def piece(
        self,
        reply_to: str,
        token: int,
        text: str,
        index: int = 0,
        calls: list[dict[str, Any]] | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> None:
        # While Redis is away pieces would pile up: past a bound they are dropped (the API
        # sends what a call missed from the committed outcome); end messages never are.
        if self._queue.qsize() < MAX_PENDING:
            self._queue.put((reply_to, token, index, Piece(text, calls or [], logprobs or [])))

    def end(self, reply_to: str, token: int, outcome: dict[str, Any]) -> None:
        """The outcome is committed: ``outcome`` is what was committed (see ``Ended``). Bytes
        (a pooled job's vectors) travel base64-encoded up to ``END_BYTES_MAX``; larger ones
        are left out, and the caller reads them from the row."""
        self._queue.put((reply_to, token, 0, _jsonable(outcome)))

    def _loop(self) -> None:
        started: dict[tuple[str, int], None] = {}  # calls whose first piece went out
        # later pieces, not yet sent, by call and choice (merged)
        pending: dict[tuple[str, int], dict[int, Piece]] = {}
        due = 0.0
        while True:
            try:
                wait = max(0.0, due - time.monotonic()) if pending else None
                items = [self._queue.get(timeout=wait)]
            except queue.Empty:
                items = []
            while items and len(items) < READ_COUNT:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            out: list[tuple[str, dict[str, Any]]] = []
            for reply_to, token, index, payload in items:
                call = (reply_to, token)
                if isinstance(payload, Piece):
                    if call in started:
                        if not pending:
                            due = time.monotonic() + self._merge_s
                        held = pending.setdefault(call, {})
                        held[index] = held[index].then(payload) if index in held else payload
                        continue
                    started[call] = None
                    while len(started) > MAX_PENDING:  # calls that never ended (handed back)
                        del started[next(iter(started))]
                    out.append(_piece(call, index, payload))
                else:
                    out += [_piece(call, i, p) for i, p in pending.pop(call, {}).items()]
                    started.pop(call, None)
                    out.append(_message(call, {"end": payload}))
            if pending and time.monotonic() >= due:
                for call, choices in pending.items():
                    out += [_piece(call, i, p) for i, p in choices.items()]
                pending.clear()
            if out:
                try:
                    self._write(out)
                except redis.RedisError as exc:
                    # The API falls back to the row; pieces of this moment are not shown.
                    log.warning("relaying %d messages failed: %s", len(out), exc)

    def _write(self, messages: list[tuple[str, dict[str, Any]]]) -> None:
        """Send ``messages`` in one round trip: a PUBLISH each, or for a kept log an XADD and
        its EXPIRE. Written on a pooled connection directly: redis-py's pipeline (its retry
        wrapper, response callbacks and bookkeeping per command) was most of this thread's
        CPU, and the relay needs none of the replies (docs/benchmarks.md, "CPU per realtime
        call"). The relay thread keeps its connection; every reply is read, so it stays in
        step; one that failed is dropped."""
        commands: list[tuple[Any, ...]] = []
        for channel, body in messages:
            data = json.dumps(body, separators=(",", ":"))
            if channel.startswith(RESPONSE_EVENTS_PREFIX):
                commands.append(("XADD", channel, "MAXLEN", LOG_MAX_ENTRIES, "*", "m", data))
                commands.append(("EXPIRE", channel, self._keep_s))
            else:
                commands.append(("PUBLISH", channel, data))
        pool = self._client.connection_pool
        if self._connection is None:  # this thread's own, kept from write to write
            self._connection = pool.get_connection()
        connection = self._connection
        refused: list[redis.ResponseError] = []
        try:
            connection.send_packed_command(connection.pack_commands(commands))
            for _ in commands:
                try:
                    connection.read_response()
                except redis.ResponseError as exc:  # one command refused: read on
                    refused.append(exc)
        except BaseException:
            # Lost (Redis restarted, a failover): the next write takes a fresh one, which
            # through Sentinel asks for the master again.
            self._connection = None
            connection.disconnect()
            pool.release(connection)
            raise
        if refused:
            raise refused[0]


@dataclass(frozen=True)
class Piece:
    """A piece of one choice's output: its text (a job with tools: its content), pieces of
    its calls and its tokens' logprobs."""

    text: str
    calls: list[dict[str, Any]]
    logprobs: list[dict[str, Any]] = field(default_factory=list)

    def then(self, later: Piece) -> Piece:
        """This piece and the ``later`` one as one; a call's argument pieces that follow each
        other become one."""
        if not later.calls:  # the common case: text (and logprobs) only
            return Piece(self.text + later.text, self.calls, self.logprobs + later.logprobs)
        calls = [dict(c) for c in self.calls]
        for piece in later.calls:
            last = calls[-1] if calls else None
            more_arguments = set(piece) == {"index", "function"}
            if last is not None and last["index"] == piece["index"] and more_arguments:
                function = dict(last.get("function") or {})
                function["arguments"] = function.get("arguments", "") + (
                    piece["function"].get("arguments") or ""
                )
                last["function"] = function
            else:
                calls.append(piece)
        return Piece(self.text + later.text, calls, self.logprobs + later.logprobs)


def _piece(call: tuple[str, int], index: int, piece: Piece) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"d": piece.text}
    if index:
        body["i"] = index
    if piece.calls:
        body["c"] = piece.calls
    if piece.logprobs:
        body["l"] = piece.logprobs
    return _message(call, body)


def _message(call: tuple[str, int], fields: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(channel, body) of a relay message for ``call`` = (reply_to, lease token)."""
    channel, key = split(call[0])
    return channel, {"k": key, "t": call[1], **fields}


# --- API side ---------------------------------------------------------------------------------


@dataclass
class Entry:
    token: int
    text: str | None  # None: the outcome is committed (``ended``)
    ended: dict[str, Any] | None = None
    index: int = 0  # the choice a piece is of
    calls: list[dict[str, Any]] = field(default_factory=list)  # pieces of its calls
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # its tokens'

    @classmethod
    def of(cls, body: dict[str, Any]) -> Entry:
        """A relay message's body as an entry."""
        return cls(
            int(body["t"]),
            body.get("d"),
            body.get("end"),
            int(body.get("i", 0)),
            body.get("c", []),
            body.get("l", []),
        )


@dataclass
class Waiter:
    """One call's registration: where its job replies, and what has arrived."""

    reply_to: str
    queue: asyncio.Queue[Entry]
    _forget: Callable[[], object]

    async def next(self, timeout_s: float = POLL_S) -> Entry | None:
        """The next message, or None when ``timeout_s`` passes quietly."""
        if not self.queue.empty():  # no timer for what is already here (most pieces)
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout_s)
        except TimeoutError:
            return None

    def close(self) -> None:
        self._forget()


class Replies:
    """This API process's subscription: one channel, one reader, a queue per waiting call."""

    def __init__(self) -> None:
        host = socket.gethostname()
        self.channel = f"{REPLY_CHANNEL_PREFIX}{host}:{os.getpid()}:{secrets.token_hex(4)}"
        self._keys = itertools.count()
        self._waiting: dict[str, asyncio.Queue[Entry]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()

    async def register(self) -> Waiter:
        """A ``reply_to`` address for one job, and the queue its messages arrive on.

        The subscription is in place when this returns, so a job submitted with the address
        cannot publish before anyone listens. The caller :meth:`Waiter.close` s it.
        """
        self._start()
        if not self._subscribed.is_set():  # only until the first subscription (or a reconnect)
            with contextlib.suppress(TimeoutError):
                # Redis away: the call still works from the row, only slower.
                timeout = get_settings().dependency_timeout_s
                await asyncio.wait_for(self._subscribed.wait(), timeout)
        key = str(next(self._keys))
        queue: asyncio.Queue[Entry] = asyncio.Queue()
        self._waiting[key] = queue
        return Waiter(f"{self.channel}/{key}", queue, lambda: self._waiting.pop(key, None))

    def _start(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="replies")

    async def _read(self) -> None:
        """Deliver every message of the channel to its call; reconnect while Redis is away."""
        while True:
            pubsub = clients.async_redis().pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                connection = pubsub.connection
                assert connection is not None  # subscribed
                self._subscribed.set()
                while True:
                    # Straight off the subscription's connection: redis-py's get_message adds
                    # a timer, a retry wrapper and a message dict per message, half of what
                    # reading cost the API on the realtime path (docs/benchmarks.md, "CPU per
                    # realtime call"). It blocks the same way (no timeout: a quiet channel is
                    # a normal one); a lost connection raises, and the loop subscribes again.
                    reply = await connection.read_response(timeout=math.inf, push_request=True)
                    if isinstance(reply, list) and len(reply) == 3 and _is_message(reply[0]):
                        self._deliver(reply[2])
            except (redis.RedisError, OSError) as exc:
                self._subscribed.clear()
                log.warning("the reply channel was lost (%s); subscribing again", exc)
                await asyncio.sleep(POLL_S)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]

    def _deliver(self, data: bytes | str) -> None:
        try:
            body = json.loads(data)
            waiting = self._waiting.get(str(body["k"]))
            entry = Entry.of(body)
        except (ValueError, KeyError, TypeError):
            log.warning("ignoring a malformed reply %r", data)
            return
        if waiting is not None:  # a call that has already gone: nobody to tell
            waiting.put_nowait(entry)


def _is_message(kind: bytes | str) -> bool:
    """Whether a reply read off a subscription is a published message (not a confirmation)."""
    return kind in (b"message", "message")


def log_address() -> str:
    """A new ``reply_to`` whose relay messages are kept (a background streamed response): a
    log's key, and a key part the messages carry but nobody reads."""
    return f"{RESPONSE_EVENTS_PREFIX}{secrets.token_hex(12)}/0"


def is_log(address: str | None) -> bool:
    return address is not None and address.startswith(RESPONSE_EVENTS_PREFIX)


async def read_log(
    address: str, after: str = "0", block_s: float = POLL_S
) -> list[tuple[str, Entry]]:
    """The kept messages of the log at ``address`` after log id ``after``, oldest first,
    waiting up to ``block_s`` for one when there are none yet (0: not at all)."""
    key, _ = split(address)
    block = int(block_s * 1000) or None
    found: Any = await clients.async_redis().xread({key: after}, count=READ_COUNT, block=block)
    entries = []
    for _, messages in found or []:
        for log_id, fields in messages:
            body = json.loads({_text(k): v for k, v in fields.items()}["m"])
            entries.append((_text(log_id), Entry.of(body)))
    return entries


async def log_exists(address: str) -> bool:
    return bool(await clients.async_redis().exists(split(address)[0]))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def replies() -> Replies:
    """This process's :class:`Replies` (made on first use, inside the API's event loop)."""
    return clients.held("replies", Replies)
