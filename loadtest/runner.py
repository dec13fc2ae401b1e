"""One process's share of a load-test step, on its own event loop.

Closed loop: ``concurrency`` virtual clients, each sends, waits for the answer, sends again; latency runs from the
send. Open loop: requests go out on a schedule (constant spacing or Poisson arrivals) whatever the answers do, and
latency runs from each request's *scheduled* send time, so a server that stalls cannot hide the queue it built
(no coordinated omission). The gap between the scheduled and the actual send is recorded as the generator's send
lag: when it grows, the client, not the server, set the pace.

A step lasts ``warmup_s + duration_s``; only requests sent (closed) or scheduled (open) inside the measured window
count. After the window, answers still owed get up to ``drain_s``; whatever is still open then is cancelled and
counted as the error ``unfinished``: nothing sent is silently left out.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from loadtest.histogram import LatencyHistogram
from loadtest.http1 import ConnectionFailed, Http1Client
from loadtest.inputs import Payload


class Client(Protocol):
    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> int | str: ...

    async def aclose(self) -> None: ...


MODES = ("closed", "open")
ARRIVALS = ("constant", "poisson")


@dataclass(frozen=True)
class PartPlan:
    """What one process does in one step (a share of the step's clients or rate)."""

    url: str
    mode: str
    start_wall: float  # time.time() at which every process starts the step together
    warmup_s: float
    duration_s: float
    drain_s: float
    timeout_s: float
    max_requests: int
    concurrency: int = 0  # closed loop: this process's clients
    rate: float = 0.0  # open loop: this process's requests per second
    arrival: str = "poisson"
    phase_s: float = 0.0  # open loop, constant arrivals: where this process's schedule starts
    seed: int = 0
    max_inflight: int = 1024
    timeline_cap: int = 200_000
    grpc_target: str = ""  # host:port: send over gRPC (the payloads are serialised ModelInferRequests)


@dataclass
class PartResult:
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # successful, measured requests
    send_lag: LatencyHistogram = field(default_factory=LatencyHistogram)  # open loop only
    measured: int = 0  # requests sent or scheduled inside the window
    requests: int = 0  # of those, answered 200
    images: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    last_done_s: float = 0.0  # when the last measured request finished, from the window's start
    cpu_s: float = 0.0  # this process's CPU time during the step
    wall_s: float = 0.0  # how long the step ran in this process, drain included
    timeline: list[tuple[float, float, bool]] = field(default_factory=list)  # (sent at, latency, ok), seconds


class Tally(Protocol):
    value: int


def schedule(plan: PartPlan) -> Iterator[float]:
    """Send times in seconds from the step's start: evenly spaced, or Poisson (exponential gaps, seeded)."""
    if plan.rate <= 0:
        return
    if plan.arrival == "constant":
        k = 0
        while True:
            yield plan.phase_s + k / plan.rate
            k += 1
    rng = random.Random(plan.seed)
    t = 0.0
    while True:
        t += rng.expovariate(plan.rate)
        yield t


class _Step:
    def __init__(self, plan: PartPlan, payloads: list[Payload], client: Client, tally: Tally) -> None:
        self.plan, self.payloads, self.client, self.tally = plan, payloads, client, tally
        self.result = PartResult()
        self.base = time.perf_counter() + (plan.start_wall - time.time())
        self.window = (self.base + plan.warmup_s, self.base + plan.warmup_s + plan.duration_s)
        self.sent = 0

    def in_window(self, at: float) -> bool:
        return self.window[0] <= at < self.window[1]

    async def send(self, payload: Payload, origin: float) -> None:
        """Send one request; its latency counts from ``origin`` (the send, or the scheduled send)."""
        try:
            outcome = str(await self.client.post(payload.path, payload.body, payload.headers))
        except TimeoutError:
            outcome = "timeout"
        except ConnectionFailed:
            outcome = "connection"
        done = time.perf_counter()
        self.tally.value += 1
        if not self.in_window(origin):
            return
        ok = outcome == "200"
        if ok:
            self.result.requests += 1
            self.result.images += payload.images
            self.result.latency.record(done - origin)
        else:
            self.result.errors[outcome] += 1
        self.result.last_done_s = max(self.result.last_done_s, done - self.window[0])
        if len(self.result.timeline) < self.plan.timeline_cap:
            self.result.timeline.append((origin - self.window[0], done - origin, ok))

    async def closed(self) -> list[asyncio.Task[None]]:
        async def client_loop(k: int) -> None:
            i = k
            while time.perf_counter() < self.window[1] and self.sent < self.plan.max_requests:
                self.sent += 1
                payload = self.payloads[i % len(self.payloads)]
                i += self.plan.concurrency
                sent_at = time.perf_counter()
                self.result.measured += self.in_window(sent_at)
                await self.send(payload, sent_at)

        await self._wait_until(self.base)
        return [asyncio.create_task(client_loop(k)) for k in range(self.plan.concurrency)]

    async def open(self) -> list[asyncio.Task[None]]:
        tasks: set[asyncio.Task[None]] = set()
        end = self.plan.warmup_s + self.plan.duration_s
        for i, at in enumerate(schedule(self.plan)):
            if at >= end or self.sent >= self.plan.max_requests:
                break
            due = self.base + at
            await self._wait_until(due)
            self.sent += 1
            measured = self.in_window(due)
            self.result.measured += measured
            if len(tasks) >= self.plan.max_inflight:  # the client's own bound: counted, never silently skipped
                self.result.errors["client-overflow"] += measured
                continue
            task = asyncio.create_task(self._scheduled(self.payloads[i % len(self.payloads)], due))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return list(tasks)

    async def _scheduled(self, payload: Payload, due: float) -> None:
        if self.in_window(due):
            self.result.send_lag.record(max(0.0, time.perf_counter() - due))
        await self.send(payload, due)

    @staticmethod
    async def _wait_until(at: float) -> None:
        delay = at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)


async def run_part_async(plan: PartPlan, payloads: list[Payload], tally: Tally) -> PartResult:
    client: Client
    if plan.grpc_target:
        from loadtest.grpc_client import GrpcClient

        client = GrpcClient(plan.grpc_target, plan.timeout_s)
    else:
        client = Http1Client(plan.url, plan.timeout_s)
    try:
        step = _Step(plan, payloads, client, tally)
        cpu0 = time.process_time()
        tasks = await (step.closed() if plan.mode == "closed" else step.open())
        if tasks:
            bound = step.window[1] + plan.drain_s - time.perf_counter()
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, bound))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        r = step.result
        answered = r.requests + sum(r.errors.values())
        if r.measured > answered:  # still owed an answer when the drain ran out
            r.errors["unfinished"] += r.measured - answered
        step.result.cpu_s = time.process_time() - cpu0
        step.result.wall_s = time.perf_counter() - step.base
        return step.result
    finally:
        await client.aclose()


def run_part(plan: PartPlan, payloads: list[Payload], tally: Tally) -> PartResult:
    """Run one part to its end on a fresh event loop (uvloop where installed)."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    result: PartResult = runner(run_part_async(plan, payloads, tally))
    return result
