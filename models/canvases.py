"""Detection canvases: scikit-learn's bundled handwritten digits pasted onto generated grey images (no download).

Each canvas holds 1-5 digits of 12-40 px, each at its own contrast, some overlapping a little, some cut by the
border, over a noisy ground with blobs and lines as clutter. A digit's box is its ink's tight box (the pixels whose
ink is at least :data:`INK_THRESHOLD` of the digit's full strength), in pixels, xyxy with exclusive ends, clipped to
the canvas; its label is the digit, 0-9. Ink is bright on a dark ground, as in the digits classifier's images.

Canvases are grey ``[N, H, W]`` uint8: the detector takes three channels like every served model and averages
them into one inside its graph (``models/detector.py``), so a grey canvas, repeated three times, is exactly what it
sees when a photo is served, and a third of the memory here.

Held-out canvases are built only from the digits of the held-out split (the digits classifier's validation split,
:func:`digit_split`), so the detector is judged on handwriting it never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Literal

import msgspec
import numpy as np

from models.datasets import _split  # the classifier's split: held-out digits are its validation digits too

INK_THRESHOLD = 0.25  # of a digit's full strength (sklearn's 16): fainter anti-aliased fringe is not ink
_PLACEMENT_TRIES = 20  # positions tried for a digit before it is left out (its overlap with the others too high)
_CHUNK = 256  # canvases whose clutter is drawn at once: [chunk, slots, H, W] float32 stays near 30 MB


class CanvasParams(msgspec.Struct, frozen=True, kw_only=True):
    """Everything that decides a canvas stream; written into the training record as it is."""

    canvas_size: int = 96
    min_digits: int = 1
    max_digits: int = 5
    min_scale_px: int = 12  # a digit's pasted height; its width is that times an aspect in [min_aspect, 1.2]
    max_scale_px: int = 40
    min_aspect: float = 0.8
    min_contrast: float = 0.55  # the ink's level above the ground, as a share of the way to white
    max_contrast: float = 1.0
    max_overlap_iou: float = 0.2  # between two digits' ink boxes
    max_off_border: float = 0.3  # the share of a digit's patch that may lie outside the canvas, on each axis
    max_blobs: int = 3
    max_lines: int = 3
    noise_std: float = 6.0  # grey levels of Gaussian pixel noise
    seed: int = 0  # the training stream; step s of a run draws from (seed, s)
    heldout_seed: int = 1  # the held-out canvases: fixed, so mAP compares across training seeds

    def check(self) -> None:
        """Refuse settings that cannot make a canvas; each message names the field and the value."""
        if self.canvas_size < 16:
            raise ValueError(f"canvas_size must be >= 16, got {self.canvas_size}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits} and {self.max_digits}")
        if not 4 <= self.min_scale_px <= self.max_scale_px:
            raise ValueError(f"need 4 <= min_scale_px <= max_scale_px, got {self.min_scale_px}, {self.max_scale_px}")
        if not 0 <= self.max_off_border < 0.5:
            raise ValueError(f"max_off_border must be in [0, 0.5), got {self.max_off_border}")


@dataclass(frozen=True)
class Canvases:
    """A batch of canvases and their boxes, padded to ``max_digits`` a canvas (label -1 where there is none)."""

    images: np.ndarray  # uint8 [N, H, W]
    boxes: np.ndarray  # float32 [N, M, 4]: x1, y1, x2, y2 in pixels, clipped to the canvas
    labels: np.ndarray  # int64 [N, M]: 0-9, or -1 for padding
    digit_ids: np.ndarray  # int64 [N, M]: the index of the pasted digit in scikit-learn's 1,797, or -1
    masks: np.ndarray | None = None  # bool [N, M, H, W]: each digit's ink (its box's threshold), where asked for

    def __len__(self) -> int:
        return len(self.images)

    def objects(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Canvas ``i``'s boxes and labels, padding left out."""
        keep = self.labels[i] >= 0
        return self.boxes[i][keep], self.labels[i][keep]


@dataclass(frozen=True)
class DigitPool:
    """Digits to paste: ink strength in [0, 1] (``[D, 8, 8]``), their labels and their indices in the 1,797."""

    ink: np.ndarray
    labels: np.ndarray
    indices: np.ndarray


@cache
def _all_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    raw = load_digits()
    return (raw.images / 16.0).astype(np.float32), raw.target.astype(np.int64)


