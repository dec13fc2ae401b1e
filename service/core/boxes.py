"""Boxes: where an image went (:class:`Transform`), suppression, and the way back to the image's own pixels.

A detector sees the image after preprocessing (letterboxed, stretched or centre-cropped to its input) and answers
boxes in its input's pixels. Each image's :class:`Transform` (a few numbers, computed while it is decoded) says
how: ``input = original * scale + pad`` on each axis, the original being the image as a viewer shows it (EXIF
orientation applied, full size even where JPEG draft decoding decoded fewer pixels). :func:`to_original` inverts
it and clips to the image; mapping bugs of this kind are common in detectors' servers (ultralytics PR #23967,
yolov5 #4952), so the tests hold it against an independent formula.

:func:`suppress` is the server's one suppression (every protocol's detections come from it): score threshold,
class filter, greedy non-maximum suppression per class (torchvision's ``batched_nms`` offset trick: boxes of
different classes are moved apart so that they never overlap) or across classes, at most ``max_detections``.
numpy only: the serving install has no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import numpy as np

BoxFormat = Literal["xyxy", "xywh", "cxcywh"]
BOX_FORMATS: Final = ("xyxy", "xywh", "cxcywh")
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


@dataclass(frozen=True, slots=True)
class DetectOptions:
    """A request's suppression: boxes scoring below ``score_threshold`` are dropped, then of two boxes (of one class,
    or any two with ``class_agnostic``) overlapping by more than ``iou_threshold`` the lower scored one; at most
    ``max_detections`` are kept, best first. ``classes``: class indices to keep (None: all)."""

    score_threshold: float = 0.25
    iou_threshold: float = 0.45
    max_detections: int = 100
    classes: tuple[int, ...] | None = None
    class_agnostic: bool = False
    box_format: BoxFormat = "xyxy"
    normalized: bool = False


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


def iou_one(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Intersection over union of one xyxy ``box`` with each of ``boxes`` ``[M, 4]``."""
    w = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None)
    h = np.clip(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None)
    inter = w * h
    area = max(box[2] - box[0], 0) * max(box[3] - box[1], 0)
    areas = np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)
    union = area + areas - inter
    return np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)


def suppress(candidates: np.ndarray, options: DetectOptions) -> np.ndarray:
    """The detections kept of one image's candidates ``[K, 6]`` (x1, y1, x2, y2, score, class), best first:
    ``[M, 6]`` float32, M <= ``options.max_detections``."""
    rows = np.asarray(candidates, dtype=np.float32).reshape(-1, 6)
    keep = rows[:, SCORE] >= options.score_threshold
    keep &= np.isfinite(rows).all(axis=1)
    if options.classes is not None:
        keep &= np.isin(rows[:, CLASS], np.asarray(options.classes, dtype=np.float32))
    rows = rows[keep]
    rows = rows[np.argsort(-rows[:, SCORE], kind="stable")]
    boxes = rows[:, :4].astype(np.float64)
    if not options.class_agnostic and len(rows):
        # Each class moved past every other one's boxes: one suppression then never compares two classes.
        span = float(np.abs(boxes).max()) * 2 + 1
        boxes = boxes + (rows[:, CLASS : CLASS + 1].astype(np.float64) * span)
    chosen: list[int] = []
    alive = np.ones(len(rows), dtype=bool)
    for i in range(len(rows)):
        if not alive[i]:
            continue
        chosen.append(i)
        if len(chosen) == options.max_detections:
            break
        rest = i + 1 + np.flatnonzero(alive[i + 1 :])
        alive[rest[iou_one(boxes[i], boxes[rest]) > options.iou_threshold]] = False
    return rows[chosen]


def to_original(detections: np.ndarray, transform: Transform) -> np.ndarray:
    """``detections`` ``[M, 6]`` with their boxes taken from input pixels to the original image's, clipped to it
    (a copy)."""
    out = np.array(detections, dtype=np.float32, copy=True).reshape(-1, 6)
    t = transform
    out[:, [X1, X2]] = np.clip((out[:, [X1, X2]] - t.pad_x) / t.scale_x, 0, t.width)
    out[:, [Y1, Y2]] = np.clip((out[:, [Y1, Y2]] - t.pad_y) / t.scale_y, 0, t.height)
    return out


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
