"""Prometheus metrics: ``GET /metrics``, labels ``model``, ``version``, ``device``.

The hot path appends one tuple per request and one per batch to a list (no locks, no per-metric calls); numpy folds
the lists into counters and histograms every ``FOLD_EVERY`` records and before every scrape, so a scrape sees every
request recorded before it. Queue depth, batches in flight and GPU memory are read at scrape time. Why not
prometheus-client's ``Histogram.observe`` per request (which cost about 3% of throughput): docs/performance.md.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import numpy as np
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from service.core.devices import GpuSample, may_have_gpu, nvml_samples

# From 0.5 ms to about 20 s, each bucket 1.5x the last: fine enough to read a p99 anywhere between 1 ms and 10 s.
DURATION_BUCKETS = tuple(round(0.0005 * 1.5**k, 6) for k in range(27))
OUTCOMES = ("success", "bad_input", "rejected", "timeout", "cancelled", "error")
OUTCOME_INDEX = {name: i for i, name in enumerate(OUTCOMES)}
LABELS = ("model", "version", "device")
REQUEST_LABELS = (*LABELS, "protocol")  # requests also say which protocol carried them (http, grpc)
PROTOCOLS = ("http", "grpc", "stream", "source")  # stream, source: their frames that reached the engine
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FOLD_EVERY = 1024  # records held before folding: bounds the memory, and the fold's cost is spread thin
# Exported only where a GPU is present.
GPU_METRIC_NAMES = (
    "visionserve_gpu_memory_used_bytes",
    "visionserve_gpu_memory_total_bytes",
    "visionserve_gpu_utilization_ratio",
)
# Stage histograms a request records: (name, help), in the order of RequestRecorder.record's arguments.
REQUEST_HISTOGRAMS = (
    ("visionserve_request_duration_seconds", "Whole request, server side"),
    ("visionserve_preprocess_duration_seconds", "Decode and preprocess"),
    ("visionserve_queue_duration_seconds", "Time in the batcher's queue"),
    ("visionserve_postprocess_duration_seconds", "Encoding the answer"),
)
NOT_OBSERVED = math.nan  # a stage the request never reached (no histogram sample)
# Where a request's time went, accept to answer, as contiguous stages that sum to its total (``Timing.stages``):
# one histogram family, ``visionserve_stage_duration_seconds{stage=...}``, recorded for every request answered.
STAGES = (
    "read",  # the request's head and body read (and a v2 body parsed)
    "decode_wait",  # waiting for a decode thread
    "decode",  # decoding and preprocessing the images (or parsing a tensor body)
    "arena",  # back on the event loop, the copy into shared memory and the message to the engine
    "to_engine",  # the transport to the engine, until its loop has queued the images
    "instance_wait",  # queued while every runtime instance was busy
    "batch_wait",  # queued with an instance free, while the batch formed (max_queue_delay_ms)
    "compute",  # the batch on its runtime instance, until the engine's loop has the answer
    "from_engine",  # the answer's transport back, until the front end's loop reads it
    "respond",  # scoring, encoding the answer, until its head is sent
)
STAGE_HISTOGRAM = ("visionserve_stage_duration_seconds", "Where each answered request's time went, by stage")
DETECTIONS_HISTOGRAM = ("visionserve_detections_per_image", "A detector's detections per image, after suppression")
DETECTION_BUCKETS = (0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 50.0, 100.0, 300.0, 1000.0)


@dataclass
class BatchRecord:
    """What the batcher hands its observer once per batch (metrics are recorded per batch, not per image)."""

    size: int
    queue_s: list[float]
    compute_s: float
    device: str
    failed: int


class BucketCounts:
    """One histogram's cumulative state: counts per bucket (``le`` semantics, +Inf last), sum and count."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self.counts = np.zeros(len(bounds) + 1, dtype=np.int64)
        self.sum = 0.0

    def add(self, values: np.ndarray) -> None:
        values = values[~np.isnan(values)]
        if values.size:
            # side="left": a value equal to a bound belongs to that bound's bucket, as Prometheus's le means.
            index = np.searchsorted(self.bounds, values, side="left")
            self.counts += np.bincount(index, minlength=len(self.counts))
            self.sum += float(values.sum())

    def buckets(self) -> list[tuple[str, float]]:
        return le_buckets(self.counts.tolist(), tuple(self.bounds.tolist()))

    def state(self) -> StageState:
        return StageState(self.counts.tolist(), self.sum)


