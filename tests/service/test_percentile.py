"""The one percentile (service/core/percentile.py): nearest rank, the ceil(q * n)-th smallest, a value that was seen."""

from __future__ import annotations

import math

from service.core.percentile import percentile


def test_the_nearest_rank_is_the_ceiling_of_q_times_n() -> None:
    hundred = [float(v) for v in range(100, 0, -1)]  # order does not matter
    assert [percentile(hundred, q) for q in (0.0, 0.01, 0.5, 0.9, 0.99, 1.0)] == [1, 1, 50, 90, 99, 100]
    # 0.99 of 150 is rank 148.5: the 149th (rounding half to even took the 148th in the load tester's old copy)
    assert percentile([float(v) for v in range(1, 151)], 0.99) == 149
    assert percentile([7.0], 0.99) == 7.0


def test_no_values_have_no_percentile() -> None:
    assert math.isnan(percentile([], 0.5))
