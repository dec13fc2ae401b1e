"""Boxes: where an image went (:class:`Transform`), suppression, and the way back to the image's own pixels.

A detector sees the image after preprocessing (letterboxed, stretched or centre-cropped to its input) and answers
boxes in its input's pixels. Each image's :class:`Transform` (a few numbers, computed while it is decoded) says
how: ``input = original * scale + pad`` on each axis, the original being the image as a viewer shows it (EXIF
orientation applied, full size even where JPEG draft decoding decoded fewer pixels). :func:`to_original` inverts
it and clips to the image; mapping bugs of this kind are common in detectors' servers (ultralytics PR #23967,
yolov5 #4952), so the tests hold it against an independent formula.

:func:`suppress` is the server's one suppression (every protocol's detections come from it): score threshold,
class filter, greedy non-maximum suppression per class (two boxes of different classes never suppress each other)
or across classes, at most ``max_detections``.
numpy only: the serving install has no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

BoxFormat = Literal["xyxy", "xywh", "cxcywh"]
# Columns of a candidate or detection row: x1, y1, x2, y2, score, class index.
X1, Y1, X2, Y2, SCORE, CLASS = range(6)


@dataclass(frozen=True, slots=True)
class Transform:
    """How one image became the model's input: ``input = original * scale + pad`` per axis. ``width`` and
    ``height`` are the original's, as a viewer shows it (EXIF orientation applied)."""

    width: int
    height: int
    scale_x: float = 1.0
    scale_y: float = 1.0
    pad_x: float = 0.0
    pad_y: float = 0.0


class Suppression(Protocol):
    """What suppression and the answer's rows read of a request's options
    (:class:`~service.core.tasks.detect.DetectOptions`): boxes scoring below ``score_threshold`` are dropped, then of
    two boxes (of one class, or any two with ``class_agnostic``) overlapping by more than ``iou_threshold`` the lower
    scored one; at most ``max_detections`` are kept, best first. ``classes``: class indices to keep (None: all)."""

    @property
    def score_threshold(self) -> float: ...
    @property
    def iou_threshold(self) -> float: ...
    @property
    def max_detections(self) -> int: ...
    @property
    def classes(self) -> tuple[int, ...] | None: ...
    @property
    def class_agnostic(self) -> bool: ...
    @property
    def box_format(self) -> BoxFormat: ...
    @property
    def normalized(self) -> bool: ...


def letterbox_geometry(width: int, height: int, in_w: int, in_h: int) -> tuple[int, int, int, int]:
    """(new_w, new_h, left, top): an image of ``width`` x ``height`` scaled to fit ``in_w`` x ``in_h`` with its
    aspect kept (at least one pixel each way), placed in the centre."""
    scale = min(in_w / width, in_h / height)
    new_w = min(in_w, max(1, round(width * scale)))
    new_h = min(in_h, max(1, round(height * scale)))
    return new_w, new_h, (in_w - new_w) // 2, (in_h - new_h) // 2


def letterbox_transform(width: int, height: int, in_w: int, in_h: int) -> Transform:
    """The letterbox's transform, with the scale the resize actually used on each axis (rounded sizes)."""
    new_w, new_h, left, top = letterbox_geometry(width, height, in_w, in_h)
    return Transform(width, height, new_w / width, new_h / height, float(left), float(top))


def stretch_transform(width: int, height: int, in_w: int, in_h: int) -> Transform:
    return Transform(width, height, in_w / width, in_h / height)


def identity(in_w: int, in_h: int) -> Transform:
    """Boxes of an input given as pixels (v2 ``INPUT``): answered in the input's pixels, clipped to it."""
    return Transform(in_w, in_h)


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of each xyxy box of ``a`` ``[P, 4]`` with each of ``b`` ``[Q, 4]``: ``[P, Q]``
    float32, the candidates' own precision (0 where the union is empty)."""
    # Each coordinate as its own contiguous vector, and np.maximum(x, 0) rather than np.clip: the [P, Q] arrays are
    # then made by contiguous inner loops (a strided or [P, Q, 2] broadcast was 10x slower) in few calls.
    ax1, ay1, ax2, ay2 = np.array(a, dtype=np.float32).T.copy()
    bx1, by1, bx2, by2 = (ax1, ay1, ax2, ay2) if a is b else np.array(b, dtype=np.float32).T.copy()
    w = np.minimum(ax2[:, None], bx2) - np.maximum(ax1[:, None], bx1)
    h = np.minimum(ay2[:, None], by2) - np.maximum(ay1[:, None], by1)
    inter = np.maximum(w, 0, out=w) * np.maximum(h, 0, out=h)
    area_a = np.maximum(ax2 - ax1, 0) * np.maximum(ay2 - ay1, 0)
    area_b = area_a if a is b else np.maximum(bx2 - bx1, 0) * np.maximum(by2 - by1, 0)
    union = area_a[:, None] + area_b - inter
    # An empty union has no intersection either: 0 / tiny is the 0 it answers, and any real union is above tiny.
    return inter / np.maximum(union, _TINY)


_TINY = np.finfo(np.float32).tiny


