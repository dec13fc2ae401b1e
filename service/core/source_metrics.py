"""The metrics of sources (docs/sources.md): per source, labelled by its id (never its URL, which may carry a
password), its frames by outcome, the answered frames' age as a histogram, its rates in and answered, its reconnects;
and how many sources are in each state. Each front end reports its sources, cumulative, in its Snapshot to the
engine, as it does its streams (service/core/stream_metrics.py); the engine renders them at scrape time, so no
Prometheus call sits on a frame's path."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from service.core.metrics import ScrapeCollector
from service.core.stream_metrics import age_buckets, empty_ages

log = logging.getLogger(__name__)

# A source's frames: ``decoded``, then each decoded frame's fate (``skipped`` by max_fps or by a newer frame while
# the model was busy, ``answered``, ``expired`` or ``error``); decoded is their sum plus the frame computing.
SOURCE_OUTCOMES = ("decoded", "skipped", "answered", "expired", "error")
# A source's life: the first three while it runs, the last three once it has finished.
SOURCE_STATES = ("connecting", "running", "reconnecting", "ended", "failed", "stopped")
# fps in (frames decoded) and answered, over the source's last few seconds.
SOURCE_DIRECTIONS = ("in", "answered")


class SourceState(msgspec.Struct, array_like=True, frozen=True):
    """One source as its front end reports it (docs/sources.md, "Metrics"): its state (:data:`SOURCE_STATES`), frames
    by outcome (:data:`SOURCE_OUTCOMES`), answered frames' ages (decode to answer sent, in
    :class:`~service.core.stream_metrics.StreamState`'s layout), reconnects, fps over the last 5 s and the front end
    that runs it. Cumulative, so a repeated report replaces the last one."""

    id: str
    model: str
    state: str
    frames: dict[str, int]
    ages: list[float]
    reconnects: int = 0
    fps_in: float = 0.0
    fps_answered: float = 0.0
    frontend: str = ""
    counts: dict[str, Any] = {}  # its tracks through its lines and zones (docs/tracking.md), where it tracks


def merge_source_states(states: Iterable[SourceState]) -> dict[str, SourceState]:
    """Each source id once. Two front ends report the same id only when one restarted (the old one's last report
    may still be held); the report with more frames decoded wins, so the source's counters never step back, and of
    two that decoded as many the later one wins."""
    merged: dict[str, SourceState] = {}
    for state in states:
        seen = merged.get(state.id)
        if seen is None or state.frames.get("decoded", 0) >= seen.frames.get("decoded", 0):
            merged[state.id] = state
    return merged


class SourceCollector(ScrapeCollector):
    """``states()`` gives every front end's :class:`SourceState` (their latest reports). Each family is yielded on
    every scrape, without samples before any source, so a dashboard's queries name metrics the server exports; a
    source shows every outcome and direction, zeros included, so its rates start at zero; the count of sources
    shows every state, zeros included."""

    def __init__(self, states: Callable[[], Iterable[SourceState]]) -> None:
        self.states = states

    def collect(self) -> Iterator[Metric]:
        labels = ("source", "model")
        frames = CounterMetricFamily("visionserve_source_frames", "Source frames: decoded, and each decoded frame's "
                                     "fate: skipped (left out by max_fps, or replaced by a newer frame while the model "
                                     "was busy), answered, expired (older than max_age_ms) or error",
                                     labels=(*labels, "outcome"))  # fmt: skip
        ages = HistogramMetricFamily("visionserve_source_age_seconds", "Age of a source's answered frames when "
                                     "answered, from when the frame was decoded to when its answer was sent",
                                     labels=labels)  # fmt: skip
        fps = GaugeMetricFamily("visionserve_source_fps", "A source's frames per second over its last 5 s: decoded "
                                "(in) and answered", labels=(*labels, "direction"))  # fmt: skip
        reconnects = CounterMetricFamily("visionserve_source_reconnects", "Times a source lost its stream and "
                                         "reconnected", labels=labels)  # fmt: skip
        by_state = GaugeMetricFamily("visionserve_sources", "Sources in each state (finished ones stay until "
                                     "deleted)", labels=("state",))  # fmt: skip
        crossings = CounterMetricFamily(
            "visionserve_source_line_crossings",
            "Tracks that crossed a source's line, by direction and label",
            labels=(*labels, "line", "direction", "label"),
        )
        zoned = {kind: (CounterMetricFamily if kind != "occupancy" else GaugeMetricFamily)(
            f"visionserve_source_zone_{kind}", f"A source's zone: {what}, by label", labels=(*labels, "zone", "label"))
            for kind, what in (("entered", "tracks that entered it"), ("exited", "tracks that left it"),
                               ("occupancy", "tracks inside it now"))}  # fmt: skip
        counted = dict.fromkeys(SOURCE_STATES, 0)
        for id, state in sorted(merge_source_states(self.states()).items()):
            for line, directions in state.counts.get("lines", {}).items():
                for direction, by_label in directions.items():
                    for label, n in by_label.items():
                        crossings.add_metric([id, state.model, line, direction, label], n)
            for zone, figures in state.counts.get("zones", {}).items():
                for kind, family in zoned.items():
                    for label, n in figures.get(kind, {}).items():
                        family.add_metric([id, state.model, zone, label], n)
            counted[state.state] = counted.get(state.state, 0) + 1  # a state of a newer build still counts
            for outcome in SOURCE_OUTCOMES:
                frames.add_metric([id, state.model, outcome], state.frames.get(outcome, 0))
            if (buckets := age_buckets(state.ages)) is not None:
                ages.add_metric([id, state.model], buckets, state.ages[-1])
            else:  # a front end of another build: its other metrics still show
                log.warning("source %s ages: %d buckets, %d expected; left out", id, len(state.ages), len(empty_ages()))
            for direction, rate in zip(SOURCE_DIRECTIONS, (state.fps_in, state.fps_answered), strict=True):
                fps.add_metric([id, state.model, direction], rate)
            reconnects.add_metric([id, state.model], state.reconnects)
        for name, count in counted.items():
            by_state.add_metric([name], count)
        yield from (frames, ages, fps, reconnects, by_state, crossings, *zoned.values())
