"""Tracks, lines and zones (service/core/tracking.py): identities through gaps and crossings, each crossing counted
once, zones' entries, exits and dwell, and every hostile geometry refused naming its field."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from service.core.errors import BadInputError
from service.core.tracking import ByteTrack, Counter, Line, TrackSettings, Zone, read_track

LABELS = tuple(str(d) for d in range(10))


def box(x: float, y: float, size: float = 20) -> list[float]:
    return [x, y, x + size, y + size]


def run(frames: list[tuple[float, list[list[float]]]], settings: TrackSettings | None = None) -> list[list[int]]:
    """Each frame's track ids, the frames ``(t, boxes)`` with score 0.9 and label 3 each."""
    tracker = ByteTrack(settings)
    return [tracker.update(np.array(b).reshape(-1, 4), np.full(len(b), 0.9), np.full(len(b), 3), t).tolist()
            for t, b in frames]  # fmt: skip


def test_two_objects_crossing_each_other_and_one_hidden_keep_their_ids() -> None:
    frames = []
    for f in range(60):  # a left to right, b right to left, on rows 6 px apart: they overlap mid-way
        a, b = box(10 + 4 * f, 50), box(250 - 4 * f, 56)
        frames.append((f / 15, [a] if 20 <= f < 24 else [a, b]))  # b hidden for four frames
    ids = run(frames)
    assert ids[0] == [1, 2]
    assert all(row[0] == 1 for row in ids) and all(row[1] == 2 for row in ids if len(row) == 2)


def test_a_gap_the_server_skipped_is_crossed_by_the_motion_model() -> None:
    every = [(f / 15, [box(10 + 6 * f, 40)]) for f in range(60)]
    seen = every[:6] + every[10:60:5]  # then only every fifth frame: 30 px a step, more than the box is wide
    assert run(seen) == [[1]] * len(seen)


def test_a_track_unseen_past_its_buffer_is_new_when_it_comes_back() -> None:
    frames = [(0.0, [box(10, 10)]), (0.1, [box(10, 10)]), (2.0, [box(10, 10)])]
    assert run(frames, TrackSettings(lost_track_buffer_s=1.0)) == [[1], [1], [2]]
    assert run(frames, TrackSettings(lost_track_buffer_s=3.0)) == [[1], [1], [1]]


def test_a_new_track_waits_for_its_consecutive_frames_before_it_has_an_id() -> None:
    frames = [(f / 15, [box(10 + f, 10)]) for f in range(4)]
    assert run(frames, TrackSettings(minimum_consecutive_frames=3)) == [[-1], [-1], [1], [1]]


def count(counter: Counter, xs: list[float], y: float = 40.0, track: int = 7) -> list[dict[str, Any]]:
    events = []
    for f, x in enumerate(xs):
        b = np.array([[x - 10, y - 10, x + 10, y + 10]])
        events += counter.update([track], b, ["3"], f / 15, (200, 100), [])
    return events


def test_a_box_jittering_on_a_line_crosses_it_once_and_the_direction_follows_the_cross_product() -> None:
    counter = Counter([Line("gate", [[100, 0], [100, 100]])], [])  # pointing down: its "in" side is x < 100
    jitter = [90, 95, 99, 101, 99.5, 100.5, 101.5, 99, 108, 120]  # within 2 px of the line, then clearly across
    events = count(counter, jitter)
    assert [(e["event"], e["direction"]) for e in events] == [("cross", "out")]
    events = count(counter, [120, 110, 90, 80])  # and back
    assert [e["direction"] for e in events] == ["in"]
    assert counter.counts()["lines"] == {"gate": {"in": {"3": 1}, "out": {"3": 1}}}
    assert count(Counter([Line("short", [[100, 0], [100, 20]])], []), [90, 120]) == []  # passed beyond its end


def test_a_zone_counts_entries_exits_occupancy_and_dwell_and_a_dropped_track_leaves_it() -> None:
    zone = Zone("desk", [[50, 0], [150, 0], [150, 100], [50, 100]])
    counter = Counter([], [zone])
    events = count(counter, [20, 40, 60, 80, 100, 120, 140, 160, 180])  # in at frame 2, out at frame 7
    assert [(e["event"], e["time"]) for e in events] == [("enter", 2 / 15), ("exit", 7 / 15)]
    assert events[-1]["dwell_s"] == pytest.approx(5 / 15, abs=1e-3)
    count(counter, [100], track=8)
    zones = counter.counts(now=1.0)["zones"]["desk"]
    assert zones["occupancy"] == {"3": 1} and zones["entered"] == {"3": 2} and zones["exited"] == {"3": 1}
    assert zones["dwell_s"]["max"] == pytest.approx(1.0)  # track 8, inside since t=0
    gone = counter.update([], np.zeros((0, 4)), [], 2.0, (200, 100), [8])
    assert [(e["event"], e["track_id"]) for e in gone] == [("exit", 8)]
    counter.reset()
    assert counter.counts()["zones"]["desk"]["entered"] == {}


