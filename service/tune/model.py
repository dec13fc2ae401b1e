"""``tune``'s prediction: a small discrete-event simulation of one open-loop load step against a candidate.

Poisson arrivals (the load tester's) go through the server as it is built:

1. a front end: ``workers`` event loops, one request at a time each (HTTP in and out, the transport),
   ``frontend_ms`` of CPU per request, first come first served; then the image is decoded and preprocessed in
   the front end's thread pool (``decode_ms``, measured);
2. the batcher, with Triton's semantics as ``service/engine/batcher.py`` implements them: a batch forms when an
   instance is free, up to ``max_batch_size``; it leaves at once when the maximum or a preferred size is reached,
   or when the oldest image has waited ``max_queue_delay_ms`` (the ``adaptive`` policy adds its cost test);
3. ``instances`` runtime instances, each batch taking a time drawn from the measured batch times of its size.

Every one of these shares the machine's cores: at any moment the demand is the busy instances' threads plus the
average CPU the requests' own work takes (front end, decoding and, when it runs here, the load generator); past
the cores, everything slows by demand / cores (processor sharing). A GPU runs the batches, so there the instances
share the device instead.

A step is simulated as the load tester runs one: from an idle server, for its warm-up and its measured window,
latencies counted from each scheduled send in the window. The predicted capacity is the highest rate whose
simulated p99 meets the target with nothing refused, found by bisection; common random numbers (the same
arrival stream and service draws at every rate) keep p99 monotone enough in the rate for bisection to work.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from service.core.batchcost import CostModel
from service.tune.candidates import Candidate
from service.tune.measure import RuntimeFigures

# Server CPU per request besides decoding: HTTP parsing and answering, shared memory, transport and batching.
# FACTS.md, "Serving overhead, no model": 1,425 requests/s of 64x64 JPEGs with a noop model on 2 cores, about
# 1.0 ms per request. Most of it is the front end's event loop; the engine's share is a few tenths.
FRONTEND_MS = 1.0
ENGINE_SHARE = 0.25  # of FRONTEND_MS, spent in the engine's loop, not the front end's
# The load generator's CPU per request: docs/performance.md, "The generator's own capacity": ~30,000 requests/s
# from one process on one core.
CLIENT_MS = 0.05
# A request's round trip through shared memory and the engine, as latency (FACTS.md, "A naive transport": median
# 162-202 us).
TRANSPORT_MS = 0.2


@dataclass(frozen=True)
class Workload:
    """What a candidate is simulated under: the machine, the per-request costs, and the step's shape."""

    cores: int
    decode_ms: float
    cuda: bool = False
    frontend_ms: float = FRONTEND_MS
    client_ms: float = CLIENT_MS
    warmup_s: float = 1.0
    duration_s: float = 4.0
    max_queue_size: int = 1024
    min_samples: int = 2000


class ServiceCurve:
    """Batch times for every size from 1 to the largest measured: the measured samples of a size, or those of the
    nearest measured size below, scaled to the line through its measured neighbours."""

    def __init__(self, figures: RuntimeFigures, largest: int) -> None:
        measured = sorted(figures.batch_ms)
        means = {b: float(np.mean(figures.batch_ms[b])) for b in measured}
        self.samples: list[list[float]] = [[]]
        for b in range(1, largest + 1):
            below = max((m for m in measured if m <= b), default=measured[0])
            above = min((m for m in measured if m >= b), default=None)
            if above is None:  # past the largest measured: the same time per image
                mean = means[below] * b / below
            elif above == below:
                mean = means[b]
            else:
                mean = means[below] + (means[above] - means[below]) * (b - below) / (above - below)
            scale = mean / means[below]
            self.samples.append([s * scale for s in figures.batch_ms[below]])
        self.largest = largest

    def mean(self, size: int) -> float:
        return float(np.mean(self.samples[size]))

    def knee(self, limit: int) -> int:
        """The adaptive policy's largest batch from a backlog (``CostModel.knee``) on these batch times."""
        limit = min(limit, self.largest)
        return CostModel({b: self.mean(b) for b in range(1, limit + 1)}).knee(limit) or limit


