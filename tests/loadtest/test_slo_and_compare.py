"""The p99-target search and the baseline comparison, on step results with known numbers."""

from __future__ import annotations

import copy

import pytest

from loadtest.report import compare
from loadtest.slo import search
from loadtest.step import StepResult, StepSpec


def step_at(rate: float, p99_ms: float, errors: int = 0) -> StepResult:
    s = StepResult(StepSpec("open", rate=rate), duration_s=10.0, processes=1)
    s.requests = s.measured = int(rate * 10)
    s.latency.record_many([p99_ms / 1000] * s.requests)
    if errors:
        s.errors = {"503": errors}
    return s


def test_the_search_brackets_the_knee_and_reports_its_bounds() -> None:
    tried: list[float] = []

    def run(rate: float) -> StepResult:  # p99 grows with load and passes 100 ms at 437.5 req/s
        tried.append(rate)
        return step_at(rate, 20 + rate * (80 / 437.5))

    result = search(run, 100.0, start_rate=10, max_steps=20, precision=0.02)
    assert result.passed is not None and result.failed is not None
    assert result.passed.spec.rate <= 437.5 < result.failed.spec.rate
    assert (result.failed.spec.rate - result.passed.spec.rate) / result.passed.spec.rate <= 0.02
    assert tried[:7] == [10, 20, 40, 80, 160, 320, 640]  # doubling until the first failure
    assert result.best_rate == result.passed.spec.rate


def test_errors_fail_a_step_even_under_the_latency_target() -> None:
    result = search(lambda r: step_at(r, 5.0, errors=1 if r > 100 else 0), 50.0, start_rate=25, max_steps=12)
    assert result.best_rate is not None and 100 - 5 <= result.best_rate <= 100
    assert result.failed is not None and result.failed.error_count == 1


def test_a_target_nothing_meets_gives_no_rate_and_stops() -> None:
    result = search(lambda r: step_at(r, 500.0), 10.0, start_rate=100, max_steps=5)
    assert result.best_rate is None and len(result.steps) == 5


def report_of(*steps: StepResult) -> dict:  # type: ignore[type-arg]
    return {"steps": [s.summary() for s in steps], "slo": None}


def test_compare_flags_throughput_falls_and_p99_rises_beyond_the_tolerance() -> None:
    base = report_of(step_at(100, 20.0), step_at(200, 40.0))
    same, regressed = compare(copy.deepcopy(base), base, 0.10)
    assert not regressed and [r["regression"] for r in same] == [False, False]
    slower = report_of(step_at(100, 23.0), step_at(200, 41.0))  # +15% and +2.5% p99
    rows, regressed = compare(slower, base, 0.10)
    assert regressed and [r["regression"] for r in rows] == [True, False]
    assert rows[0]["p99_ratio"] == pytest.approx(23 / 20, rel=0.01)
    fewer = report_of(step_at(100, 20.0))
    fewer["steps"][0]["requests_per_s"] *= 0.8
    assert compare(fewer, base, 0.10)[1] and not compare(fewer, base, 0.25)[1]
    erring = report_of(step_at(100, 20.0, errors=3))
    assert compare(erring, base, 0.5)[0][0]["new_errors"]


def test_a_failure_the_generator_caused_is_tried_again_before_it_bounds_the_answer() -> None:
    calls: list[float] = []

    def run(rate: float) -> StepResult:
        calls.append(rate)
        if rate == 40 and calls.count(40) == 1:  # a client stall the first time only
            s = step_at(rate, 300.0)
            s.client_limited = ["send lag p99 42.6 ms > 10 ms"]
            return s
        return step_at(rate, 10.0 if rate <= 160 else 500.0)

    result = search(run, 100.0, start_rate=10, max_steps=20)
    assert calls[:5] == [10, 20, 40, 40, 80]
    assert result.best_rate is not None and 155 <= result.best_rate <= 160
    assert result.failed is not None and not result.failed.client_limited
