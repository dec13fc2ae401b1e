"""The tracking clips (models/clips.py): the truth is the video's (frames, size, rate, boxes inside the frame), each
crossing in it really passes the line (service/core/tracking.py's Counter, fed the true boxes and ids, counts exactly
the truth's crossings), and a clip is made once into its folder, the same from the same seed."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest

from models.clips import FPS, HEIGHT, WIDTH, Truth, clip, render
from service.core.tracking import Counter, Line


def _centre_side(truth: Truth, box: tuple[float, ...]) -> float:
    (x1, y1), (x2, y2) = truth.line
    cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
    return float(np.sign((x2 - x1) * (cy - y1) - (y2 - y1) * (cx - x1)))


def test_a_clip_decodes_and_its_truth_is_the_videos(tmp_path: Path) -> None:
    video, truth = clip(3, tmp_path)
    with av.open(str(video)) as container:
        stream = container.streams.video[0]
        frames = [frame.to_ndarray(format="gray") for frame in container.decode(stream)]
        assert stream.average_rate == Fraction(FPS) and stream.codec_context.name == "h264"
    assert (truth.fps, truth.width, truth.height, truth.seed) == (FPS, WIDTH, HEIGHT, 3)
    assert 45 <= len(frames) == len(truth.frames) == len(truth.hidden) <= 90
    assert all(frame.shape == (HEIGHT, WIDTH) for frame in frames)
    for f, (seen, hidden) in enumerate(zip(truth.frames, truth.hidden, strict=True)):
        ids = [s.id for s in seen]
        assert len(set(ids)) == len(ids) and not set(ids) & set(hidden)
        for s in seen:
            x1, y1, x2, y2 = s.box
            assert 0 <= x1 < x2 <= WIDTH and 0 <= y1 < y2 <= HEIGHT and 0 <= s.label <= 9
            # The digit is drawn there: its box is brighter than the frame around it, compression and all.
            assert frames[f][int(y1) : int(y2), int(x1) : int(x2)].mean() > frames[f].mean() + 10
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    assert clip(3, tmp_path) == (video, truth)  # made once: read back, not made again
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("seed", range(10))
def test_each_crossing_passes_the_line_as_the_counter_counts_it(seed: int) -> None:
    _, truth = render(seed)
    assert truth.crossings and any(truth.hidden)  # each clip has what it is for
    counter = Counter([Line("line", truth.line)], [])
    for f, seen in enumerate(truth.frames):
        boxes = np.array([s.box for s in seen]).reshape(-1, 4)
        counter.update([s.id for s in seen], boxes, [str(s.label) for s in seen], f / FPS, (WIDTH, HEIGHT), [])
    assert counter.counts()["lines"]["line"] == truth.counts()
    for c in truth.crossings:  # the last centre seen off the line before, the first seen after: each side, rightly
        sides = [(f, s) for f, seen in enumerate(truth.frames) for s in seen if s.id == c.id]
        before = [_centre_side(truth, s.box) for f, s in sides if f < c.frame and _centre_side(truth, s.box)][-1]
        f, after = next((f, s) for f, s in sides if f >= c.frame)
        assert (before, _centre_side(truth, after.box)) == ((-1.0, 1.0) if c.direction == "in" else (1.0, -1.0))
        assert c.label == after.label and (f == c.frame or c.id in truth.hidden[c.frame])


def test_the_same_seed_gives_the_same_clip() -> None:
    (a, truth_a), (b, truth_b) = render(1), render(1)
    assert truth_a == truth_b and np.array_equal(a, b)
    assert render(2)[1] != truth_a
