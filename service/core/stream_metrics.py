"""The metrics of streams (docs/streams.md, "Counting": what each front end reports and the engine sums): per model,
frames by outcome, the answered frames' age as a histogram, and the streams open; and the record every stream,
source and model counts its frames in (:class:`FrameCounts`). No Prometheus call sits on a frame's path."""

from __future__ import annotations

import bisect
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import msgspec
import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from service.core.metrics import ScrapeCollector, le_buckets

log = logging.getLogger(__name__)

# A frame's fate (docs/streams.md): every frame sent gets exactly one.
STREAM_OUTCOMES = ("answered", "superseded", "expired", "error")
# Answered stream frames' age, seconds: 1 ms to about 33 s.
STREAM_AGE_BUCKETS = tuple(round(0.001 * 1.5**k, 6) for k in range(26))
AGES_KEPT = 2048  # the answered ages the percentiles are read from (the newest)


class StreamState(msgspec.Struct, array_like=True, frozen=True):
    """One front end's streams of one model since it started: frames by outcome, the answered frames' ages (a
    count per :data:`STREAM_AGE_BUCKETS` bucket, the count above the last, then the sum in seconds) and the streams
    open now. Cumulative, so a repeated report replaces the last one."""

    model: str
    frames: dict[str, int]
    ages: list[float]
    open: int = 0


def empty_ages() -> list[float]:
    """A model's age histogram before its first answered frame: the buckets, +Inf, the sum."""
    return [0.0] * (len(STREAM_AGE_BUCKETS) + 2)


def age_buckets(ages: list[float]) -> list[tuple[str, float]] | None:
    """An age histogram (:func:`empty_ages`' layout) as /metrics' cumulative buckets; None for one of another length
    (a front end of another build)."""
    return le_buckets(ages[:-1], STREAM_AGE_BUCKETS) if len(ages) == len(STREAM_AGE_BUCKETS) + 2 else None


@dataclass
class FrameCounts:
    """Frames by fate (:data:`STREAM_OUTCOMES`; ``sent``: their sum once the stream has ended) and the answered ones'
    ages, as /metrics' histogram (:func:`empty_ages`' layout) and the newest :data:`AGES_KEPT` in ms for percentiles:
    one stream's or source's, or a model's in this front end (with its streams ``open`` now)."""

    sent: int = 0
    answered: int = 0
    superseded: int = 0
    expired: int = 0
    error: int = 0
    ages: list[float] = field(default_factory=empty_ages)
    recent_ms: deque[float] = field(default_factory=lambda: deque(maxlen=AGES_KEPT))
    open: int = 0

    def add(self, outcome: str, age_s: float) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        if outcome == "answered":
            self.ages[bisect.bisect_left(STREAM_AGE_BUCKETS, age_s)] += 1
            self.ages[-1] += age_s
            self.recent_ms.append(age_s * 1000.0)

    def outcomes(self) -> dict[str, int]:
        """Each outcome seen, counted."""
        return {outcome: n for outcome in STREAM_OUTCOMES if (n := getattr(self, outcome))}

    def percentiles_ms(self) -> tuple[float | None, float | None]:
        """The answered ages' p50 and p99 in ms (the newest :data:`AGES_KEPT`), None before any."""
        if not self.recent_ms:
            return None, None
        p50, p99 = np.percentile(np.fromiter(self.recent_ms, float), [50, 99])
        return round(float(p50), 3), round(float(p99), 3)


def merge_stream_states(states: Iterable[StreamState]) -> dict[str, StreamState]:
    """Several front ends' states summed per model."""
    merged: dict[str, StreamState] = {}
    for state in states:
        if (seen := merged.get(state.model)) is not None:
            if len(seen.ages) != len(state.ages):  # a front end of another build: its frames still count
                log.warning("stream ages of %s: %d buckets and %d; the latter left out", state.model, len(seen.ages),
                            len(state.ages))  # fmt: skip
                ages = seen.ages
            else:
                ages = [a + b for a, b in zip(seen.ages, state.ages, strict=True)]
            frames = {k: seen.frames.get(k, 0) + state.frames.get(k, 0) for k in {*seen.frames, *state.frames}}
            state = StreamState(state.model, frames, ages, seen.open + state.open)
        merged[state.model] = state
    return merged


class StreamCollector(ScrapeCollector):
    """``states()`` gives every front end's :class:`StreamState` (their latest reports). Each family is yielded on
    every scrape, without samples before any stream, so a dashboard's queries name metrics the server exports; a
    model that has had a stream shows every outcome, zeros included, so its rates start at zero."""

    def __init__(self, states: Callable[[], Iterable[StreamState]]) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        frames = CounterMetricFamily("visionserve_stream_frames", "Stream frames by outcome: answered, superseded "
                                     "(a newer frame arrived while it waited), expired (older than the stream's "
                                     "max_age_ms) or error", labels=("model", "outcome"))  # fmt: skip
        ages = HistogramMetricFamily("visionserve_stream_age_seconds", "Age of answered stream frames when answered, "
                                     "from when the server read them", labels=("model",))  # fmt: skip
        opened = GaugeMetricFamily("visionserve_streams_open", "Streams open now", labels=("model",))
        for model, state in sorted(merge_stream_states(self.states()).items()):
            for outcome in STREAM_OUTCOMES:
                frames.add_metric([model, outcome], state.frames.get(outcome, 0))
            if (buckets := age_buckets(state.ages)) is not None:
                ages.add_metric([model], buckets, state.ages[-1])
            opened.add_metric([model], state.open)
        yield from (frames, ages, opened)