def le_buckets(counts: Sequence[float], bounds: tuple[float, ...] = DURATION_BUCKETS) -> list[tuple[str, float]]:
    """Prometheus's cumulative ``le`` buckets from counts per bucket (+Inf last)."""
    cumulative = np.cumsum(counts)
    edges = [floatToGoString(b) for b in bounds] + ["+Inf"]
    return [(edge, float(n)) for edge, n in zip(edges, cumulative, strict=True)]


class _Folding:
    """Records appended on the hot path, folded in bulk. ``list.append`` and the slice-and-delete in ``fold`` are
    each one step under the GIL, so a record appended from any thread during a fold lands in the next one."""

    def __init__(self) -> None:
        self._pending: list[tuple[float, ...]] = []
        self._fold_lock = threading.Lock()

    def _append(self, record: tuple[float, ...]) -> None:
        pending = self._pending
        pending.append(record)
        if len(pending) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        with self._fold_lock:
            pending = self._pending
            taken = pending[: len(pending)]
            del pending[: len(taken)]
            if taken:
                self._fold(np.asarray(taken, dtype=np.float64))

    def _fold(self, rows: np.ndarray) -> None:
        raise NotImplementedError


class StageState(msgspec.Struct, array_like=True, frozen=True):
    """One histogram's cumulative counts per bucket (+Inf last) and sum."""

    counts: list[int]
    sum: float


class RequestState(msgspec.Struct, frozen=True):
    """One process's cumulative requests for one label set: outcomes and the stage histograms. Cumulative, so a
    repeated report replaces the last one instead of adding to it (what lets front ends report to the engine)."""

    labels: tuple[str, str, str, str]
    outcomes: list[int]
    stages: list[StageState]
    detections: StageState | None = None  # a detector's, per image (DETECTION_BUCKETS)


class ModelCounts(msgspec.Struct):
    """One process's cumulative counts for one model version (the v2 statistics extension): a front end keeps one
    per model version and updates it in place; a copy of it travels in each report to the engine."""

    model: str
    version: int
    success: int = 0
    failure: int = 0
    images: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    preprocess_ns: int = 0
    last_inference_ms: int = 0


def merge_request_states(states: Iterable[RequestState]) -> list[RequestState]:
    """Sum the states of several processes per label set."""
    merged: dict[tuple[str, str, str, str], RequestState] = {}
    for state in states:
        if (seen := merged.get(state.labels)) is not None:
            state = RequestState(
                state.labels,
                [a + b for a, b in zip(seen.outcomes, state.outcomes, strict=True)],
                [_added(x, y) for x, y in zip(seen.stages, state.stages, strict=True)],
                _added(seen.detections, state.detections) if seen.detections and state.detections
                else seen.detections or state.detections,
            )  # fmt: skip
        merged[state.labels] = state
    return list(merged.values())


def _added(x: StageState, y: StageState) -> StageState:
    return StageState([a + b for a, b in zip(x.counts, y.counts, strict=True)], x.sum + y.sum)


class RequestRecorder(_Folding):
    """One model version's requests: an outcome, four durations and the :data:`STAGES` each (one histogram per
    entry of ``stages``: the :data:`REQUEST_HISTOGRAMS` first, then the stages)."""

    def __init__(self, labels: tuple[str, str, str, str]) -> None:
        super().__init__()
        self.labels = labels
        self.outcomes = np.zeros(len(OUTCOMES), dtype=np.int64)
        self.stages = [BucketCounts(DURATION_BUCKETS) for _ in range(len(REQUEST_HISTOGRAMS) + len(STAGES))]
        self.detections: BucketCounts | None = None  # a detector's only

    def record_detections(self, counts: list[int]) -> None:
        """A detector's detections per image of one answered request (on the event loop, once a request)."""
        if self.detections is None:
            self.detections = BucketCounts(DETECTION_BUCKETS)
        self.detections.add(np.asarray(counts, dtype=np.float64))

    def record(
        self,
        outcome: str,
        request_s: float,
        preprocess_s: float,
        queue_s: float,
        postprocess_s: float,
        stages: tuple[float, ...] = (NOT_OBSERVED,) * len(STAGES),
    ) -> None:
        """One request, once, however it ended; ``NOT_OBSERVED`` for a stage it never reached; ``stages``: the
        :data:`STAGES` durations of an answered request."""
        self._append((OUTCOME_INDEX[outcome], request_s, preprocess_s, queue_s, postprocess_s, *stages))

    def _fold(self, rows: np.ndarray) -> None:
        self.outcomes += np.bincount(rows[:, 0].astype(np.int64), minlength=len(OUTCOMES))
        for column, stage in enumerate(self.stages, start=1):
            stage.add(rows[:, column])

    def state(self) -> RequestState:
        """Everything recorded so far, folded (call :meth:`fold` first for the latest records)."""
        detections = None if self.detections is None else self.detections.state()
        return RequestState(self.labels, self.outcomes.tolist(), [stage.state() for stage in self.stages], detections)


