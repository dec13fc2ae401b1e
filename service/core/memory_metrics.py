"""The metrics of many models per device (``service/engine/ondemand.py``): what is resident and what it costs, the
budget, loads, evictions, hits and misses, and how long requests waited for a load. Read at scrape time from
plain counts the engine keeps (a Prometheus call per request costs throughput: docs/performance.md)."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from service.core.metrics import ScrapeCollector, le_buckets

# A cold start is a load: 10 ms to about 3 minutes.
COLD_START_BUCKETS = tuple(round(0.01 * 1.5**k, 4) for k in range(25))
# The counters, by the snapshot's key, with their labels (a snapshot's key per value: a tuple of them, or the model).
COUNTERS = (
    ("loads", "visionserve_model_loads", "Model loads, by reason (startup, on_demand, explicit)", ("model", "reason")),
    ("evictions", "visionserve_model_evictions", "Models taken out of memory, by reason (lru, unload)",
     ("model", "reason")),
    ("hits", "visionserve_model_residency_hits", "Requests that found their model resident", ("model",)),
    ("misses", "visionserve_model_residency_misses", "Requests that waited for their model's load", ("model",)),
)  # fmt: skip


class ResidencyCollector(ScrapeCollector):
    """``snapshot()`` gives the engine's residency numbers (cold starts since the last call); this folds the cold
    starts into a cumulative histogram per model."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot
        self._cold: dict[str, list[float]] = {}  # model -> [bucket counts..., sum]
        self._lock = threading.Lock()  # two scrapes at once (each on a thread of its own) take turns

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snap = self.snapshot()
            cold = self._cold_starts(snap["cold_starts"])
        per_model = GaugeMetricFamily("visionserve_model_resident_bytes", "Memory charged to a resident model on "
                                      "its device (measured at load)", labels=("model", "device"))  # fmt: skip
        for model, device, size in snap["resident"]:
            per_model.add_metric([model, device], size)
        used = GaugeMetricFamily("visionserve_device_resident_bytes", "Memory charged to the resident models, per "
                                 "device", labels=("device",))  # fmt: skip
        budget = GaugeMetricFamily("visionserve_memory_budget_bytes", "The memory budget for models, per device",
                                   labels=("device",))  # fmt: skip
        for device, charged, limit in snap["devices"]:
            used.add_metric([device], charged)
            budget.add_metric([device], limit)
        yield from (per_model, used, budget)
        for key, name, text, labels in COUNTERS:
            counter = CounterMetricFamily(name, text, labels=labels)
            for values, value in sorted(snap[key].items()):
                counter.add_metric(list(values) if isinstance(values, tuple) else [values], value)
            yield counter
        yield cold

    def _cold_starts(self, samples: list[tuple[str, float]]) -> Metric:
        for model, seconds in samples:
            counts = self._cold.setdefault(model, [0.0] * (len(COLD_START_BUCKETS) + 2))
            counts[bisect.bisect_left(COLD_START_BUCKETS, seconds)] += 1
            counts[-1] += seconds
        family = HistogramMetricFamily("visionserve_cold_start_duration_seconds", "How long a request waited for "
                                       "its model's load (on-demand models)", labels=("model",))  # fmt: skip
        for model, counts in sorted(self._cold.items()):
            family.add_metric([model], le_buckets(counts[:-1], COLD_START_BUCKETS), counts[-1])
        return family
