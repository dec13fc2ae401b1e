"""A source's subscriber (service/frontend/sources/source.py): the streams' bounded outbox
(service/frontend/outbox.py), cut off rather than slowing the source, and the end always its last message."""

from __future__ import annotations

import asyncio

from service.frontend.outbox import OUTBOX_LIMIT
from service.frontend.sources.source import Subscriber


def test_a_subscriber_that_stops_reading_is_cut_off_and_holds_no_more_than_its_outbox() -> None:
    subscriber = Subscriber()
    for i in range(OUTBOX_LIMIT + 50):
        subscriber.put({"frame": i, "status": "result"})  # the source never waits on it
    assert subscriber.cut_off is not None and len(subscriber.held) == OUTBOX_LIMIT

    async def read() -> list[dict[str, object]]:
        return [m async for m in subscriber.messages()]

    got = asyncio.run(read())
    assert [m["frame"] for m in got] == list(range(OUTBOX_LIMIT))  # what it held, then the end of its messages


def test_the_end_is_the_last_message_and_nothing_follows_it() -> None:
    subscriber = Subscriber()
    subscriber.put({"frame": 0, "status": "result"})
    subscriber.put({"status": "ended", "state": "ended", "reason": "the file ended"}, last=True)
    subscriber.put({"frame": 1, "status": "result"})

    async def read() -> list[dict[str, object]]:
        return [m async for m in subscriber.messages()]

    got = asyncio.run(read())
    assert [m["status"] for m in got] == ["result", "ended"]
