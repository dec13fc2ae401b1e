"""Stream metrics (docs/streams.md, "Counting"): what a front end counts (``ServerState.stream_outcome`` and
``stream_open``) travels in its Snapshot (an older sender's Snapshot, without streams, still decodes), the engine
sums every front end's, and the collector renders frames by outcome, the age histogram (cumulative, ``le`` the
bucket's bound) and the streams open; with no stream each family is exported without samples."""

from __future__ import annotations

import msgspec
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.core.settings import ServerSettings
from service.core.stream_metrics import STREAM_AGE_BUCKETS, STREAM_OUTCOMES, StreamCollector, StreamState
from service.frontend.state import ServerState
from service.transport.messages import Snapshot

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def render(*states: StreamState) -> str:
    registry = CollectorRegistry()
    registry.register(StreamCollector(lambda: list(states)))
    return generate_latest(registry).decode()


def samples_of(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def counted(server: ServerState) -> list[StreamState]:
    """What the front end's next Snapshot says of its streams, through the wire's encoding."""
    snapshot = msgspec.msgpack.decode(msgspec.msgpack.encode(server.snapshot(7)), type=Snapshot)
    return snapshot.streams


def test_a_front_end_counts_its_frames_ages_and_open_streams() -> None:
    server = ServerState(ServerSettings(metrics=False), None)
    record = server.stream_outcome("cam")
    with server.stream_open("cam", object()):
        for outcome, age_s in [("answered", 0.0005), ("answered", 0.002), ("superseded", 0.01), ("expired", 0.6),
                               ("error", 0.001), ("answered", 99.0)]:  # fmt: skip
            record(outcome, age_s)
        [state] = counted(server)
        assert state.open == 1 and len(server.streams) == 1
    assert state.model == "cam"
    assert state.frames == {"answered": 3, "superseded": 1, "expired": 1, "error": 1}
    assert sum(state.ages[:-1]) == 3 and state.ages[-1] == pytest.approx(0.0005 + 0.002 + 99.0)
    assert state.ages[0] == 1  # 0.5 ms <= the first bound, 1 ms
    assert state.ages[-2] == 1  # 99 s is above the last bound: the +Inf count
    [closed] = counted(server)
    assert closed.open == 0 and closed.frames == state.frames and not server.streams  # a gauge: back to 0, kept


def test_an_older_front_ends_snapshot_without_streams_still_decodes() -> None:
    class Before(msgspec.Struct, tag="snapshot", array_like=True, frozen=True):
        token: int
        requests: list[object]
        counts: list[object]

    snapshot = msgspec.msgpack.decode(msgspec.msgpack.encode(Before(3, [], [])), type=Snapshot)
    assert snapshot.token == 3 and snapshot.streams == []


def test_front_ends_are_summed_per_model_and_rendered() -> None:
    ages = [0.0] * (len(STREAM_AGE_BUCKETS) + 2)
    ages[0], ages[3], ages[-2], ages[-1] = 2, 1, 1, 40.0  # two at <= 1 ms, one at <= 3.375 ms, one above 33 s
    one = StreamState("cam", {"answered": 4, "superseded": 7}, ages, 1)
    two = StreamState("cam", {"answered": 1, "error": 2}, [0.0] * 3 + [1.0] + [0.0] * (len(ages) - 5) + [0.003], 2)
    other = StreamState("door", {}, [0.0] * len(ages), 0)
    text = render(one, two, other)
    parsed = samples_of(text)
    frames = {(dict(k)["model"], dict(k)["outcome"]): v for (n, k), v in parsed.items()
              if n == "visionserve_stream_frames_total"}  # fmt: skip
    assert frames == {("cam", "answered"): 5, ("cam", "superseded"): 7, ("cam", "expired"): 0, ("cam", "error"): 2,
                      **{("door", o): 0 for o in STREAM_OUTCOMES}}  # fmt: skip
    assert parsed[("visionserve_streams_open", (("model", "cam"),))] == 3
    assert parsed[("visionserve_streams_open", (("model", "door"),))] == 0
    cam = (("model", "cam"),)
    assert parsed[("visionserve_stream_age_seconds_count", cam)] == 5
    assert parsed[("visionserve_stream_age_seconds_sum", cam)] == pytest.approx(40.003)
    bucket = {dict(k)["le"]: v for (n, k), v in parsed.items()
              if n == "visionserve_stream_age_seconds_bucket" and dict(k)["model"] == "cam"}  # fmt: skip
    assert bucket["0.001"] == 2 and bucket["0.0015"] == 2 and bucket["0.003375"] == 4 and bucket["+Inf"] == 5
    assert list(bucket.values()) == sorted(bucket.values())  # cumulative
    assert "# TYPE visionserve_stream_frames_total counter" in text.splitlines()


def test_no_stream_exports_every_family_without_samples() -> None:
    families = list(text_string_to_metric_families(render()))
    assert {f.name: f.type for f in families} == {
        "visionserve_stream_frames": "counter", "visionserve_stream_age_seconds": "histogram",
        "visionserve_streams_open": "gauge",
    }  # fmt: skip
    assert all(not f.samples for f in families)
