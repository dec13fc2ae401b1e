"""Source metrics: the collector's Prometheus text for given reports (every outcome and direction of a source, its
age histogram cumulative, a source reported twice counted once, every state counted, zeros included, and every
family present before any source); a Snapshot with sources, and one from an older front end without them, through
MessagePack; the dashboard's Sources row queries each source metric and only those the collector exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import ModelCounts, RequestState
from service.core.source_metrics import SOURCE_OUTCOMES, SOURCE_STATES, SourceCollector, SourceState
from service.core.stream_metrics import STREAM_AGE_BUCKETS, StreamState, empty_ages
from service.transport.messages import ENCODER, TO_ENGINE, Snapshot

ROOT = Path(__file__).resolve().parents[2]
SOURCE_METRICS = {
    "visionserve_source_frames_total", "visionserve_source_age_seconds", "visionserve_source_fps",
    "visionserve_source_reconnects_total", "visionserve_sources", "visionserve_source_line_crossings_total",
    "visionserve_source_zone_entered_total", "visionserve_source_zone_exited_total",
    "visionserve_source_zone_occupancy",
}  # fmt: skip
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def render(states: list[SourceState]) -> str:
    registry = CollectorRegistry()
    registry.register(SourceCollector(lambda: states))
    return generate_latest(registry).decode()


def samples(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found[(name, tuple(sorted(labels.items())))]


def ages_of(*seconds: float) -> list[float]:
    ages = empty_ages()
    for age in seconds:
        index = next((i for i, bound in enumerate(STREAM_AGE_BUCKETS) if age <= bound), len(STREAM_AGE_BUCKETS))
        ages[index] += 1
        ages[-1] += age
    return ages


def source(id: str = "cam1", decoded: int = 10, state: str = "running", **fields: object) -> SourceState:
    frames = {"decoded": decoded, "skipped": 2, "answered": decoded - 4, "expired": 1, "error": 1}
    return SourceState(id, "digits", state, frames, ages_of(*[0.002] * (decoded - 4)), **fields)  # type: ignore[arg-type]


def test_every_family_is_exported_before_any_source_and_every_state_counts_zero() -> None:
    text = render([])
    exported = {f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)}
    assert exported == SOURCE_METRICS
    found = samples(text)
    assert {labels: v for (name, labels), v in found.items() if name == "visionserve_sources"} == {
        (("state", state),): 0.0 for state in SOURCE_STATES
    }
    assert all(name == "visionserve_sources" for name, _ in found)


def test_a_source_shows_its_frames_rates_reconnects_and_cumulative_ages() -> None:
    ages = [0.0005, 0.002, 0.002, 0.04, 100.0]  # the last above every bound: +Inf only
    state = SourceState("door", "digits", "reconnecting", {"decoded": 9, "answered": 5, "error": 1}, ages_of(*ages),
                        reconnects=3, fps_in=12.5, fps_answered=7.25, frontend="fe0")  # fmt: skip
    found = samples(render([state]))
    labels = {"source": "door", "model": "digits"}
    told = {"decoded": 9, "skipped": 0, "answered": 5, "expired": 0, "error": 1}
    assert {o: value(found, "visionserve_source_frames_total", outcome=o, **labels) for o in SOURCE_OUTCOMES} == told
    assert value(found, "visionserve_source_fps", direction="in", **labels) == 12.5
    assert value(found, "visionserve_source_fps", direction="answered", **labels) == 7.25
    assert value(found, "visionserve_source_reconnects_total", **labels) == 3
    assert value(found, "visionserve_source_age_seconds_count", **labels) == 5
    assert value(found, "visionserve_source_age_seconds_sum", **labels) == pytest.approx(sum(ages))
    buckets = {float(dict(ls)["le"]): v for (n, ls), v in found.items() if n == "visionserve_source_age_seconds_bucket"}
    assert sorted(buckets) == [*STREAM_AGE_BUCKETS, float("inf")]
    for bound, count in buckets.items():
        assert count == sum(age <= bound for age in ages), bound  # cumulative: every age at or under the bound
    assert buckets[0.001] == 1 and buckets[STREAM_AGE_BUCKETS[-1]] == 4 and buckets[float("inf")] == 5
    by_state = {s: value(found, "visionserve_sources", state=s) for s in SOURCE_STATES}
    assert by_state == {s: float(s == "reconnecting") for s in SOURCE_STATES}
    assert {n for n, ls in found if "frontend" in dict(ls) or "url" in dict(ls)} == set()


def test_a_source_reported_twice_is_counted_once_the_one_with_more_frames_decoded() -> None:
    old = source("cam1", decoded=50, state="running", fps_in=10.0)  # the restarted front end's last report
    new = source("cam1", decoded=8, state="connecting", fps_in=1.0)
    other = source("cam2", decoded=20, state="failed")
    for order in ([old, new, other], [new, other, old]):
        found = samples(render(order))
        labels = {"source": "cam1", "model": "digits"}
        assert value(found, "visionserve_source_frames_total", outcome="decoded", **labels) == 50
        assert value(found, "visionserve_source_age_seconds_count", **labels) == 46
        assert value(found, "visionserve_source_fps", direction="in", **labels) == 10.0
        assert {s: value(found, "visionserve_sources", state=s) for s in SOURCE_STATES} == {
            "connecting": 0, "running": 1, "reconnecting": 0, "ended": 0, "failed": 1, "stopped": 0,
        }  # fmt: skip
        frames = [ls for n, ls in found if n == "visionserve_source_frames_total" and ("outcome", "decoded") in ls]
        assert sorted(dict(ls)["source"] for ls in frames) == ["cam1", "cam2"]
    # As many decoded in both: the later report wins.
    first, later = source("cam1", decoded=8, state="running"), source("cam1", decoded=8, state="stopped")
    assert value(samples(render([first, later])), "visionserve_sources", state="stopped") == 1


def test_ages_of_another_build_are_left_out_and_the_rest_still_shows() -> None:
    odd = SourceState("cam1", "digits", "running", {"decoded": 3, "answered": 3}, [1.0, 2.0, 0.5])
    found = samples(render([odd]))
    assert not [n for n, _ in found if n.startswith("visionserve_source_age_seconds")]
    assert value(found, "visionserve_source_frames_total", source="cam1", model="digits", outcome="answered") == 3


def test_a_snapshot_with_sources_round_trips_and_an_older_one_decodes_with_none() -> None:
    request = RequestState(("digits", "1", "cpu", "v1"), [5, 1], [])
    stream = StreamState("digits", {"answered": 2}, empty_ages(), open=1)
    sources = [source("cam1", fps_in=3.5, frontend="fe1"), source("cam2", state="ended", reconnects=2)]
    snapshot = Snapshot(7, [request], [ModelCounts("digits", 1, 2, 3)], [stream], sources)
    back = TO_ENGINE.decode(ENCODER.encode(snapshot))
    assert back == snapshot and isinstance(back, Snapshot) and back.sources[0].frontend == "fe1"
    assert TO_ENGINE.decode(ENCODER.encode(Snapshot(8, [], []))) == Snapshot(8, [], [], [], [])

    class OlderSnapshot(msgspec.Struct, tag="snapshot", array_like=True, frozen=True):
        """A front end of the build before sources: its Snapshot ends at ``streams``."""

        token: int
        requests: list[RequestState]
        counts: list[ModelCounts]
        streams: list[StreamState] = []

    older = TO_ENGINE.decode(ENCODER.encode(OlderSnapshot(9, [request], [], [stream])))
    assert older == Snapshot(9, [request], [], [stream], [])
    # A SourceState of an older build, without the fields that have defaults, decodes with them.
    short = msgspec.msgpack.encode(["cam1", "digits", "running", {"decoded": 1}, empty_ages()])
    assert msgspec.msgpack.decode(short, type=SourceState) == SourceState(
        "cam1", "digits", "running", {"decoded": 1}, empty_ages()
    )


def test_the_dashboard_sources_row_queries_every_source_metric_and_only_exported_ones() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana" / "visionserve.json").read_text())
    panels = dashboard["panels"]
    rows = [i for i, p in enumerate(panels) if p["type"] == "row"]
    assert panels[rows[-1]]["title"] == "Sources"
    row = panels[rows[-1] + 1 :]
    queries = [t["expr"] for p in row for t in p["targets"]]
    queried = {re.sub(r"_(bucket|count|sum)$", "", name) for q in queries for name in re.findall(r"visionserve_\w+", q)}
    assert queried == SOURCE_METRICS
    assert all(re.search(r"\bsource\b", q) for q in queries if "visionserve_sources" not in q), queries
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels[: rows[-1]])
    assert panels[rows[-1]]["gridPos"]["y"] >= bottom


def test_a_tracking_source_shows_its_line_crossings_and_zones_by_label() -> None:
    desk = {"occupancy": {"3": 2}, "entered": {"3": 5}, "exited": {"3": 3}, "dwell_s": {}}
    counts = {"lines": {"gate": {"in": {"3": 4}, "out": {"7": 1}}}, "zones": {"desk": desk}}
    found = samples(render([source(counts=counts)]))
    at = {"source": "cam1", "model": "digits"}
    assert value(found, "visionserve_source_line_crossings_total", **at, line="gate", direction="in", label="3") == 4
    assert value(found, "visionserve_source_line_crossings_total", **at, line="gate", direction="out", label="7") == 1
    assert value(found, "visionserve_source_zone_occupancy", **at, zone="desk", label="3") == 2
    assert value(found, "visionserve_source_zone_entered_total", **at, zone="desk", label="3") == 5
    assert value(found, "visionserve_source_zone_exited_total", **at, zone="desk", label="3") == 3