def test_lines_and_zones_in_normalized_units_scale_with_the_frame() -> None:
    counter = Counter([Line("mid", [[0.5, 0], [0.5, 1]])], [], normalized=True)
    assert [e["direction"] for e in count(counter, [20, 60, 140, 180])] == ["out"]  # 0.5 of 200 px


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"zones": [{"id": "z", "polygon": [[0, 0], [1, 1]]}]}, "zones[0].polygon: from 3"),
        ({"zones": [{"id": "z", "polygon": [[0, 0], [10, 10], [10, 0], [0, 10]]}]}, "zones[0].polygon: its edges"),
        ({"lines": [{"id": "l", "points": [[5, 5], [5, 5]]}]}, "lines[0].points: two different"),
        ({"lines": [{"id": "l", "points": [[float("nan"), 5], [5, 9]]}]}, "lines[0]: each point"),
        ({"lines": [{"id": "l", "points": [[float("inf"), 5], [5, 9]]}]}, "lines[0]: each point"),
        ({"zones": [{"id": str(i), "polygon": [[0, 0], [9, 0], [0, 9]]} for i in range(17)]}, "at most 16"),
        ({"zones": [{"id": "z", "polygon": [[i, i * i] for i in range(65)]}]}, "from 3 to 64"),
        ({"lines": [{"id": "l", "points": [[0, 0], [9, 9]], "classes": ["cat"]}]}, "lines[0].classes: 'cat'"),
        ({"lines": [{"id": "l", "points": [[0, 0], [9, 9]], "colour": 1}]}, "lines: Object contains unknown"),
        ({"lines": [{"id": "l", "points": [[0, 0], [9, 9]]}] * 2}, "each id once"),
        ({"track": {"matching_iou": 2}}, "track: Expected `float` <= 1"),
        ({"track": {"lost_track_buffer_s": -1}}, "track: Expected `float` >= 0"),
        ({"track": False, "lines": [{"id": "l", "points": [[0, 0], [9, 9]]}]}, "lines and zones count tracks"),
        ({"track": "yes"}, "track: Expected `object`"),
    ],
)
def test_hostile_tracking_is_refused_naming_the_field(body: dict[str, Any], words: str) -> None:
    with pytest.raises(BadInputError, match=None) as refused:
        read_track(body, None, LABELS, boxes=True)
    assert words in str(refused.value), str(refused.value)


def test_tracking_asked_of_a_classifier_says_it_needs_a_detector() -> None:
    with pytest.raises(BadInputError, match="needs a detector"):
        read_track({"track": True}, None, LABELS, boxes=False)


def test_a_change_keeps_what_it_leaves_out() -> None:
    first = read_track({"track": {"lost_track_buffer_s": 3}, "lines": [{"id": "g", "points": [[0, 0], [9, 9]]}]},
                       None, LABELS, boxes=True)  # fmt: skip
    assert first is not None and first.settings.lost_track_buffer_s == 3
    changed = read_track({"zones": [{"id": "z", "polygon": [[0, 0], [9, 0], [0, 9]]}]}, first, LABELS, boxes=True)
    assert changed is not None and changed.settings.lost_track_buffer_s == 3
    assert [line.id for line in changed.lines] == ["g"] and [z.id for z in changed.zones] == ["z"]
    assert read_track({"track": False}, changed, LABELS, boxes=True) is None


def test_a_crossing_counts_as_the_track_s_label_not_a_misreading_on_the_crossing_frame() -> None:
    from service.core.tracking import TrackAsk, Tracking

    tracking = Tracking(TrackAsk(TrackSettings(), [Line("l", [[50, 0], [50, 100]])], []))
    events = []
    for k, (x, index) in enumerate([(30, 0), (36, 0), (42, 0), (48, 0), (54, 2), (60, 0), (66, 0)]):
        rows = [{"box": [x - 20, 30, x + 20, 70], "label": str(index), "index": index, "score": 0.9}]
        events += tracking.step(rows, Pixels(), (100, 100), k / 15)
    assert [(e["label"], e["direction"]) for e in events] == [("0", "out")]  # the 2 was read once, at the line


class Pixels:  # options as a detection answer writes its boxes
    box_format, normalized = "xyxy", False


def test_one_object_read_under_two_labels_starts_one_track() -> None:
    tracker = ByteTrack()
    for f in range(3):
        ids = tracker.update(np.array([box(10, 10), box(10, 10)]), np.array([0.7, 0.6]), np.array([7, 8]), f / 15)
        assert ids.tolist() == [1, -1], ids  # the second reading of the same box gets no track of its own


def test_an_object_that_turns_while_unseen_is_found_again_at_its_last_seen_box() -> None:
    xs = [10, 20, 30, 40, 50, 60, 58, 55, 50, 45]  # 10 px a frame, then back: frame 6 unseen, its track coasts on
    frames = [(f / 15, [box(x, 10)] if f != 6 else []) for f, x in enumerate(xs)]
    assert {i for row in run(frames) for i in row} == {1}
