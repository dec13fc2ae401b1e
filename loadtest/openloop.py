"""An open loop that keeps every request's record: when it was due, when it went out, how it ended, how long it
took, and the ``Retry-After`` it was told. The reliability tests and ``scripts/soak.py`` judge a server by these
records (refusals apart from answers, what was sent before a signal apart from what came after), where the load
tester's steps keep only histograms.

Requests go out on a constant schedule whatever the answers do (no coordinated omission), each on a keep-alive
connection of the lean HTTP/1.1 client, at most ``max_inflight`` at a time (a request over that is recorded as
``client-overflow``, never silently skipped).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loadtest.http1 import ConnectionFailed, Http1Client
from loadtest.runner import sleep_until


@dataclass(frozen=True)
class Request:
    """One request to send: a path, a body and its headers, and a tag to tell kinds apart in the records."""

    path: str
    body: bytes
    headers: dict[str, str]
    tag: str = ""


@dataclass(frozen=True)
class Record:
    """How one request went. Times are seconds from the run's start (``time.perf_counter`` based)."""

    tag: str
    due_s: float  # when the schedule said to send it
    sent_s: float  # when it went out (later than due when the generator fell behind)
    done_s: float
    outcome: str  # the status code ("200", "503", ...), "timeout", "connection" or "client-overflow"
    retry_after: str | None = None

    @property
    def latency_s(self) -> float:
        """From the scheduled send: what a client of a server that fell behind would have waited."""
        return self.done_s - self.due_s

    @property
    def service_s(self) -> float:
        """From the actual send: the server's own answer time."""
        return self.done_s - self.sent_s


async def run_open_loop(
    url: str,
    requests: Sequence[Request],
    *,
    rate: float,
    duration_s: float,
    timeout_s: float = 30.0,
    max_inflight: int = 2048,
    on_tick: Callable[[float], None] | None = None,
    on_record: Callable[[Record], None] | None = None,
) -> list[Record]:
    """Send ``requests`` in turn at ``rate`` per second for ``duration_s``; wait for every answer (each bounded by
    ``timeout_s``) and return the records in the order the requests were due. ``on_tick(elapsed_s)`` is called
    about once a second (progress, or a signal sent at a chosen moment); ``on_record`` with each record as its
    request ends (live counts for a long run)."""
    if rate <= 0 or duration_s <= 0 or not requests:
        raise ValueError("an open loop needs a rate > 0, a duration > 0 and at least one request")
    client = Http1Client(url, timeout_s)
    start = time.perf_counter()
    records: list[Record | None] = []
    tasks: set[asyncio.Task[None]] = set()
    next_tick = 1.0

    async def send(index: int, request: Request, due: float) -> None:
        sent = time.perf_counter() - start
        retry_after = None
        try:
            status, fields, _ = await client.fetch(request.path, request.body, request.headers)
            outcome = str(status)
            retry_after = fields.get("retry-after")
        except TimeoutError:
            outcome = "timeout"
        except ConnectionFailed:
            outcome = "connection"
        record = records[index] = Record(request.tag, due, sent, time.perf_counter() - start, outcome, retry_after)
        if on_record is not None:
            on_record(record)

    count = int(rate * duration_s)
    for i in range(count):
        due = i / rate
        await sleep_until(start + due)
        if on_tick is not None and due >= next_tick:
            on_tick(due)
            next_tick += 1.0
        request = requests[i % len(requests)]
        records.append(None)
        if len(tasks) >= max_inflight:
            now = time.perf_counter() - start
            records[i] = Record(request.tag, due, now, now, "client-overflow")
            continue
        task = asyncio.create_task(send(i, request, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)
    await client.aclose()
    return [r for r in records if r is not None]
