"""The relay (app/core/messaging/relay.py) over a real Redis: a worker's Publisher to the API's
Replies.

The first piece of a call goes out alone (it is the caller's time to first token), later ones
merged while they queue up, and the end message carries the committed outcome after whatever
was pending; a message for a call that has left, or one that is not a relay message, is
dropped without stopping the reader.
"""

from __future__ import annotations

import asyncio

import pytest
import redis

from app.core.messaging import clients, relay
from app.core.settings import Settings

UPON = {"token": " upon", "logprob": -0.5, "top_logprobs": []}
A = {"token": " a", "logprob": -0.1, "top_logprobs": []}


def test_pieces_and_the_end_reach_the_waiting_call_in_order(core: Settings) -> None:
    publisher = relay.Publisher(clients.redis_client(), merge_ms=200)
    publisher.start()

    async def scenario() -> list[relay.Entry]:
        replies = relay.replies()
        waiter = await replies.register()
        gone = await replies.register()
        gone.close()  # a caller that left: its messages are dropped
        publisher.piece(gone.reply_to, 1, "nobody listens")
        await asyncio.to_thread(
            clients.redis_client().publish, waiter.reply_to.rpartition("/")[0], "not json"
        )
        publisher.piece(waiter.reply_to, 3, "Once")
        first = await waiter.next(timeout_s=5)
        publisher.piece(waiter.reply_to, 3, " upon", logprobs=[UPON])
        publisher.piece(waiter.reply_to, 3, " a", logprobs=[A])
        publisher.end(waiter.reply_to, 3, {"status": "succeeded", "result_text": "Once upon a"})
        entries = [first]
        while entries[-1] is None or entries[-1].ended is None:
            entries.append(await waiter.next(timeout_s=5))
        waiter.close()
        return [e for e in entries if e is not None]

    entries = asyncio.run(scenario())
    assert [(e.token, e.text) for e in entries[:-1]] == [(3, "Once"), (3, " upon a")]
    assert [e.logprobs for e in entries[:-1]] == [[], [UPON, A]]  # merged with their text
    assert entries[-1].ended == {"status": "succeeded", "result_text": "Once upon a"}


def test_a_quiet_call_is_told_when_nothing_came(core: Settings) -> None:
    async def scenario() -> relay.Entry | None:
        waiter = await relay.replies().register()
        try:
            return await waiter.next(timeout_s=0.05)
        finally:
            waiter.close()

    assert asyncio.run(scenario()) is None


def test_pieces_of_tool_calls_are_merged_call_by_call(core: Settings) -> None:
    """A job with tools relays content and pieces of calls: merged pieces keep each call's
    opening (id, name) and join the argument pieces that follow it, call by call."""
    publisher = relay.Publisher(clients.redis_client(), merge_ms=200)
    publisher.start()
    opening = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f"}}

    def args(index: int, text: str) -> dict[str, object]:
        return {"index": index, "function": {"arguments": text}}

    async def scenario() -> list[relay.Entry]:
        waiter = await relay.replies().register()
        publisher.piece(waiter.reply_to, 1, "Sure. ")
        first = await waiter.next(timeout_s=5)
        publisher.piece(waiter.reply_to, 1, "", calls=[opening])
        publisher.piece(waiter.reply_to, 1, "", calls=[args(0, '{"a"')])
        publisher.piece(waiter.reply_to, 1, "", calls=[args(0, ": 1}")])
        second = {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g"}}
        publisher.piece(waiter.reply_to, 1, "", calls=[second, args(1, "{}")])
        publisher.end(waiter.reply_to, 1, {"status": "succeeded"})
        entries = [first]
        while entries[-1] is None or entries[-1].ended is None:
            entries.append(await waiter.next(timeout_s=5))
        waiter.close()
        return [e for e in entries if e is not None]

    first, merged, end = asyncio.run(scenario())
    assert (first.text, first.calls) == ("Sure. ", [])
    assert merged.text == ""
    assert merged.calls == [
        {**opening, "function": {"name": "f", "arguments": '{"a": 1}'}},
        {
            "index": 1,
            "id": "call_b",
            "type": "function",
            "function": {"name": "g", "arguments": "{}"},
        },
    ]
    assert end.ended == {"status": "succeeded"}


def test_a_kept_log_and_a_refused_write_leave_the_connection_in_step(core: Settings) -> None:
    """A write of several messages in one round trip: a log's are kept (XADD, with an expiry),
    and a command Redis refuses fails that write without putting later replies out of step."""
    client = clients.redis_client()
    publisher = relay.Publisher(client, merge_ms=0, keep_s=60)
    log = relay.log_address()
    key, _ = relay.split(log)
    publisher._write([relay._message((log, 1), {"d": "kept"})])
    assert [fields[b"m"] for _, fields in client.xrange(key)] == [b'{"k":"0","t":1,"d":"kept"}']
    assert 0 < client.ttl(key) <= 60

    broken = relay.RESPONSE_EVENTS_PREFIX + "not-a-stream/0"
    client.set(relay.split(broken)[0], "x")  # XADD onto a string is refused
    with pytest.raises(redis.ResponseError):
        publisher._write([relay._message((broken, 1), {"d": "lost"})])
    # The next write on the same pool reads its own replies, not the refused write's.
    publisher._write([relay._message((log, 1), {"d": "again"})])
    assert [fields[b"m"] for _, fields in client.xrange(key)][-1] == b'{"k":"0","t":1,"d":"again"}'
    assert client.ping()
