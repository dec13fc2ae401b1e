"""The one percentile every figure the project prints is read with (the load tester, the benchmarks, ``classify``'s
summary): the nearest rank, ``ceil(q * n)``-th smallest of ``n`` values (Hyndman and Fan's definition 1, what
"the p99 of 100 requests is the 99th slowest" means). No interpolation: a percentile is a value that was seen."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
