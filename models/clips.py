"""Clips for tracking (issue 55's ground truth; docs/tracking.md): held-out digits (models/canvases.py) on scripted
paths over a canvas's ground, as H.264 MP4 at 15 fps (PyAV), with the truth beside each: per frame the digits in
view (id, the ink's box clipped to the frame as canvases' boxes are, label) and those hidden, a line across the
middle and its crossings (``in`` when ``(p2 - p1) x (c - p1)`` of a box's centre goes from negative to positive, as
service/core/tracking.py counts). A 192 x 144 frame is letterboxed to 96 x 72 by the detector: its 42-60 px digits
are seen at 21-30 px, inside the 12-40 it was trained on.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import msgspec
import numpy as np

from models.canvases import CanvasParams, DigitPool, _grounds, _ink_box, _iou, _paste, _resize_matrix, digit_pool

FPS, WIDTH, HEIGHT = 15, 192, 144
SIZES_PX = (42, 60)  # a digit's height (at 36-42 px 96% of its top boxes had the right label, 98-100% above)
MAX_SPEED_PX = 6.0  # a frame: 90 px/s, the frame's width in two seconds
MAX_IOU = 0.2  # two digits' boxes overlap no more (at 0.2-0.3 the detector found 90% of them)
VISIBLE = 0.5  # a digit is in view with this share of its box inside (the detector's recall: 7% at 0.25-0.5)
MARGIN_PX = 12.0  # a path's start, turn and end keep this far from the line; a digit this near it is wholly in view
VERSION = 1  # of the generator, in the cached files' names: a change makes them again
Box = tuple[float, float, float, float]


class Seen(msgspec.Struct, frozen=True, array_like=True):
    """A digit in view: its id, box (x1, y1, x2, y2 in pixels) and label."""

    id: int
    box: Box
    label: int


class Crossing(msgspec.Struct, frozen=True):
    frame: int  # the first on the new side
    id: int
    label: int
    direction: str


class Truth(msgspec.Struct, frozen=True):
    """A clip's truth: per frame the digits in view and the ids hidden; the line (two points) and its crossings."""

    seed: int
    fps: int
    width: int
    height: int
    line: list[list[float]]
    frames: list[list[Seen]]
    hidden: list[list[int]]
    crossings: list[Crossing]

    def counts(self) -> dict[str, dict[str, int]]:
        """The line's counts as service/core/tracking.py's Counter gives them: direction -> label -> count."""
        return {d: dict(Counter(str(c.label) for c in self.crossings if c.direction == d)) for d in ("in", "out")}


@dataclass(frozen=True)
class _Mover:
    label: int
    patch: np.ndarray  # ink strength, 0..1
    ink: tuple[int, int, int, int]  # its box in the patch
    level: float  # the ink's share of the way from the ground to white
    keys: np.ndarray  # [3, 3]: frame, centre x, centre y
    hidden: range

    def corner(self, frame: int) -> tuple[int, int]:
        x, y = (np.interp(frame, self.keys[:, 0], self.keys[:, k]) for k in (1, 2))
        return round(x - self.patch.shape[1] / 2), round(y - self.patch.shape[0] / 2)

    def box(self, frame: int, least: float = VISIBLE) -> Box | None:
        """The ink's box at ``frame`` clipped to the frame; None when less than ``least`` of it is inside."""
        if not self.keys[0, 0] <= frame <= self.keys[-1, 0]:
            return None
        left, top = self.corner(frame)
        x1, x2 = (min(max(left + v, 0), WIDTH) for v in self.ink[::2])
        y1, y2 = (min(max(top + v, 0), HEIGHT) for v in self.ink[1::2])
        full = (self.ink[2] - self.ink[0]) * (self.ink[3] - self.ink[1])
        return (x1, y1, x2, y2) if (x2 - x1) * (y2 - y1) >= least * full else None


