"""Percentiles from the histogram against known distributions, and exact merging across processes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from loadtest.histogram import RELATIVE_ERROR, LatencyHistogram


def nearest_rank(values: np.ndarray, q: float) -> float:
    ordered = np.sort(values)
    return float(ordered[max(1, math.ceil(q * len(ordered))) - 1])


@pytest.mark.parametrize(
    "draw",
    [
        lambda rng, n: rng.uniform(0.001, 0.050, n),  # 1 to 50 ms
        lambda rng, n: rng.exponential(0.010, n),  # a queue's tail
        lambda rng, n: rng.lognormal(math.log(0.02), 1.0, n),  # heavy tail
        lambda rng, n: np.where(rng.random(n) < 0.99, 0.005, 2.0),  # bimodal: 1% stall at 2 s
    ],
    ids=["uniform", "exponential", "lognormal", "bimodal"],
)
def test_percentiles_match_the_exact_ones_within_the_stated_error(draw) -> None:  # type: ignore[no-untyped-def]
    values = draw(np.random.default_rng(0), 50_000)
    h = LatencyHistogram()
    h.record_many(values.tolist())
    for q in (0.5, 0.9, 0.95, 0.99, 0.999):
        exact = nearest_rank(values, q)
        assert h.quantile(q) == pytest.approx(exact, rel=RELATIVE_ERROR * 1.01), q
    assert h.quantile(1.0) == values.max()
    assert h.quantile(0.0) == values.min()
    assert h.count == len(values)
    assert h.mean_s == pytest.approx(values.mean(), rel=1e-9)


def test_merging_parts_gives_exactly_the_histogram_of_the_whole() -> None:
    rng = np.random.default_rng(1)
    parts = [rng.lognormal(math.log(0.01 * (k + 1)), 0.7, 10_000) for k in range(4)]  # processes see different loads
    whole = LatencyHistogram()
    whole.record_many(np.concatenate(parts).tolist())
    merged = LatencyHistogram()
    for values in parts:
        h = LatencyHistogram()
        h.record_many(values.tolist())
        merged.merge(LatencyHistogram.from_dict(h.to_dict()))  # through the wire format, as results travel
    assert np.array_equal(merged.counts, whole.counts)
    assert (merged.count, merged.min_s, merged.max_s) == (whole.count, whole.min_s, whole.max_s)
    for q in (0.5, 0.99, 0.999):
        assert merged.quantile(q) == whole.quantile(q)
    # Averaging the parts' p99s, what the histogram avoids, would be far off here.
    averaged = np.mean([np.percentile(v, 99) for v in parts])
    assert abs(averaged - whole.quantile(0.99)) > 0.1 * whole.quantile(0.99)


def test_an_empty_histogram_says_nan_not_zero() -> None:
    h = LatencyHistogram()
    assert math.isnan(h.quantile(0.99)) and math.isnan(h.mean_s)
    assert LatencyHistogram.from_dict(h.to_dict()).count == 0


def test_values_beyond_the_range_are_clamped_but_max_is_exact() -> None:
    h = LatencyHistogram()
    h.record_many([1e-9, 5e3])
    assert h.max_s == 5e3 and h.quantile(1.0) == 5e3
    assert h.quantile(0.5) == pytest.approx(1e-9, abs=2e-6)


def test_the_batch_costs_of_a_step_are_the_statistics_difference_and_their_knee_the_policys() -> None:
    """Two reads of a model's statistics (``batch_count|size``, ``batch_compute_ns|size``): each size's compute per
    image during the step, and the knee that ``CostModel.knee`` finds on them (2 ms a batch + 10 ms an image)."""
    from loadtest.scrape import batch_costs
    from service.engine.policy import CostModel

    before = {"batch_count|1": 5.0, "batch_compute_ns|1": 5 * 12e6}
    after = {"batch_count|1": 15.0, "batch_compute_ns|1": 15 * 12e6, "batch_count|8": 4.0,
             "batch_compute_ns|8": 4 * 82e6, "batch_count|32": 0.0, "batch_compute_ns|32": 0.0}  # fmt: skip
    costs = batch_costs({k: v - before.get(k, 0.0) for k, v in after.items()})
    assert costs["sizes"] == {1: {"batches": 10, "ms_per_image": pytest.approx(12.0)},
                              8: {"batches": 4, "ms_per_image": pytest.approx(10.25)}}  # fmt: skip
    assert costs["knee"] == CostModel({1: 0.012, 8: 0.082}).knee(8) == 3  # (2 / n + 10) within 5% of 10.25 ms
    assert batch_costs({"batch_count|4": 3.0, "batch_compute_ns|4": 3e6})["knee"] is None  # one size: no knee
    assert batch_costs({}) == {"sizes": {}, "knee": None}


def test_statistics_that_went_down_are_no_batch_costs() -> None:
    """Behind a proxy the two reads may come from different replicas: a time that fell is left out, and a knee is
    found only on positive costs (CostModel refuses the others rather than failing)."""
    from loadtest.scrape import batch_costs
    from service.core.batchcost import CostModel

    assert batch_costs({"batch_count|1": 3.0, "batch_compute_ns|1": -5e6}) == {"sizes": {}, "knee": None}
    assert CostModel({1: -0.01, 2: -0.03}).knee(2) is None
    assert CostModel({1: 0.0, 2: 0.02}).knee(4) == 2  # zero at 1: only the sizes with a positive cost count
