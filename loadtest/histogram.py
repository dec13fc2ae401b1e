"""A latency histogram with fixed log-spaced buckets: bounded memory, bounded relative error, exact merging.

Buckets grow by a factor of ``1 + 2 * RELATIVE_ERROR`` from 1 µs to 1,000 s, and a value is reported as the
geometric middle of its bucket, so a percentile read from the histogram is within ``RELATIVE_ERROR`` (0.1%) of a
recorded value at that rank. Every process of a load test records into its own histogram; adding the bucket counts
gives exactly the histogram one process would have recorded for all the requests (percentiles are never averaged).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np

RELATIVE_ERROR = 0.001
LOWEST_S = 1e-6
HIGHEST_S = 1e3
_GROWTH = 1 + 2 * RELATIVE_ERROR
_LOG_GROWTH = math.log(_GROWTH)
BUCKETS = math.ceil(math.log(HIGHEST_S / LOWEST_S) / _LOG_GROWTH) + 1


class LatencyHistogram:
    """Counts of latencies in seconds; ``min``, ``max``, ``sum`` and ``count`` are kept exactly."""

    def __init__(self) -> None:
        self.counts = np.zeros(BUCKETS, dtype=np.int64)
        self.count = 0
        self.sum_s = 0.0
        self.min_s = math.inf
        self.max_s = 0.0

    @staticmethod
    def bucket(value_s: float) -> int:
        return 0 if value_s <= LOWEST_S else min(BUCKETS - 1, int(math.log(value_s / LOWEST_S) / _LOG_GROWTH) + 1)

    def record(self, value_s: float) -> None:
        self.counts[self.bucket(value_s)] += 1
        self.count += 1
        self.sum_s += value_s
        self.min_s = min(self.min_s, value_s)
        self.max_s = max(self.max_s, value_s)

    def record_many(self, values_s: Iterable[float]) -> None:
        for v in values_s:
            self.record(v)

    def merge(self, other: LatencyHistogram) -> None:
        self.counts += other.counts
        self.count += other.count
        self.sum_s += other.sum_s
        self.min_s = min(self.min_s, other.min_s)
        self.max_s = max(self.max_s, other.max_s)

    @staticmethod
    def _value(index: int) -> float:
        if index == 0:
            return LOWEST_S
        lower = LOWEST_S * _GROWTH ** (index - 1)
        return lower * math.sqrt(_GROWTH)  # the geometric middle of [lower, lower * growth)

    def quantile(self, q: float) -> float:
        """The value at quantile ``q`` (0..1) in seconds, NaN when empty; q = 1 is the exact maximum."""
        if self.count == 0:
            return math.nan
        if q >= 1:
            return self.max_s
        if q <= 0:
            return self.min_s
        rank = max(1, math.ceil(q * self.count))  # nearest rank, as HdrHistogram and wrk report
        index = int(np.searchsorted(np.cumsum(self.counts), rank))
        return min(max(self._value(index), self.min_s), self.max_s)

    @property
    def mean_s(self) -> float:
        return self.sum_s / self.count if self.count else math.nan

    def points(self) -> tuple[np.ndarray, np.ndarray]:
        """(bucket values in seconds, counts) of the non-empty buckets, for drawing the distribution."""
        nonzero = np.flatnonzero(self.counts)
        return np.array([self._value(int(i)) for i in nonzero]), self.counts[nonzero]

    def to_dict(self) -> dict[str, Any]:
        nonzero = np.flatnonzero(self.counts)
        return {
            "relative_error": RELATIVE_ERROR,
            "count": self.count,
            "sum_s": self.sum_s,
            "min_s": self.min_s if self.count else None,
            "max_s": self.max_s,
            "buckets": {str(int(i)): int(self.counts[i]) for i in nonzero},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LatencyHistogram:
        h = cls()
        for index, n in data["buckets"].items():
            h.counts[int(index)] = n
        h.count = int(data["count"])
        h.sum_s = float(data["sum_s"])
        h.min_s = math.inf if data["min_s"] is None else float(data["min_s"])
        h.max_s = float(data["max_s"])
        return h