class BatchRecorder(_Folding):
    """One model version on one device: batches, images, batch sizes and per-batch compute time."""

    def __init__(self, labels: tuple[str, str, str]) -> None:
        super().__init__()
        self.labels = labels
        self.batches = 0
        self.images = 0
        self.sizes = BucketCounts(tuple(float(2**k) for k in range(9)))  # 1 to 256
        self.compute = BucketCounts(DURATION_BUCKETS)

    def record(self, size: int, compute_s: float) -> None:
        self._append((size, compute_s))

    def _fold(self, rows: np.ndarray) -> None:
        self.batches += len(rows)
        self.images += int(rows[:, 0].sum())
        self.sizes.add(rows[:, 0])
        self.compute.add(rows[:, 1])


class ScrapeCollector(Collector):
    """A collector whose families are read at scrape time: it describes none, so that registering it with a
    registry that auto-describes does not collect at once."""

    def describe(self) -> Iterable[Metric]:
        return []


class LiveState(NamedTuple):
    """A model version's state at scrape time."""

    labels: tuple[str, str, str]  # model, version, device
    queue_depth: int
    inflight_batches: int
    ready: bool
    instances_replaced: int
    backend: str = ""
    precision: str = ""  # fp32, fp16, bf16, int8 (or "int8-ungated")


