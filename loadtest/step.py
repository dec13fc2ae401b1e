"""One load-test step across every worker process: split the load, start together, merge exactly, read the server.

The step's clients (closed loop) or rate (open loop) are shared out over the processes; Poisson arrivals stay
Poisson (a sum of independent Poisson streams is one at the summed rate) and constant arrivals interleave into one
evenly spaced schedule. The parts' histograms are added bucket by bucket, never their percentiles averaged. With
several models (``StepBounds.mix``) each part's per-model tallies are added model by model, and the requests every
part sent are merged into one sequence by send time (the processes share the step's wall-clock start).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loadtest import mix as mixes
from loadtest.histogram import LatencyHistogram
from loadtest.mix import ModelMix, ModelTally
from loadtest.pool import WorkerPool
from loadtest.runner import PartPlan, PartResult
from loadtest.scrape import Sample, scrape, server_split

PERCENTILES = (50, 90, 95, 99, 99.9)
START_DELAY_S = 0.3  # plans reach every process before the common start
CLIENT_CPU_LIMIT = 0.9  # a load process busier than this share of a core may be what set the pace


@dataclass(frozen=True)
class StepSpec:
    mode: str
    concurrency: int = 0
    rate: float = 0.0
    arrival: str = "poisson"

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.mode == "closed" else f"{self.rate:g}/s {self.arrival}"

    @property
    def key(self) -> str:
        return f"closed:{self.concurrency}" if self.mode == "closed" else f"open:{self.rate:g}:{self.arrival}"


@dataclass(frozen=True)
class StepBounds:
    url: str
    warmup_s: float
    duration_s: float
    drain_s: float
    timeout_s: float
    max_requests: int
    max_send_lag_ms: float = 10.0
    max_inflight: int = 1024
    seed: int = 0
    grpc_target: str = ""  # host:port: the load goes over gRPC (the url still serves /metrics)
    # Read the server's /metrics at the window's edges for the server-side split (off: nothing but the load
    # touches the server while it is measured, as metrics on/off comparisons need).
    scrape: bool = True
    mix: ModelMix | None = None  # several models, each request's drawn by popularity (None: the one model)
    keep_sequence: bool = False  # with a mix: keep every request's model in send order (StepResult.sequence)
    keep_answers: int = 0  # keep the bodies of up to this many measured answers (StepResult.answers), all processes


@dataclass
class StepResult:
    spec: StepSpec
    duration_s: float
    processes: int
    measured: int = 0
    requests: int = 0
    images: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    send_lag: LatencyHistogram = field(default_factory=LatencyHistogram)
    client_cpu: float = 0.0  # the busiest load process's share of one core
    client_limited: list[str] = field(default_factory=list)
    server: dict[str, Any] | None = None
    timeline: list[tuple[float, float, bool]] = field(default_factory=list)
    mix: ModelMix | None = None
    models: list[ModelTally] = field(default_factory=list)  # with a mix: per model, in its order
    cold_observed: bool = True  # False over gRPC: no Server-Timing, so no cold start can be seen
    sent: int = 0  # requests put on the wire, warm-up included
    sequence: list[int] = field(default_factory=list)  # with keep_sequence: each sent request's model, in send order
    answers: list[tuple[tuple[str, ...], bytes]] = field(default_factory=list)  # with keep_answers: (names, body)
    check: dict[str, Any] | None = None  # the answer check's summary, where one was made (loadtest.answers)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.duration_s if self.duration_s else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.duration_s if self.duration_s else 0.0

    def latency_ms(self, q: float) -> float:
        return 1000 * self.latency.quantile(q / 100)

    def summary(self) -> dict[str, Any]:
        lat: dict[str, float] = {f"p{q:g}": self.latency_ms(q) for q in PERCENTILES}
        lat["max"] = 1000 * self.latency.max_s if self.latency.count else math.nan
        lat["mean"] = 1000 * self.latency.mean_s
        mix: dict[str, Any] = {}  # with a mix: sent, the models object, cold_starts, answered and hit_rate
        if self.mix is not None:
            mix = {"sent": self.sent} | mixes.summary(self.mix, self.models, cold_observed=self.cold_observed)
        return {
            "step": self.spec.label, "key": self.spec.key, "mode": self.spec.mode,
            "concurrency": self.spec.concurrency, "rate": self.spec.rate, "arrival": self.spec.arrival,
            "duration_s": self.duration_s, "processes": self.processes, "measured": self.measured,
            "requests": self.requests, "images": self.images, "errors": self.errors,
            "requests_per_s": self.requests_per_s, "images_per_s": self.images_per_s, "latency_ms": lat,
            "send_lag_ms": {"p50": 1000 * self.send_lag.quantile(0.5), "p99": 1000 * self.send_lag.quantile(0.99),
                            "max": 1000 * self.send_lag.max_s} if self.send_lag.count else None,
            "client_cpu": self.client_cpu, "client_limited": self.client_limited, "server": self.server,
            "histogram": self.latency.to_dict(), "answers": self.check,
        } | mix  # fmt: skip


def plans_for(spec: StepSpec, bounds: StepBounds, processes: int, start_wall: float) -> list[PartPlan]:
    """Share the step out: clients or rate, and the request bound, as evenly as integers allow."""
    plans = []
    for k in range(processes):
        share: dict[str, Any] = {"concurrency": spec.concurrency // processes + (k < spec.concurrency % processes)}
        if spec.mode == "open":
            share = {"rate": spec.rate / processes, "phase_s": k / spec.rate if spec.rate else 0.0}
        plans.append(PartPlan(
            url=bounds.url, mode=spec.mode, start_wall=start_wall, warmup_s=bounds.warmup_s,
            duration_s=bounds.duration_s, drain_s=bounds.drain_s, timeout_s=bounds.timeout_s,
            max_requests=bounds.max_requests // processes + (k < bounds.max_requests % processes),
            arrival=spec.arrival, seed=bounds.seed * 1000 + k, max_inflight=bounds.max_inflight,
            grpc_target=bounds.grpc_target, process=k, mix=bounds.mix.cumulative if bounds.mix else (),
            keep_sequence=bounds.keep_sequence and bounds.mix is not None,
            keep_answers=-(-bounds.keep_answers // processes), **share,
        ))  # fmt: skip
    return plans


def merge(spec: StepSpec, bounds: StepBounds, parts: list[PartResult]) -> StepResult:
    result = StepResult(spec, bounds.duration_s, len(parts))
    errors: Counter[str] = Counter()
    for p in parts:
        for name in ("measured", "requests", "images", "sent", "timeline", "answers"):  # counts, and lists
            setattr(result, name, getattr(result, name) + getattr(p, name))
        errors.update(p.errors)
        result.latency.merge(p.latency)
        result.send_lag.merge(p.send_lag)
    result.errors = dict(errors)
    if bounds.mix is not None:
        result.mix, result.cold_observed = bounds.mix, not bounds.grpc_target
        result.models = mixes.merged([p.models for p in parts], len(bounds.mix.names))
        if bounds.keep_sequence:
            at = np.concatenate([np.frombuffer(p.sent_at, dtype=np.float64) for p in parts])
            models = np.concatenate([np.frombuffer(p.sent_model, dtype=np.uint32) for p in parts])
            result.sequence = models[np.argsort(at, kind="stable")].tolist()
    # Answers still arriving after the window (an overloaded server in open loop) stretch the span they took.
    result.duration_s = max([bounds.duration_s, *(p.last_done_s for p in parts)])
    result.client_cpu = max((p.cpu_s / p.wall_s for p in parts if p.wall_s > 0), default=0.0)
    result.timeline.sort()
    lag_p99_ms = 1000 * result.send_lag.quantile(0.99) if result.send_lag.count else 0.0
    result.client_limited = client_limits(lag_p99_ms, bounds.max_send_lag_ms, result.client_cpu)
    return result


def client_limits(send_lag_p99_ms: float, max_send_lag_ms: float, cpu: float, who: str = "a load process") -> list[str]:
    """Why the client, not the server, may have set the pace (its send lag, or ``who`` was busy: ``cpu`` is its
    share of a core); empty if not."""
    found = []
    if send_lag_p99_ms > max_send_lag_ms:
        found.append(f"send lag p99 {send_lag_p99_ms:.1f} ms > {max_send_lag_ms:g} ms")
    if cpu > CLIENT_CPU_LIMIT:
        found.append(f"{who} used {100 * cpu:.0f}% of a core")
    return found


def run_step(pool: WorkerPool, spec: StepSpec, bounds: StepBounds, model: str, progress: Any = None) -> StepResult:
    """Run one step on every process of ``pool``; ``progress`` (a rich Progress, optional) shows it live. ``model``
    names what the server's split is read for (with a mix, every model of it)."""
    start_wall = time.time() + START_DELAY_S
    scrapes: dict[str, Sample | None] = {}

    def read_server() -> None:
        for name, at in (("before", bounds.warmup_s), ("after", bounds.warmup_s + bounds.duration_s)):
            time.sleep(max(0.0, start_wall + at - time.time()))
            scrapes[name] = scrape(bounds.url, bounds.mix.names if bounds.mix else model)

    reader = threading.Thread(target=read_server, daemon=True)
    if bounds.scrape:
        reader.start()
    done_before = pool.completed()
    pool.start(plans_for(spec, bounds, len(pool), start_wall))
    total = bounds.warmup_s + bounds.duration_s
    task = progress.add_task(spec.label, total=total, answers=0) if progress is not None else None
    while not pool.done(0.1):
        if task is not None:
            elapsed = min(total, max(0.0, time.time() - start_wall))
            progress.update(task, completed=elapsed, answers=pool.completed() - done_before)
    parts = pool.results()
    if task is not None:
        progress.update(task, completed=total, answers=pool.completed() - done_before)
    if bounds.scrape:
        reader.join(10)
    result = merge(spec, bounds, parts)
    result.server = server_split(scrapes.get("before"), scrapes.get("after"))
    return result