@dataclass
class StepOutcome:
    rate: float
    p50_ms: float
    p99_ms: float
    refused: int
    mean_batch: float
    samples: int

    def meets(self, target_p99_ms: float) -> bool:
        return self.refused == 0 and self.samples > 0 and self.p99_ms <= target_p99_ms


def _unit_arrivals(seed: int, count: int) -> np.ndarray:
    return np.cumsum(np.random.default_rng(seed).exponential(1.0, count))


@dataclass
class Simulator:
    """Simulates steps of one candidate; reuse it across rates (common random numbers)."""

    candidate: Candidate
    curve: ServiceCurve
    workload: Workload
    seed: int = 0
    _units: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._units = _unit_arrivals(self.seed, 4096)

    def _arrivals(self, rate: float, replica: int) -> list[float]:
        """Arrival times (ms) of one step; replica ``k`` takes the stream from its own offset."""
        horizon = (self.workload.warmup_s + self.workload.duration_s) * rate
        need = int(horizon * 1.5 + 50 * math.sqrt(horizon + 1) + 10)
        if len(self._units) < need * (replica + 1) + 1:
            self._units = _unit_arrivals(self.seed, need * (replica + 2) * 2)
        start = need * replica
        units = self._units[start : start + need] - (self._units[start - 1] if start else 0.0)
        return [float(t) for t in units[units <= horizon] * (1000.0 / rate)]

    def step(self, rate: float) -> StepOutcome:
        w = self.workload
        per_step = max(1.0, rate * w.duration_s)
        replicas = max(1, min(20, math.ceil(w.min_samples / per_step)))
        latencies: list[float] = []
        refused = batches = images = 0
        draw = random.Random(self.seed).random
        for k in range(replicas):
            lat, r, b, n = self._one(rate, self._arrivals(rate, k), draw)
            latencies += lat
            refused, batches, images = refused + r, batches + b, images + n
        if not latencies:
            return StepOutcome(rate, math.nan, math.inf, refused, 0.0, 0)
        p50, p99 = np.percentile(latencies, [50, 99])
        return StepOutcome(rate, float(p50), float(p99), refused, images / max(batches, 1), len(latencies))

    def _one(self, rate: float, arrivals: list[float], rand: Callable[[], float]) -> tuple[list[float], int, int, int]:
        c, w, curve = self.candidate, self.workload, self.curve
        cores = float(w.cores)
        thread_cores = 0.0 if w.cuda else float(c.threads or w.cores)
        background = rate * (w.frontend_ms + w.decode_ms + w.client_ms) / 1000.0  # cores, on average
        loop_ms = w.frontend_ms * (1.0 - ENGINE_SHARE)
        maxb = min(c.max_batch_size, curve.largest)
        preferred = sorted(p for p in c.preferred_batch_sizes if p <= maxb)
        threshold = preferred[0] if preferred else maxb
        delay = c.max_queue_delay_ms
        adaptive = c.batch_policy == "adaptive"
        knee = curve.knee(maxb) if adaptive else maxb  # the adaptive batch from a backlog stops there
        gap_ms = 1000.0 / rate
        warmup_ms = w.warmup_s * 1000.0
        loops = [0.0] * c.workers
        heap: list[tuple[float, int, float]] = []  # (time, kind, arrival); kind 0 ready, 1 instance free, 2 timer
        queue: deque[tuple[float, float]] = deque()  # (ready at the batcher, arrival)
        busy = refused = batches = images = 0
        timer_at = -1.0
        latencies: list[float] = []
        i, n = 0, len(arrivals)
        while i < n or heap:
            if i < n and (not heap or arrivals[i] <= heap[0][0]):
                now = arrivals[i]
                i += 1
                slow = max(1.0, (busy * thread_cores + background) / cores)
                start = max(now, loops[0])
                heapq.heapreplace(loops, start + loop_ms * slow)
                heapq.heappush(heap, (start + (loop_ms + w.decode_ms) * slow, 0, now))
                continue
            now, kind, arrived = heapq.heappop(heap)
            if kind == 0:
                if len(queue) >= w.max_queue_size:
                    refused += arrived >= warmup_ms
                else:
                    queue.append((now, arrived))
            elif kind == 1:
                busy -= 1
            while busy < c.instances and queue:
                count = len(queue)
                deadline = queue[0][0] + delay
                go = count >= min(maxb, knee) or (preferred and count >= threshold) or now >= deadline
                if not go and adaptive:
                    go = _dispatch_now(curve, count, gap_ms)
                if not go:
                    if deadline != timer_at:
                        timer_at = deadline
                        heapq.heappush(heap, (deadline, 2, 0.0))
                    break
                take = maxb if count >= maxb else max([p for p in preferred if p <= count], default=count)
                take = min(take, knee)
                busy += 1
                slow = float(busy) if w.cuda else max(1.0, (busy * thread_cores + background) / cores)
                samples = curve.samples[take]
                done = now + samples[int(rand() * len(samples))] * slow
                heapq.heappush(heap, (done, 1, 0.0))
                batches += 1
                images += take
                for _ in range(take):
                    _ready, arrived = queue.popleft()
                    if arrived >= warmup_ms:
                        latencies.append(done - arrived + TRANSPORT_MS)
        return latencies, refused, batches, images