def digit_split() -> tuple[np.ndarray, np.ndarray]:
    """(training indices, held-out indices) of scikit-learn's 1,797 digits: the classifier's stratified split
    (``models/datasets.py``: 20% of each class, a fixed seed), so it never moves with the training seed."""
    _, targets = _all_digits()
    return _split(targets, 10)


def digit_pool(part: Literal["train", "heldout"]) -> DigitPool:
    """The digits that ``part``'s canvases are made of."""
    ink, targets = _all_digits()
    train, heldout = digit_split()
    indices = train if part == "train" else heldout
    return DigitPool(ink=ink[indices], labels=targets[indices], indices=indices)


@cache
def _resize_matrix(size: int) -> np.ndarray:
    """``[size, 8]``: bilinear weights (pixel centres aligned, edges clamped) taking 8 samples to ``size``."""
    centres = (np.arange(size) + 0.5) * (8.0 / size) - 0.5
    low = np.clip(np.floor(centres), 0, 7).astype(int)
    high = np.clip(low + 1, 0, 7)
    frac = np.clip(centres - low, 0.0, 1.0)
    m = np.zeros((size, 8), np.float32)
    m[np.arange(size), low] += 1.0 - frac
    m[np.arange(size), high] += frac
    return m


def _ink_box(patch: np.ndarray) -> tuple[int, int, int, int] | None:
    """The tight box (x1, y1, x2, y2, ends exclusive) of ``patch``'s ink, or None when it has none."""
    rows = np.flatnonzero(patch.max(axis=1) >= INK_THRESHOLD)
    cols = np.flatnonzero(patch.max(axis=0) >= INK_THRESHOLD)
    if len(rows) == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def _iou(a: tuple[float, ...], b: tuple[float, ...]) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def _grounds(params: CanvasParams, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` float32 grounds ``[n, S, S]`` in grey levels: a dark level, soft blobs and straight lines."""
    s = params.canvas_size
    ground = rng.uniform(0, 40, size=(n, 1, 1)).astype(np.float32)
    out = np.repeat(ground, s, axis=1).repeat(s, axis=2)
    if params.max_blobs:
        b = params.max_blobs
        on = np.arange(b) < rng.integers(0, b + 1, size=(n, 1))
        centres = rng.uniform(0, s, size=(2, n, b, 1)).astype(np.float32)
        sigma = rng.uniform(2, 10, size=(n, b, 1)).astype(np.float32)
        amp = (rng.uniform(30, 150, size=(n, b)) * on).astype(np.float32)[..., None]
        axis = np.arange(s, dtype=np.float32)
        # A Gaussian is the product of its two axes' Gaussians: two [n, b, S] exps instead of one [n, b, S, S].
        gx = amp * np.exp(-((axis - centres[0]) ** 2) / (2 * sigma**2))
        gy = np.exp(-((axis - centres[1]) ** 2) / (2 * sigma**2))
        out += (gy[..., :, None] * gx[..., None, :]).max(axis=1)
    if params.max_lines:
        _draw_lines(out, params, rng)
    return out


def _draw_lines(out: np.ndarray, params: CanvasParams, rng: np.random.Generator) -> None:
    """Straight strokes, 1 or 2 px wide and 15-90 px long, the strength of faint to middling ink, drawn into
    ``out`` by stamping points every half pixel along each (a distance field over every pixel took half of the
    generator's time)."""
    n, s, k = len(out), params.canvas_size, params.max_lines
    on = np.arange(k) < rng.integers(0, k + 1, size=(n, 1))
    start = rng.uniform(0, s, size=(2, n, k, 1))
    angle = rng.uniform(0, np.pi, size=(n, k, 1))
    length = rng.uniform(15, 90, size=(n, k, 1))
    level = rng.uniform(60, 200, size=(n, k, 1)).astype(np.float32)
    wide = rng.random(size=(n, k, 1)) < 0.5
    t = np.linspace(0.0, 1.0, 2 * 90 + 1)
    xs = start[0] + t * np.cos(angle) * length
    ys = start[1] + t * np.sin(angle) * length
    canvas = np.arange(n).reshape(n, 1, 1)
    flat = out.reshape(-1)
    for ox, oy in ((0, 0), (1, 0), (0, 1), (1, 1)):
        x = np.floor(xs).astype(np.int64) + ox
        y = np.floor(ys).astype(np.int64) + oy
        keep = on[..., None] & (x >= 0) & (x < s) & (y >= 0) & (y < s) & (wide | (ox + oy == 0))
        index = (canvas * s + y) * s + x
        np.maximum.at(flat, index[keep], np.broadcast_to(level, keep.shape)[keep])


def _place(
    params: CanvasParams, pool: DigitPool, rng: np.random.Generator
) -> list[tuple[int, np.ndarray, int, int, tuple[float, float, float, float]]]:
    """One canvas's digits: (pool index, ink patch, left, top, clipped ink box), each overlapping every earlier one
    by at most ``max_overlap_iou``; a digit with no such place in its tries is left out."""
    s = params.canvas_size
    count = int(rng.integers(params.min_digits, params.max_digits + 1))
    placed: list[tuple[int, np.ndarray, int, int, tuple[float, float, float, float]]] = []
    for _ in range(count):
        d = int(rng.integers(len(pool.labels)))
        h = int(rng.integers(params.min_scale_px, params.max_scale_px + 1))
        w = max(4, round(h * rng.uniform(params.min_aspect, 1.2)))
        patch = _resize_matrix(h) @ pool.ink[d] @ _resize_matrix(w).T
        ink = _ink_box(patch)
        if ink is None:
            continue
        off_x, off_y = params.max_off_border * w, params.max_off_border * h
        lefts = rng.uniform(-off_x, s - w + off_x, size=_PLACEMENT_TRIES).round().astype(int)
        tops = rng.uniform(-off_y, s - h + off_y, size=_PLACEMENT_TRIES).round().astype(int)
        for left, top in zip(lefts.tolist(), tops.tolist(), strict=True):
            x1, y1, x2, y2 = (
                float(min(max(v, 0), s)) for v in (left + ink[0], top + ink[1], left + ink[2], top + ink[3])
            )
            if x2 - x1 < 2 or y2 - y1 < 2:
                continue
            if all(_iou((x1, y1, x2, y2), other[4]) <= params.max_overlap_iou for other in placed):
                placed.append((d, patch, left, top, (x1, y1, x2, y2)))
                break
    return placed


def _paste(canvas: np.ndarray, patch: np.ndarray, left: int, top: int, level: float) -> None:
    """Blend ``patch`` (ink strength) into ``canvas`` at (left, top), the ink ``level`` grey levels strong."""
    s = canvas.shape[0]
    x0, y0 = max(left, 0), max(top, 0)
    x1, y1 = min(left + patch.shape[1], s), min(top + patch.shape[0], s)
    alpha = patch[y0 - top : y1 - top, x0 - left : x1 - left]
    region = canvas[y0:y1, x0:x1]
    region += alpha * (level - region)


def make_canvases(
    params: CanvasParams, count: int, *, pool: DigitPool, seed: int | tuple[int, ...], masks: bool = False
) -> Canvases:
    """``count`` canvases drawn from ``pool``; the same ``params``, pool and ``seed`` give the same canvases (and,
    with ``masks``, each digit's instance mask: the pixels of its patch whose ink is at least the box's
    :data:`INK_THRESHOLD`, a segmenter's truth)."""
    params.check()
    rng = np.random.default_rng(seed)
    s, m = params.canvas_size, params.max_digits
    inks = np.zeros((count, m, s, s), bool) if masks else None
    images = np.empty((count, s, s), np.uint8)
    boxes = np.zeros((count, m, 4), np.float32)
    labels = np.full((count, m), -1, np.int64)
    digit_ids = np.full((count, m), -1, np.int64)
    for start in range(0, count, _CHUNK):
        grounds = _grounds(params, min(_CHUNK, count - start), rng)
        for j, canvas in enumerate(grounds):
            i = start + j
            for slot, (d, patch, left, top, box) in enumerate(_place(params, pool, rng)):
                ground = float(canvas.mean())
                contrast = rng.uniform(params.min_contrast, params.max_contrast)
                _paste(canvas, patch, left, top, ground + contrast * (255.0 - ground))
                boxes[i, slot] = box
                labels[i, slot] = pool.labels[d]
                if inks is not None:
                    y0, x0 = max(top, 0), max(left, 0)
                    ink = patch[y0 - top : s - top, x0 - left : s - left] >= INK_THRESHOLD
                    inks[i, slot, y0 : y0 + ink.shape[0], x0 : x0 + ink.shape[1]] = ink
                digit_ids[i, slot] = pool.indices[d]
        grounds += rng.normal(0.0, params.noise_std, size=grounds.shape).astype(np.float32)  # over the ink too
        images[start : start + len(grounds)] = np.clip(grounds, 0, 255).round().astype(np.uint8)
    return Canvases(images=images, boxes=boxes, labels=labels, digit_ids=digit_ids, masks=inks)
