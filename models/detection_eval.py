"""Detection quality: all-point average precision per class at an IoU threshold, and its mean over classes (mAP).

The definition is :data:`AP_DEFINITION` (PASCAL VOC 2010 onwards, and COCO's per-threshold AP without its 101-point
sampling): AP is the area under the precision-recall curve made monotone, summed at every point where recall
changes. Detections are suppressed per class first (:func:`suppress`, torchvision's ``batched_nms``), as the server
does with its own implementation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

AP_DEFINITION = (
    "all-point interpolated AP per class (every detection by descending score, greedy one-to-one matching to the "
    "best-overlapping box of its class at IoU >= the threshold, duplicates false positives), after per-class "
    "suppression; mAP = the mean over classes that have boxes"
)
SCORE_THRESHOLD = 0.05  # candidates below this add nothing measurable to AP and cost matching time
NMS_IOU = 0.5
MAX_PER_IMAGE = 100


@dataclass(frozen=True)
class Detections:
    """One image's boxes (``[D, 4]`` xyxy), scores ``[D]`` and class indices ``[D]``."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray


@dataclass(frozen=True)
class APReport:
    """AP per class (NaN for a class with no box) at ``iou``, and their mean over the classes that have boxes."""

    iou: float
    per_class: tuple[float, ...]
    mean: float


def suppress(
    candidates: torch.Tensor,
    *,
    score_threshold: float = SCORE_THRESHOLD,
    iou_threshold: float = NMS_IOU,
    max_detections: int = MAX_PER_IMAGE,
) -> list[Detections]:
    """Per-image, per-class non-maximum suppression of ``[N, K, 6]`` candidates (the detector's output)."""
    from torchvision.ops import batched_nms

    out = []
    for rows in candidates.detach().float().cpu():
        rows = rows[rows[:, 4] >= score_threshold]
        keep = batched_nms(rows[:, :4], rows[:, 4], rows[:, 5].long(), iou_threshold)[:max_detections]
        kept = rows[keep].numpy()
        out.append(Detections(boxes=kept[:, :4], scores=kept[:, 4], classes=kept[:, 5].astype(np.int64)))
    return out


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[len(a), len(b)]`` IoU of xyxy boxes."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(axis=2)
    area_a = (a[:, 2] - a[:, 0]) * (a[:, 3] - a[:, 1])
    area_b = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def _match(boxes: np.ndarray, truth: np.ndarray, iou: float) -> np.ndarray:
    """True positive flags of ``boxes`` (in descending score order) against one image's ``truth`` boxes."""
    tp = np.zeros(len(boxes), bool)
    if len(truth) == 0 or len(boxes) == 0:
        return tp
    overlaps = box_iou(boxes, truth)
    taken = np.zeros(len(truth), bool)
    for i, row in enumerate(overlaps):
        best = int(row.argmax())
        if row[best] >= iou and not taken[best]:
            taken[best] = True
            tp[i] = True
    return tp


def all_point_ap(scores: np.ndarray, tp: np.ndarray, positives: int) -> float:
    """Area under the monotone precision-recall curve of detections with ``scores`` and true-positive flags."""
    if positives == 0:
        return float("nan")
    order = np.argsort(-scores, kind="stable")
    hits = np.cumsum(tp[order])
    recall = np.concatenate([[0.0], hits / positives])
    precision = np.concatenate([[1.0], hits / np.arange(1, len(order) + 1)])
    precision = np.maximum.accumulate(precision[::-1])[::-1]
    return float(np.sum((recall[1:] - recall[:-1]) * precision[1:]))


def average_precision(
    detections: Sequence[Detections],
    truth: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    num_classes: int,
    iou: float = 0.5,
) -> APReport:
    """AP per class and mAP of ``detections`` against ``truth`` (per image: boxes ``[G, 4]``, labels ``[G]``)."""
    if len(detections) != len(truth):
        raise ValueError(f"{len(detections)} images of detections against {len(truth)} of ground truth")
    scores: list[list[np.ndarray]] = [[] for _ in range(num_classes)]
    hits: list[list[np.ndarray]] = [[] for _ in range(num_classes)]
    positives = np.zeros(num_classes, np.int64)
    for found, (boxes, labels) in zip(detections, truth, strict=True):
        positives += np.bincount(labels, minlength=num_classes)[:num_classes]
        for c in np.unique(found.classes):
            mine = np.flatnonzero(found.classes == c)
            mine = mine[np.argsort(-found.scores[mine], kind="stable")]
            scores[c].append(found.scores[mine])
            hits[c].append(_match(found.boxes[mine], boxes[labels == c], iou))
    per_class = tuple(
        all_point_ap(
            np.concatenate(scores[c]) if scores[c] else np.zeros(0),
            np.concatenate(hits[c]) if hits[c] else np.zeros(0, bool),
            int(positives[c]),
        )
        for c in range(num_classes)
    )
    present = [ap for ap in per_class if not np.isnan(ap)]
    return APReport(iou=iou, per_class=per_class, mean=float(np.mean(present)) if present else float("nan"))
