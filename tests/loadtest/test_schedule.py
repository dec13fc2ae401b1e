"""Open-loop schedules: constant spacing interleaves exactly across processes; Poisson has the asked-for rate."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from loadtest.runner import schedule
from loadtest.step import StepBounds, StepSpec, plans_for

BOUNDS = StepBounds(url="http://127.0.0.1:1", warmup_s=0, duration_s=10, drain_s=1, timeout_s=5, max_requests=1001)


def test_constant_arrivals_shared_over_processes_make_one_evenly_spaced_schedule() -> None:
    plans = plans_for(StepSpec("open", rate=300, arrival="constant"), BOUNDS, 4, 0.0)
    times = sorted(t for p in plans for t in itertools.takewhile(lambda t: t < 2.0, schedule(p)))
    assert len(times) == 600
    assert np.allclose(np.diff(times), 1 / 300)
    assert sum(p.max_requests for p in plans) == 1001


def test_poisson_arrivals_have_the_rate_and_exponential_gaps() -> None:
    plans = plans_for(StepSpec("open", rate=500, arrival="poisson"), BOUNDS, 2, 0.0)
    times = np.sort([t for p in plans for t in itertools.takewhile(lambda t: t < 20.0, schedule(p))])
    assert len(times) / 20.0 == pytest.approx(500, rel=0.03)
    gaps = np.diff(times)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential: coefficient of variation 1
    assert len({p.seed for p in plans}) == 2  # the processes' streams are independent


def test_closed_clients_are_shared_out_without_losing_any() -> None:
    plans = plans_for(StepSpec("closed", concurrency=7), BOUNDS, 3, 0.0)
    assert [p.concurrency for p in plans] == [3, 2, 2]


def test_a_step_whose_generator_fell_behind_is_flagged_and_says_why() -> None:
    from loadtest.runner import PartResult
    from loadtest.step import merge

    spec = StepSpec("open", rate=100)
    on_time, late = PartResult(wall_s=10.0, cpu_s=1.0), PartResult(wall_s=10.0, cpu_s=1.0)
    on_time.send_lag.record_many([0.001] * 1000)
    late.send_lag.record_many([0.001] * 950 + [0.050] * 50)  # 2.5% of all sends 50 ms late: the p99 is late
    assert merge(spec, BOUNDS, [on_time]).client_limited == []
    flagged = merge(spec, BOUNDS, [on_time, late]).client_limited
    assert len(flagged) == 1 and flagged[0].startswith("send lag p99")
    busy = PartResult(wall_s=10.0, cpu_s=9.6)
    assert merge(spec, BOUNDS, [busy]).client_limited == ["a load process used 96% of a core"]
