"""One process's share of a load-test step, on its own event loop: the closed loop, or the open loop with latency
from each *scheduled* send and the send lag kept (README, "Load testing"). Only requests sent (closed) or scheduled
(open) inside the measured window count; answers still owed after ``drain_s`` are cancelled and counted as the error
``unfinished``. With several models (``PartPlan.mix``: their cumulative weights) each request's model is drawn in
send order (:mod:`loadtest.mix`) and each model tallied apart; with ``keep_sequence`` every request put on the wire
is recorded (its send time and model), warm-up included, so the run's sequence can be replayed.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from array import array
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, cast

from loadtest.histogram import LatencyHistogram
from loadtest.http1 import ConnectionFailed, Http1Client
from loadtest.inputs import Payload
from loadtest.mix import ModelDraw, ModelTally, draw_seed


class Client(Protocol):
    async def fetch(
        self, path: str, body: bytes, headers: dict[str, str]
    ) -> tuple[int | str, dict[str, str], bytes]: ...

    async def aclose(self) -> None: ...


T = TypeVar("T")


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
    process: int = 0  # this process's index: with ``seed``, the model draw's stream
    mix: tuple[float, ...] = ()  # several models: their cumulative weights (one model when empty)
    keep_sequence: bool = False  # record each request sent (time, model) for the run's sequence
    keep_answers: int = 0  # keep the bodies of this many measured answers (200), for an answer check


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
    sent: int = 0  # requests put on the wire, warm-up included
    models: list[ModelTally] = field(default_factory=list)  # with a mix: per model, the measured requests
    sent_at: array[float] = field(default_factory=lambda: array("d"))  # with keep_sequence: from the step's start
    sent_model: array[int] = field(default_factory=lambda: array("I"))  # ... and each one's model index
    answers: list[tuple[tuple[str, ...], bytes]] = field(default_factory=list)  # kept: (image names, body)


class Tally(Protocol):
    value: int


def schedule(plan: PartPlan) -> Iterator[float]:
    """Send times in seconds from the step's start: evenly spaced, or Poisson (exponential gaps, seeded)."""
    if plan.rate <= 0:
        return
    if plan.arrival == "constant":
        yield from (plan.phase_s + k / plan.rate for k in itertools.count())
    rng = random.Random(plan.seed)
    t = 0.0
    while True:
        t += rng.expovariate(plan.rate)
        yield t