def suppress(candidates: np.ndarray, options: Suppression) -> np.ndarray:
    """The detections kept of one image's candidates ``[K, 6]`` (x1, y1, x2, y2, score, class), best first:
    ``[M, 6]`` float32, M <= ``options.max_detections``.

    Greedy suppression with no Python loop per box: the candidates' overlaps as one matrix, settled at once
    (:func:`_greedy`), a block of :data:`BLOCK` at a time; past :data:`GROUP_ABOVE` candidates, class by class.
    The score threshold runs first, on the score column alone: a trained head's 1,000 candidates leave a handful
    above it, and the rest of the work is on those (docs/performance.md, "Detection": 0.045 ms an image at 1,000
    candidates, where the loop per kept box it replaced took 0.33 ms, the same detections).
    """
    rows = select(candidates, options.score_threshold, options.classes)
    most = options.max_detections
    if len(rows) <= 1:
        return rows[:most]
    boxes, classes = rows[:, :4], rows[:, CLASS]
    if len(rows) <= SMALL:
        return rows[_few(rows.tolist(), options.iou_threshold, options.class_agnostic)][:most]
    if options.class_agnostic:
        kept = _nms(boxes, None, options.iou_threshold, most)
    elif len(rows) <= GROUP_ABOVE:
        kept = _nms(boxes, classes, options.iou_threshold, most)
    else:  # classes never suppress each other: each class alone, its own (smaller) overlap matrices
        order = np.argsort(classes, kind="stable")  # grouped by class, each group best first
        groups = np.split(order, np.flatnonzero(np.diff(classes[order])) + 1)
        kept = np.sort(np.concatenate([g[_nms(boxes[g], None, options.iou_threshold, most)] for g in groups]))
    return rows[kept[:most]]


def select(rows: np.ndarray, threshold: float, classes: tuple[int, ...] | None, most: int | None = None) -> np.ndarray:
    """The rows ``[K, 6]`` at or above ``threshold``, finite, of ``classes`` (None: all), best first, at most
    ``most``: what :func:`suppress` suppresses, and a graph's own suppressed rows as asked (nothing suppressed)."""
    rows = np.asarray(rows, dtype=np.float32).reshape(-1, 6)
    rows = rows[rows[:, SCORE] >= threshold]  # NaN scores fail this too
    if len(rows) and not np.isfinite(rows).all():
        rows = rows[np.isfinite(rows).all(axis=1)]
    if classes is not None:
        rows = rows[np.isin(rows[:, CLASS], np.asarray(classes, dtype=np.float32))]
    return (rows[np.argsort(-rows[:, SCORE], kind="stable")] if len(rows) > 1 else rows)[:most]


# Up to this many boxes above the threshold, a plain loop over Python floats: a trained head leaves a few (4.2 an
# image for digits-detect at 1,000 candidates), where the matrix's dozen numpy calls cost more than the work.
SMALL = 12
BLOCK = 256  # candidates settled at once: a [256, 256] overlap matrix, and few blocks before max_detections
# Past this many candidates above the threshold, suppression runs class by class: a matrix per class holds a
# fraction of the pairs of one matrix for all (measured: a dense head's 1,000 candidates, ~240 above 0.25).
GROUP_ABOVE = 64


def _few(rows: list[list[float]], iou_threshold: float, agnostic: bool) -> list[int]:
    """Greedy suppression of a handful of rows (best first), each against those kept before it: what is kept."""
    kept: list[int] = []
    for i, (x1, y1, x2, y2, _, cls) in enumerate(rows):
        area = max(x2 - x1, 0.0) * max(y2 - y1, 0.0)
        for j in kept:
            a1, b1, a2, b2, _, other = rows[j]
            if not agnostic and other != cls:
                continue
            inter = max(min(x2, a2) - max(x1, a1), 0.0) * max(min(y2, b2) - max(y1, b1), 0.0)
            union = area + max(a2 - a1, 0.0) * max(b2 - b1, 0.0) - inter
            if union > 0 and inter / union > iou_threshold:
                break
        else:
            kept.append(i)
    return kept


def _nms(boxes: np.ndarray, classes: np.ndarray | None, iou_threshold: float, most: int) -> np.ndarray:
    """Indices of ``boxes`` (best first) that greedy suppression keeps, in order, at least the first ``most``
    of them; two boxes of different ``classes`` never suppress each other (None: any two may)."""
    if len(boxes) <= BLOCK:  # one block, nothing kept before it: the usual case
        alone = _overlapping(boxes, None, classes, slice(None), slice(None), iou_threshold)
        return np.flatnonzero(_greedy(alone, np.ones(len(boxes), dtype=bool)))
    kept = np.zeros(0, dtype=np.intp)
    for start in range(0, len(boxes), BLOCK):
        block = slice(start, start + BLOCK)
        alive: np.ndarray = np.ones(len(boxes[block]), dtype=bool)
        if len(kept):
            earlier = _overlapping(boxes[kept], boxes[block], classes, kept, block, iou_threshold)
            alive = np.logical_not(earlier.any(axis=0))
        inside = _overlapping(boxes[block], None, classes, block, block, iou_threshold)
        kept = np.concatenate([kept, start + np.flatnonzero(_greedy(inside, alive))])
        if len(kept) >= most:
            break
    return kept