def _dispatch_now(curve: ServiceCurve, n: int, gap_ms: float) -> bool:
    """The adaptive policy's test (``Batcher._dispatch_now``), with the measured mean batch times."""
    if n + 1 > curve.largest:
        return True
    t_n, t_next, t_one = curve.mean(n), curve.mean(n + 1), curve.mean(1)
    wait = n * (gap_ms + t_next - t_n) + t_next
    now = max(0.0, t_n - gap_ms) + t_one
    return now <= wait


@dataclass
class Prediction:
    """The highest rate (requests/s) whose simulated p99 meets the target, and the step there."""

    rate: float
    at: StepOutcome | None  # the step at ``rate`` (None: no rate met the target)
    floor_p99_ms: float  # the simulated p99 at the lowest rate tried

    def to_dict(self) -> dict[str, float | None]:
        return {"rate": self.rate, "p50_ms": self.at.p50_ms if self.at else None,
                "p99_ms": self.at.p99_ms if self.at else None,
                "mean_batch": self.at.mean_batch if self.at else None, "floor_p99_ms": self.floor_p99_ms}  # fmt: skip


def upper_bound(candidate: Candidate, curve: ServiceCurve, workload: Workload) -> float:
    """A rate (requests/s) no configuration of these costs can serve: the instances' and the cores' limits."""
    maxb = min(candidate.max_batch_size, curve.largest)
    compute = (1 if workload.cuda else candidate.instances) * maxb * 1000.0 / curve.mean(maxb)
    per_request = workload.frontend_ms + workload.decode_ms + workload.client_ms
    thread_cores = 0 if workload.cuda else (candidate.threads or workload.cores)
    cpu = workload.cores * 1000.0 / (per_request + thread_cores * curve.mean(maxb) / maxb)
    return min(compute, cpu)


def predict(sim: Simulator, target_p99_ms: float, *, tolerance: float = 0.01) -> Prediction:
    """Bisect the rate whose simulated p99 meets ``target_p99_ms`` (within ``tolerance``, relative)."""
    high = 1.2 * upper_bound(sim.candidate, sim.curve, sim.workload)
    low_rate = max(0.05, high / 500)
    first = sim.step(low_rate)
    if not first.meets(target_p99_ms):
        return Prediction(0.0, None, first.p99_ms)
    best, low = first, low_rate
    top = sim.step(high)
    if top.meets(target_p99_ms):
        return Prediction(high, top, first.p99_ms)
    while (high - low) / low > tolerance:
        mid = math.sqrt(low * high) if high / low > 4 else (low + high) / 2
        outcome = sim.step(mid)
        if outcome.meets(target_p99_ms):
            best, low = outcome, mid
        else:
            high = mid
    return Prediction(low, best, first.p99_ms)