class _Step:
    def __init__(self, plan: PartPlan, corpus: list[list[Payload]], client: Client, tally: Tally) -> None:
        self.plan, self.corpus, self.client, self.tally = plan, corpus, client, tally
        self.result = PartResult()
        self.base = time.perf_counter() + (plan.start_wall - time.time())
        self.window = (self.base + plan.warmup_s, self.base + plan.warmup_s + plan.duration_s)
        self.sent = 0
        self.draw = ModelDraw(plan.mix, draw_seed(plan.seed, plan.process)) if plan.mix else None
        if plan.mix:
            if len(corpus) != len(plan.mix):
                raise ValueError(f"a mix of {len(plan.mix)} models needs as many payload lists, got {len(corpus)}")
            self.result.models = [ModelTally() for _ in plan.mix]

    def pick(self, i: int) -> tuple[int, Payload]:
        """The next request's model (drawn, with a mix) and its payload, the ``i``-th of that model's corpus."""
        model = self.draw.next() if self.draw is not None else 0
        payloads = self.corpus[model]
        return model, payloads[i % len(payloads)]

    def count_measured(self, model: int, measured: bool) -> None:
        self.result.measured += measured
        if self.result.models:
            self.result.models[model].measured += measured

    def in_window(self, at: float) -> bool:
        return self.window[0] <= at < self.window[1]

    async def send(self, payload: Payload, origin: float, model: int = 0) -> None:
        """Send one request; its latency counts from ``origin`` (the send, or the scheduled send)."""
        r = self.result
        r.sent += 1
        if self.plan.keep_sequence:
            r.sent_at.append(time.perf_counter() - self.base)
            r.sent_model.append(model)
        fields: dict[str, str] = {}
        answer = b""
        try:
            status, fields, answer = await self.client.fetch(payload.path, payload.body, payload.headers)
            outcome = str(status)
        except TimeoutError:
            outcome = "timeout"
        except ConnectionFailed:
            outcome = "connection"
        done = time.perf_counter()
        self.tally.value += 1
        if not self.in_window(origin):
            return
        if r.models:
            r.models[model].record(outcome, done - origin, fields.get("server-timing"))
        ok = outcome == "200"
        if ok:
            r.requests += 1
            r.images += payload.images
            r.latency.record(done - origin)
            if len(r.answers) < self.plan.keep_answers:  # reading a body is free, holding it is not
                r.answers.append((payload.names, answer))
        else:
            r.errors[outcome] += 1
        r.last_done_s = max(r.last_done_s, done - self.window[0])
        if len(r.timeline) < self.plan.timeline_cap:
            r.timeline.append((origin - self.window[0], done - origin, ok))

    async def closed(self) -> list[asyncio.Task[None]]:
        async def client_loop(k: int) -> None:
            i = k
            while time.perf_counter() < self.window[1] and self.sent < self.plan.max_requests:
                self.sent += 1
                model, payload = self.pick(i)
                i += self.plan.concurrency
                sent_at = time.perf_counter()
                self.count_measured(model, self.in_window(sent_at))
                await self.send(payload, sent_at, model)

        await sleep_until(self.base)
        return [asyncio.create_task(client_loop(k)) for k in range(self.plan.concurrency)]

    async def open(self) -> list[asyncio.Task[None]]:
        tasks: set[asyncio.Task[None]] = set()
        end = self.plan.warmup_s + self.plan.duration_s
        for i, at in enumerate(schedule(self.plan)):
            if at >= end or self.sent >= self.plan.max_requests:
                break
            due = self.base + at
            await sleep_until(due)
            self.sent += 1
            model, payload = self.pick(i)  # drawn even when it overflows: the draw stays the same stream
            measured = self.in_window(due)
            self.count_measured(model, measured)
            if len(tasks) >= self.plan.max_inflight:  # the client's own bound: counted, never silently skipped
                self.result.errors["client-overflow"] += measured
                if self.result.models:
                    self.result.models[model].errors["client-overflow"] += measured
                continue
            task = asyncio.create_task(self._scheduled(payload, due, model))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        return list(tasks)

    async def _scheduled(self, payload: Payload, due: float, model: int) -> None:
        if self.in_window(due):
            self.result.send_lag.record(max(0.0, time.perf_counter() - due))
        await self.send(payload, due, model)


async def run_part_async(plan: PartPlan, corpus: list[list[Payload]], tally: Tally) -> PartResult:
    """Run one part; ``corpus``: the payloads of each model of the plan's mix (one list without a mix)."""
    client: Client
    if plan.grpc_target:
        from loadtest.grpc_client import GrpcClient

        client = GrpcClient(plan.grpc_target, plan.timeout_s)
    else:
        client = Http1Client(plan.url, plan.timeout_s)
    try:
        step = _Step(plan, corpus, client, tally)
        cpu0 = time.process_time()
        tasks = await (step.closed() if plan.mode == "closed" else step.open())
        if tasks:
            bound = step.window[1] + plan.drain_s - time.perf_counter()
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, bound))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        r = step.result
        counted: list[PartResult | ModelTally] = [r, *r.models]
        for t in counted:
            owed = t.measured - t.requests - sum(t.errors.values())
            if owed > 0:  # still owed an answer when the drain ran out
                t.errors["unfinished"] += owed
        r.cpu_s = time.process_time() - cpu0
        r.wall_s = time.perf_counter() - step.base
        return r
    finally:
        await client.aclose()


def on_fresh_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on a fresh event loop (uvloop where installed)."""
    try:
        import uvloop

        runner: Any = uvloop.run
    except ImportError:
        runner = asyncio.run
    return cast(T, runner(coro))


async def sleep_until(at: float) -> None:
    """Sleep until ``time.perf_counter()`` reaches ``at`` (at once when it has)."""
    delay = at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
