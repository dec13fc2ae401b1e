"""Prometheus metrics: ``GET /metrics``, labels ``model``, ``version``, ``device``.

On the hot path each HTTP request records its outcome and stage durations once, and each batch records its size
and compute time once (never once per image). Queue depth, batches in flight and GPU memory are read when
Prometheus scrapes, so they cost nothing between scrapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from service.batching.batcher import BatchRecord

# From 0.5 ms to about 20 s, each bucket 1.5x the last: fine enough to read a p99 anywhere between 1 ms and 10 s.
DURATION_BUCKETS = tuple(round(0.0005 * 1.5**k, 6) for k in range(27))
OUTCOMES = ("success", "bad_input", "rejected", "timeout", "cancelled", "error")
LABELS = ("model", "version", "device")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Exported only where a GPU is present.
GPU_METRIC_NAMES = (
    "visionserve_gpu_memory_used_bytes",
    "visionserve_gpu_memory_total_bytes",
    "visionserve_gpu_utilization_ratio",
)


def batch_size_buckets(max_batch_size: int = 256) -> tuple[float, ...]:
    sizes = [1]
    while sizes[-1] < max_batch_size:
        sizes.append(sizes[-1] * 2)
    return tuple(float(s) for s in sizes)


class Metrics:
    """Every visionserve metric, in a registry of its own (one per app, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("visionserve_requests", "Requests by outcome", (*LABELS, "outcome"), registry=r)
        self.images = Counter("visionserve_images", "Images computed", LABELS, registry=r)
        self.batches = Counter("visionserve_batches", "Batches computed", LABELS, registry=r)
        self.fallbacks = Counter("visionserve_fallback", "Fallbacks to the CPU, by reason", (*LABELS, "reason"),
                                 registry=r)  # fmt: skip

        def histogram(name: str, text: str) -> Histogram:
            return Histogram(name, text, LABELS, buckets=DURATION_BUCKETS, registry=r)

        self.request_seconds = histogram("visionserve_request_duration_seconds", "Whole request, server side")
        self.queue_seconds = histogram("visionserve_queue_duration_seconds", "Time in the batcher's queue")
        self.preprocess_seconds = histogram("visionserve_preprocess_duration_seconds", "Decode and preprocess")
        self.compute_seconds = histogram("visionserve_compute_duration_seconds", "Batch compute, per batch")
        self.postprocess_seconds = histogram("visionserve_postprocess_duration_seconds", "Encoding the answer")
        self.batch_size = Histogram("visionserve_batch_size", "Images per batch", LABELS,
                                    buckets=batch_size_buckets(), registry=r)  # fmt: skip
        self._live = _LiveCollector()
        r.register(self._live)

    def batch_observer(self, model: str, version: int) -> Callable[[BatchRecord], None]:
        """The batcher's per-batch hook: one record per batch."""
        labels: dict[tuple[str, str, str], tuple[Counter, Counter, Histogram, Histogram]] = {}

        def observe(record: BatchRecord) -> None:
            key = (model, str(version), record.device)
            children = labels.get(key)
            if children is None:
                children = labels[key] = (
                    self.batches.labels(*key), self.images.labels(*key),
                    self.batch_size.labels(*key), self.compute_seconds.labels(*key),
                )  # fmt: skip
            batches, images, sizes, compute = children
            batches.inc()
            images.inc(record.size)
            sizes.observe(record.size)
            compute.observe(record.compute_s)

        return observe

    def fallback_hook(self, model: str, version: int, device: Callable[[], str]) -> Callable[[str], None]:
        def on_fallback(reason: str) -> None:
            self.fallbacks.labels(model, str(version), device(), reason).inc()

        return on_fallback

    def watch(self, source: Callable[[], Iterable[tuple[tuple[str, str, str], int, int]]]) -> None:
        """``source()`` yields ((model, version, device), queue_depth, inflight_batches) at scrape time."""
        self._live.sources.append(source)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LiveCollector(Collector):
    """Gauges read at scrape time: queue depth, batches in flight, GPU memory and utilisation."""

    def __init__(self) -> None:
        self.sources: list[Callable[[], Iterable[tuple[tuple[str, str, str], int, int]]]] = []

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("visionserve_queue_depth", "Images waiting in the queue", labels=LABELS)
        inflight = GaugeMetricFamily("visionserve_inflight_batches", "Batches being computed", labels=LABELS)
        for source in self.sources:
            for labels, queued, running in source():
                depth.add_metric(list(labels), queued)
                inflight.add_metric(list(labels), running)
        yield depth
        yield inflight
        yield from _gpu_metrics()


def _gpu_metrics() -> Iterator[Metric]:
    try:
        import torch

        if not torch.cuda.is_available():
            return
        count = torch.cuda.device_count()
    except Exception:
        return
    used_name, total_name, util_name = GPU_METRIC_NAMES
    used = GaugeMetricFamily(used_name, "GPU memory in use", labels=["device"])
    total = GaugeMetricFamily(total_name, "GPU memory in all", labels=["device"])
    util = GaugeMetricFamily(util_name, "GPU busy fraction (last sample)", labels=["device"])
    for index in range(count):
        name = f"cuda:{index}"
        free, whole = torch.cuda.mem_get_info(index)
        used.add_metric([name], whole - free)
        total.add_metric([name], whole)
        with contextlib.suppress(Exception):  # needs NVML (nvidia-ml-py); memory is still reported
            util.add_metric([name], torch.cuda.utilization(index) / 100.0)
    yield used
    yield total
    yield util
