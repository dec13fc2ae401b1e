"""The load tester against a server whose answers are known in advance: does it report what the schedule implies?

The open loop must charge a stall to every request scheduled during it (latency from the *scheduled* send), where
a closed loop sees the stall once; every run must stop within its bounds, counting what was never answered.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from loadtest.inputs import payloads
from loadtest.pool import WorkerPool
from loadtest.step import StepBounds, StepSpec, run_step
from tests.conftest import encode_image, random_image
from tests.loadtest.conftest import TimedServer

RATE = 100
DURATION_S = 2.0
DELAY_S = 0.02
STALL = (0.8, 1.3)
TOLERANCE_MS = 15  # the client's and the test server's own overheads on a shared 2-core machine
# The open-loop test sizes its tolerance and its send-lag limit from a stall-free step on the same server and pool
# (CALIBRATED times what it measured, TOLERANCE_MS at least): a fixed 15 ms was this machine's figure, and a machine
# twice as slow pays twice the overheads on every request.
CALIBRATED = 3
# ...plus a share of the figure itself for the stalled requests: when the stall ends, some 50 requests are answered
# at once by a thread each, and the client reads them one after another on the same two cores (CI saw p90 338 ms
# against 320). Coordinated omission, the fault these tests catch, would put p90 near 20 ms: far outside either.
TOLERANCE_REL = 0.1


def implied_latencies_ms() -> np.ndarray:
    """What each request of a constant 100/s schedule must see: 20 ms, or the rest of the stall plus 20 ms."""
    sent = np.arange(int(RATE * DURATION_S)) / RATE
    waiting = np.where((sent >= STALL[0]) & (sent < STALL[1]), STALL[1] - sent, 0.0)
    return 1000 * (waiting + DELAY_S)


def nearest_rank(values: np.ndarray, q: float) -> float:
    return float(np.sort(values)[int(np.ceil(q / 100 * len(values))) - 1])


def bounds(url: str, **kw: float) -> StepBounds:
    base = {"warmup_s": 0.0, "duration_s": DURATION_S, "drain_s": 3.0, "timeout_s": 10.0, "max_requests": 10_000}
    return StepBounds(url=url, **(base | kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bodies() -> list:  # type: ignore[type-arg]
    return payloads("m", [encode_image(random_image(32, 32), "JPEG")])


@pytest.mark.parametrize("processes", [1, 2])
def test_open_loop_latency_runs_from_the_schedule_through_a_stall(
    timed_server: TimedServer,
    bodies: list,
    processes: int,  # type: ignore[type-arg]
) -> None:
    timed_server.timing.delay_s = DELAY_S
    spec = StepSpec("open", rate=RATE, arrival="constant")
    expected = implied_latencies_ms()
    with WorkerPool(processes, bodies) as pool:
        # The same schedule without the stall: what this client and server add to each answer here, and how late
        # this client sends, with nothing else in the way.
        calibration = run_step(pool, spec, bounds(timed_server.url, max_send_lag_ms=float("inf")), "m")
        assert calibration.errors == {} and calibration.requests == len(expected), calibration.errors
        overhead_ms = calibration.latency_ms(99) - DELAY_S * 1000
        lag_ms = 1000 * calibration.send_lag.quantile(0.99)
        tolerance_ms = max(TOLERANCE_MS, CALIBRATED * overhead_ms)
        # Flagged client-limited only past the lag these latencies tolerate anyway (a full suite on 2 cores once
        # lagged 12.3 ms at p99 against the default 10 ms, every latency still within tolerance).
        lag_limit_ms = max(TOLERANCE_MS, CALIBRATED * lag_ms)
        print(f"\ncalibration: p99 overhead {overhead_ms:.1f} ms, send lag p99 {lag_ms:.1f} ms: tolerance "
              f"{tolerance_ms:.1f} ms, send-lag limit {lag_limit_ms:.1f} ms")  # fmt: skip
        # Coordinated omission, the fault this test catches, would put p90 at DELAY_S (the stall seen once) instead
        # of about 320 ms: a tolerance that reached half that gap could no longer tell them apart.
        assert tolerance_ms < (nearest_rank(expected, 90) - DELAY_S * 1000) / 2, "this client cannot measure a stall"
        timed_server.timing.origin = None  # the stall counts from the measured step's first request
        timed_server.timing.stall_start_s, timed_server.timing.stall_end_s = STALL
        step = run_step(pool, spec, bounds(timed_server.url, max_send_lag_ms=lag_limit_ms), "m")
    assert step.measured == len(expected) and step.requests == len(expected), step.errors
    assert step.errors == {}
    for q in (50, 90, 99):  # not 75: 25% of the schedule stalls, so p75 sits on the jump and one request moves it
        assert step.latency_ms(q) == pytest.approx(nearest_rank(expected, q), abs=tolerance_ms, rel=TOLERANCE_REL), q
    assert 1000 * step.latency.max_s == pytest.approx(expected.max(), abs=tolerance_ms, rel=TOLERANCE_REL)
    assert step.server is None  # this server has no /metrics; the report must say so rather than invent a split
    assert step.send_lag.count == len(expected) and not step.client_limited


def test_a_closed_loop_sees_the_same_stall_only_once(timed_server: TimedServer, bodies: list) -> None:  # type: ignore[type-arg]
    timed_server.timing.delay_s = DELAY_S
    timed_server.timing.stall_start_s, timed_server.timing.stall_end_s = STALL
    with WorkerPool(1, bodies) as pool:
        step = run_step(pool, StepSpec("closed", concurrency=1), bounds(timed_server.url), "m")
    # The one client waited out the stall on one request and sent nothing meanwhile: the tail the open loop
    # reports (p90 about 320 ms) disappears here. This is the coordinated omission the open loop avoids.
    assert step.latency_ms(90) < DELAY_S * 1000 + TOLERANCE_MS
    assert step.latency.max_s * 1000 == pytest.approx(1000 * (STALL[1] - STALL[0]), abs=3 * TOLERANCE_MS + 20)


def test_a_server_that_never_answers_cannot_hold_the_run_past_its_bounds(
    timed_server: TimedServer,
    bodies: list,  # type: ignore[type-arg]
) -> None:
    timed_server.timing.stall_start_s, timed_server.timing.stall_end_s = 0.0, 1_000.0
    b = bounds(timed_server.url, duration_s=1.0, drain_s=0.5, warmup_s=0.5)
    with WorkerPool(1, bodies) as pool:
        started = time.monotonic()
        step = run_step(pool, StepSpec("open", rate=50, arrival="constant"), b, "m")
        took = time.monotonic() - started
    assert took < b.warmup_s + b.duration_s + b.drain_s + 2.0
    assert step.requests == 0
    assert step.measured == 50 and step.errors == {"unfinished": 50}  # counted, not silently left out
    assert np.isnan(step.latency_ms(99))


def test_max_requests_bounds_a_closed_step(timed_server: TimedServer, bodies: list) -> None:  # type: ignore[type-arg]
    timed_server.timing.delay_s = 0.001
    with WorkerPool(2, bodies) as pool:
        step = run_step(pool, StepSpec("closed", concurrency=4), bounds(timed_server.url, max_requests=9), "m")
    assert step.requests == 9 and len(timed_server.arrivals) == 9


def test_timeouts_and_refused_connections_are_errors_by_kind(timed_server: TimedServer, bodies: list) -> None:  # type: ignore[type-arg]
    timed_server.timing.delay_s = 2.0
    with WorkerPool(1, bodies) as pool:
        slow = run_step(pool, StepSpec("open", rate=10, arrival="constant"),
                        bounds(timed_server.url, duration_s=1.0, timeout_s=0.3), "m")  # fmt: skip
        refused = run_step(pool, StepSpec("closed", concurrency=1),
                           bounds("http://127.0.0.1:9", duration_s=0.5), "m")  # fmt: skip
    assert slow.errors == {"timeout": 10} and slow.requests == 0
    assert set(refused.errors) == {"connection"} and refused.requests == 0


@pytest.mark.parametrize("scrape", [True, False])
def test_a_step_reads_metrics_at_its_edges_only_when_asked(
    timed_server: TimedServer,
    bodies: list,
    scrape: bool,  # type: ignore[type-arg]
) -> None:
    timed_server.timing.delay_s = 0.005
    with WorkerPool(1, bodies) as pool:
        step = run_step(pool, StepSpec("closed", concurrency=2), bounds(timed_server.url, duration_s=0.5,
                                                                        scrape=scrape), "m")  # fmt: skip
    assert step.requests > 0 and step.errors == {}
    assert timed_server.gets == (["/metrics", "/metrics"] if scrape else [])
    assert step.server is None  # this server has no /metrics: the report goes without the split