class Metrics(ScrapeCollector):
    """Every visionserve metric, in a registry of its own (one per app, so tests can run several); itself the
    collector of what the hot path records and of what is read at scrape time (queue depth, batches in flight,
    readiness, stuck instances replaced, GPU memory and utilisation)."""

    def __init__(self, request_states: Callable[[], Iterable[RequestState]] | None = None) -> None:
        """``request_states``: where requests come from when they are recorded elsewhere (the engine renders the
        front ends' reports); by default, this process's own recorders."""
        self.request_states = request_states
        self.registry = CollectorRegistry(auto_describe=True)
        self.fallbacks = Counter("visionserve_fallback", "Fallbacks to the CPU, by reason", (*LABELS, "reason"),
                                 registry=self.registry)  # fmt: skip
        # A version that raised while loading (its reason is in the repository index, its metadata and the log).
        self.load_failures = Counter("visionserve_model_load_failures", "Model versions that failed to load",
                                     ("model", "version"), registry=self.registry)  # fmt: skip
        self._requests: list[RequestRecorder] = []
        self._batches: dict[tuple[str, str, str], BatchRecorder] = {}
        self._lock = threading.Lock()  # guards the recorder tables, not the records
        self._sources: list[Callable[[], Iterable[LiveState]]] = []
        self.registry.register(self)

    def request_recorder(self, model: str, version: int | str, device: str, protocol: str = "http") -> RequestRecorder:
        recorder = RequestRecorder((model, str(version), device, protocol))
        with self._lock:
            self._requests.append(recorder)
        return recorder

    def batch_recorder(self, model: str, version: int, device: str) -> BatchRecorder:
        key = (model, str(version), device)
        with self._lock:
            recorder = self._batches.get(key)
            if recorder is None:
                recorder = self._batches[key] = BatchRecorder(key)
        return recorder

    def batch_observer(self, model: str, version: int) -> Callable[[BatchRecord], None]:
        """The batcher's per-batch hook: one record per batch, under the device that computed it."""
        recorders: dict[str, BatchRecorder] = {}

        def observe(record: BatchRecord) -> None:
            recorder = recorders.get(record.device)
            if recorder is None:
                recorder = recorders[record.device] = self.batch_recorder(model, version, record.device)
            recorder.record(record.size, record.compute_s)

        return observe

    def fallback_hook(self, model: str, version: int, device: Callable[[], str]) -> Callable[[str], None]:
        def on_fallback(reason: str) -> None:
            self.fallbacks.labels(model, str(version), device(), reason).inc()

        return on_fallback

    def watch(self, source: Callable[[], Iterable[LiveState]]) -> None:
        """``source()`` yields a :class:`LiveState` per model version at scrape time."""
        self._sources.append(source)

    def request_snapshot(self) -> list[RequestState]:
        """This process's requests so far (every recorder folded first)."""
        return [r.state() for r in self.recorders()[0]]

    def recorders(self) -> tuple[list[RequestRecorder], list[BatchRecorder]]:
        """Every recorder, each folded first: what they hold is then every record made before this call."""
        with self._lock:
            requests, batches = list(self._requests), list(self._batches.values())
        for recorder in (*requests, *batches):
            recorder.fold()
        return requests, batches

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        own, batches = self.recorders()
        source = self.request_states
        requests = merge_request_states(source() if source is not None else (r.state() for r in own))
        outcomes = CounterMetricFamily(
            "visionserve_requests", "Requests by outcome", labels=(*REQUEST_LABELS, "outcome")
        )
        stages = [HistogramMetricFamily(name, text, labels=REQUEST_LABELS) for name, text in REQUEST_HISTOGRAMS]
        waits = HistogramMetricFamily(*STAGE_HISTOGRAM, labels=(*REQUEST_LABELS, "stage"))
        found = HistogramMetricFamily(*DETECTIONS_HISTOGRAM, labels=REQUEST_LABELS)
        for r in requests:
            if r.detections is not None:
                found.add_metric(list(r.labels), le_buckets(r.detections.counts, DETECTION_BUCKETS), r.detections.sum)
            for name, count in zip(OUTCOMES, r.outcomes, strict=True):
                outcomes.add_metric([*r.labels, name], float(count))
            for family, stage in zip(stages, r.stages, strict=False):
                family.add_metric(list(r.labels), le_buckets(stage.counts), stage.sum)
            for name, stage in zip(STAGES, r.stages[len(REQUEST_HISTOGRAMS) :], strict=True):
                waits.add_metric([*r.labels, name], le_buckets(stage.counts), stage.sum)
        images = CounterMetricFamily("visionserve_images", "Images computed", labels=LABELS)
        batch_count = CounterMetricFamily("visionserve_batches", "Batches computed", labels=LABELS)
        sizes = HistogramMetricFamily("visionserve_batch_size", "Images per batch", labels=LABELS)
        compute = HistogramMetricFamily("visionserve_compute_duration_seconds", "Batch compute, per batch",
                                        labels=LABELS)  # fmt: skip
        for b in batches:
            images.add_metric(list(b.labels), float(b.images))
            batch_count.add_metric(list(b.labels), float(b.batches))
            sizes.add_metric(list(b.labels), b.sizes.buckets(), b.sizes.sum)
            compute.add_metric(list(b.labels), b.compute.buckets(), b.compute.sum)
        yield from (outcomes, images, batch_count, *stages, waits, found, compute, sizes)
        yield from self._live()
        yield from _gpu_metrics()

    def _live(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily("visionserve_queue_depth", "Images waiting in the queue", labels=LABELS)
        inflight = GaugeMetricFamily("visionserve_inflight_batches", "Batches being computed", labels=LABELS)
        ready = GaugeMetricFamily(
            "visionserve_model_ready", "1 while the model serves (READY or DEGRADED), else 0", labels=LABELS
        )
        replaced = CounterMetricFamily(
            "visionserve_instances_replaced", "Runtime instances abandoned as stuck and replaced", labels=LABELS
        )
        # What is served, as labels of a constant 1 (Prometheus's info idiom), so the hot-path series keep their
        # three labels and a dashboard joins on them.
        info = GaugeMetricFamily(
            "visionserve_model_info", "1 per served model version: its runtime and precision",
            labels=(*LABELS, "backend", "precision"),
        )  # fmt: skip
        for source in self._sources:
            for state in source():
                labels = list(state.labels)
                depth.add_metric(labels, state.queue_depth)
                inflight.add_metric(labels, state.inflight_batches)
                ready.add_metric(labels, 1.0 if state.ready else 0.0)
                replaced.add_metric(labels, state.instances_replaced)
                info.add_metric([*labels, state.backend, state.precision], 1.0)
        yield from (depth, inflight, ready, replaced, info)


def _gpu_metrics() -> Iterator[Metric]:
    if not may_have_gpu():  # no device file: nothing to report, and no torch import (~2 s) on the first scrape
        return
    samples = nvml_samples()
    if samples is None:  # no NVML here: torch says what it can (memory; utilisation needs NVML anyway)
        samples = _torch_samples()
    if not samples:
        return
    helps = ("GPU memory in use", "GPU memory in all", "GPU busy fraction (last sample)")
    families = [GaugeMetricFamily(n, h, labels=["device"]) for n, h in zip(GPU_METRIC_NAMES, helps, strict=True)]
    for sample in samples:
        for family, value in zip(families, (sample.used_bytes, sample.total_bytes, sample.utilization), strict=True):
            if value is not None:
                family.add_metric([sample.device], value)
    yield from families


def _torch_samples() -> list[GpuSample]:
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        memory = [torch.cuda.mem_get_info(index) for index in range(torch.cuda.device_count())]
        return [GpuSample(f"cuda:{i}", whole - free, whole, None) for i, (free, whole) in enumerate(memory)]
    except Exception:
        return []