def _side(line: np.ndarray, points: np.ndarray) -> np.ndarray:
    """``(p2 - p1) x (c - p1)`` over the segment's length: the signed distance, > 0 on the ``in`` side."""
    span, a = line[1] - line[0], points - line[0]
    return (span[0] * a[..., 1] - span[1] * a[..., 0]) / np.hypot(*span)


def _mover(rng: np.random.Generator, frames: int, line: np.ndarray, pool: DigitPool) -> _Mover | None:
    """One digit's script, or None when the draw breaks a rule (too fast, turning near the line, cut near it)."""
    d, h = int(rng.integers(len(pool.labels))), int(rng.integers(SIZES_PX[0], SIZES_PX[1] + 1))
    patch = _resize_matrix(h) @ pool.ink[d] @ _resize_matrix(max(4, round(h * rng.uniform(0.8, 1.2)))).T
    ink = _ink_box(patch)
    start = int(rng.integers(0, frames // 2)) if rng.random() < 0.5 else 0
    end = int(rng.integers(max(frames // 2, start + 15), frames - 1)) if rng.random() < 0.4 else frames - 1
    at = rng.uniform((0.15 * WIDTH, 0.15 * HEIGHT), (0.85 * WIDTH, 0.85 * HEIGHT), size=(3, 2))
    if rng.random() < 0.7 and (at[0, 0] < WIDTH / 2) == (at[2, 0] < WIDTH / 2):  # most cross from half to half
        at[2, 0] = WIDTH - at[2, 0]
    for k, outside in ((0, start > 0), (2, end < frames - 1)):
        if outside:  # entering or leaving: the centre beyond an edge (left, top, right, bottom), the patch too
            edge = int(rng.integers(4))
            axis, size = edge % 2, patch.shape[1 - edge % 2]
            at[k, axis] = -0.6 * size if edge < 2 else (WIDTH, HEIGHT)[axis] + 0.6 * size
    keys = np.array([[start, *at[0]], [int(rng.integers(start + 1, end)), *at[1]], [end, *at[2]]])
    speed = np.hypot(*np.diff(keys[:, 1:], axis=0).T) / np.diff(keys[:, 0])
    if ink is None or speed.max() > MAX_SPEED_PX or np.abs(_side(line, keys[:, 1:])).min() < MARGIN_PX:
        return None
    first = int(rng.integers(start + 6, end - 9)) if end - start > 16 else 0
    hidden = range(first, first + int(rng.integers(2, 6))) if first and rng.random() < 0.5 else range(0)
    m = _Mover(int(pool.labels[d]), patch, ink, float(rng.uniform(0.7, 1.0)), keys, hidden)
    for f in range(start, end + 1):
        near = m.box(f, 0.0)
        if near and abs(_side(line, np.add(near[:2], near[2:]) / 2)) < MARGIN_PX and not m.box(f, 1.0):
            return None
    return m


def _apart(a: _Mover, b: _Mover, frames: int, most: float = MAX_IOU) -> bool:
    pairs = ((a.box(f), b.box(f)) for f in range(frames))
    return all(_iou(p, q) <= most for p, q in pairs if p is not None and q is not None)


def _crossings(line: np.ndarray, movers: list[_Mover], frames: int) -> list[Crossing]:
    """Each change of the side of the line a box's centre in view is on (a centre on the line takes no side). The
    line spans the frame's height and a digit near it is wholly in view: each change passes through the segment."""
    out = []
    for i, m in enumerate(movers, 1):
        last = 0.0
        for f, box in enumerate(m.box(f) for f in range(frames)):
            side = 0.0 if box is None else float(_side(line, np.add(box[:2], box[2:]) / 2))
            if side * last < 0:
                out.append(Crossing(f, i, m.label, "in" if side > 0 else "out"))
            last = side or last
    return sorted(out, key=lambda c: (c.frame, c.id))


def _script(seed: int) -> tuple[int, np.ndarray, list[_Mover]]:
    """A clip's frame count, line and movers, drawn until it has what it is for: 3-5 digits, two passing each
    other, one hidden, one entering or leaving, a crossing of the line."""
    rng, pool = np.random.default_rng((55, seed)), digit_pool("heldout")
    while True:
        frames = int(rng.integers(45, 91))
        slant = rng.uniform(-WIDTH / 6, WIDTH / 6) * (rng.random() < 0.6)
        line = np.array([[WIDTH / 2 + slant, 0.0], [WIDTH / 2 - slant, float(HEIGHT)]])
        movers: list[_Mover] = []
        for _ in range(60):
            m = _mover(rng, frames, line, pool)
            if m is not None and len(movers) < 5 and all(_apart(m, other, frames) for other in movers):
                movers.append(m)
        passing = any(not _apart(a, b, frames, 0.05) for i, a in enumerate(movers) for b in movers[:i])
        ends = any(m.keys[0, 0] > 0 or m.keys[-1, 0] < frames - 1 for m in movers)
        if len(movers) >= 3 and passing and ends and any(m.hidden for m in movers) and _crossings(line, movers, frames):
            return frames, line, movers


def render(seed: int) -> tuple[np.ndarray, Truth]:
    """Clip ``seed``'s frames (grey uint8 ``[F, HEIGHT, WIDTH]``) and its truth."""
    frames, line, movers = _script(seed)
    rng, params = np.random.default_rng((55, seed, 1)), CanvasParams(canvas_size=WIDTH)
    ground = _grounds(params, 1, rng)[0]  # square: pasted on whole, cropped to the frame
    pictures = np.empty((frames, HEIGHT, WIDTH), np.uint8)
    seen: list[list[Seen]] = [[] for _ in range(frames)]
    hidden: list[list[int]] = [[] for _ in range(frames)]
    for f in range(frames):
        canvas = ground.copy()
        for i, m in enumerate(movers, 1):
            if (box := m.box(f)) is not None and f in m.hidden:
                hidden[f].append(i)
            elif box is not None:
                _paste(canvas, m.patch, *m.corner(f), ground.mean() + m.level * (255.0 - ground.mean()))
                seen[f].append(Seen(i, box, m.label))
        canvas += rng.normal(0.0, params.noise_std, size=canvas.shape).astype(np.float32)
        pictures[f] = np.clip(canvas[:HEIGHT], 0, 255).round()
    return pictures, Truth(seed, FPS, WIDTH, HEIGHT, line.tolist(), seen, hidden, _crossings(line, movers, frames))


def write_mp4(path: Path, pictures: np.ndarray, fps: int = FPS) -> Path:
    """Grey ``pictures`` ``[F, H, W]`` as H.264 (libx264, yuv420p) at ``fps``, as tests/sources/video.py writes."""
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = pictures.shape[2], pictures.shape[1], "yuv420p"
        stream.time_base = time_base = Fraction(1, fps)
        stream.options = {"preset": "veryfast"}
        for index, picture in enumerate(pictures):
            frame = av.VideoFrame.from_ndarray(np.repeat(picture[..., None], 3, axis=2), format="rgb24")
            frame.pts, frame.time_base = index, time_base
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def clip(seed: int, folder: Path | None = None) -> tuple[Path, Truth]:
    """Clip ``seed``'s MP4 and truth (``clip-SEED-vVERSION.mp4`` and ``.json``) in ``folder`` (default
    ``$XDG_CACHE_HOME/visionserve/clips``, ``~/.cache`` without it), made unless already there."""
    folder = folder or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "visionserve" / "clips"
    video, written = folder / f"clip-{seed}-v{VERSION}.mp4", folder / f"clip-{seed}-v{VERSION}.json"
    if video.is_file() and written.is_file():
        return video, msgspec.json.decode(written.read_bytes(), type=Truth)
    folder.mkdir(parents=True, exist_ok=True)
    pictures, truth = render(seed)
    write_mp4(video.with_suffix(".partial.mp4"), pictures).replace(video)
    written.write_bytes(msgspec.json.encode(truth))
    return video, truth