def _overlapping(
    a: np.ndarray, b: np.ndarray | None, classes: np.ndarray | None, rows: Any, cols: Any, iou_threshold: float
) -> np.ndarray:
    """``[P, Q]``: box ``a[p]`` overlaps ``b[q]`` (``b`` None: ``a`` itself) by more than ``iou_threshold`` and,
    where ``classes`` are given, has its class (``classes[rows]`` against ``classes[cols]``)."""
    over = iou_matrix(a, a if b is None else b) > iou_threshold
    if classes is not None:
        over &= classes[rows][:, None] == classes[cols]
    return over


_UPPER = np.triu(np.ones((BLOCK, BLOCK), dtype=bool), 1)  # [i, j]: box i is the better one (i < j)


def _greedy(over: np.ndarray, alive: np.ndarray) -> np.ndarray:
    """Which of a block's boxes (best first) greedy suppression keeps: ``over[i, j]``, box i overlaps box j too
    much; ``alive``, not suppressed from outside the block. A box is kept when no kept better box overlaps it: a
    triangular system, solved by repeating ``keep = alive & no kept better box overlaps`` from "all alive". After
    t rounds every box whose chain of better overlapping boxes is shorter than t is settled, so it reaches the
    greedy answer (its one fixed point) in at most the chain's length: a few rounds on real candidates."""
    n = len(alive)
    over &= _UPPER[:n, :n]
    if not over.any():  # nothing in the block overlaps: the common case after the score threshold
        return alive
    keep = alive
    for _ in range(n):
        now = alive & ~over[keep].any(axis=0)
        if not (now ^ keep).any():
            break
        keep = now
    return keep


def match(
    found: np.ndarray, truth: np.ndarray, min_iou: float = 0.5, overlaps: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """One-to-one matches of ``found`` rows ``[M, 6]`` to ``truth`` rows ``[G, 6]`` (their scores unused): the
    best scored found row first, each to the free truth box of its class it overlaps most, at IoU >= ``min_iou``
    (``overlaps``: the pairs' IoU ``[M, G]`` where not the boxes', a segmenter's masks'). (found indices, truth
    indices) of the pairs, in that order."""
    if len(found) == 0 or len(truth) == 0:
        return np.zeros(0, dtype=np.intp), np.zeros(0, dtype=np.intp)
    overlaps = iou_matrix(found[:, :4], truth[:, :4]) if overlaps is None else np.array(overlaps, dtype=np.float32)
    overlaps[found[:, CLASS][:, None] != truth[:, CLASS][None, :]] = 0.0
    taken = np.zeros(len(truth), dtype=bool)
    pairs: list[tuple[int, int]] = []
    for i in np.argsort(-found[:, SCORE], kind="stable"):
        row = np.where(taken, 0.0, overlaps[i])
        j = int(row.argmax())
        if row[j] >= min_iou:
            taken[j] = True
            pairs.append((int(i), j))
    rows, cols = zip(*pairs, strict=True) if pairs else ((), ())
    return np.asarray(rows, dtype=np.intp), np.asarray(cols, dtype=np.intp)


def to_original(detections: np.ndarray, transform: Transform) -> np.ndarray:
    """``detections`` ``[M, 6]`` with their boxes taken from input pixels to the original image's, clipped to it
    (a copy)."""
    out = np.array(detections, dtype=np.float32, copy=True).reshape(-1, 6)
    t = transform
    box = out[:, :4]
    pad, scale, size = np.array(
        [[t.pad_x, t.pad_y] * 2, [t.scale_x, t.scale_y] * 2, [t.width, t.height] * 2], dtype=np.float32
    )
    box -= pad
    box /= scale
    np.minimum(np.maximum(box, 0, out=box), size, out=box)
    return out


def listed(kept: np.ndarray, where: Transform, options: Suppression, labels: tuple[str, ...]) -> list[dict[str, Any]]:
    """One image's kept rows (in its own pixels) as answers list them, best first: ``{"box", "label", "index",
    "score"}``, the box in ``options``' format (a class past the labels is named by its index)."""
    boxes = formatted(kept[:, :4], options.box_format, where.width, where.height, options.normalized).tolist()
    classes = kept[:, CLASS].astype(np.int64).tolist()
    return [
        {"box": box, "label": labels[c] if 0 <= c < len(labels) else str(c), "index": c, "score": score}
        for box, c, score in zip(boxes, classes, kept[:, SCORE].tolist(), strict=True)
    ]


def formatted(boxes: np.ndarray, box_format: BoxFormat, width: int, height: int, normalized: bool) -> np.ndarray:
    """xyxy ``boxes`` ``[M, 4]`` as ``box_format`` (xyxy; xywh: corner and size; cxcywh: centre and size), divided
    by the image's width and height where ``normalized``."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    if box_format == "xywh":
        b = np.stack([x1, y1, x2 - x1, y2 - y1], axis=1)
    elif box_format == "cxcywh":
        b = np.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], axis=1)
    if normalized:
        b = b / np.array([width, height, width, height], dtype=np.float64)
    return b
