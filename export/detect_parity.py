"""The detection parity gate: eager PyTorch against a detector's artifact, on the candidates a request can see.

A classifier's gate (:mod:`export.parity`) measures relative logit error and top-1; on a detector's ``[N, K, 6]``
rows (x1, y1, x2, y2, score, class: ``output_layout`` "candidates") those measure nothing, so a detector is held to
this one. Per image:

- the *cut* is :data:`SCORE_THRESHOLD` (the lowest threshold the gate vouches for: AP's own, below which boxes add
  nothing measurable), raised to eager's K-th score when all K candidates are above it (the graph's top-K then
  decides which rows exist, not the threshold);
- eager's rows and the artifact's rows at or above the cut less ``score_margin`` are matched one to one, eager's in
  descending score order, each to an unmatched artifact row at IoU >= ``min_iou`` (the same class first, then the
  nearest score);
- every row at least ``score_margin`` above the cut, on either side, must have found its partner; rows within the
  margin of the cut are left out (an artifact's float error may move them across it) and counted;
- every matched pair involving such a row has the same class, and every matched pair's score differs by at most
  ``max_score_error``.

The artifact passes when no row is unmatched, classes agree on every pair and the score error is within bounds:
the figures (:class:`service.core.spec.DetectionParity`) are written into spec.json's export record.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from export.parity import FP16, FP32, ParityResult, Tolerance, compare
from service.core.errors import ConfigError
from service.core.layouts import image_rows, top_rows
from service.core.spec import DetectionParity, ModelSpec
from service.core.tasks import task_named

SCORE_THRESHOLD = 0.05  # models/detection_eval.py's: below it candidates add nothing measurable to AP
EMPTY_BOX_PX = 1e-3  # two empty boxes are the same box when their corners agree this closely, in input pixels
PARITY_ROWS = 300  # a layout read by the server: each image's best rows compared (an end-to-end YOLO's own K)
MASK_MIN_IOU = 0.99  # a segmenter's instance and its partner: their masks, in the input's pixels, overlap this much
BOXES = ("boxes", "masks")  # the gates that judge boxes (a segmenter's too)


class DetectTolerance(msgspec.Struct, frozen=True):
    min_iou: float  # a matched pair's boxes overlap at least this much
    max_score_error: float  # |eager - artifact| of a matched pair's scores
    score_margin: float  # rows this close to the cut are left out; above the score error, so a faithful
    # artifact's rows never cross it unseen
    score_threshold: float = SCORE_THRESHOLD


# fp32: sigmoid scores within 1e-4 (the classifier gate's bound on relative logit error, which a score, bounded by 1,
# inherits); boxes of input pixels within float error: IoU 0.99 is a 10-pixel box about 0.05 pixel off per edge.
DETECT_FP32 = DetectTolerance(min_iou=0.99, max_score_error=1e-4, score_margin=1e-3)
# fp16 (checked on a GPU only): half precision holds a coordinate near 96 to 1/16 pixel, which alone costs a 10-pixel
# box 0.01 of IoU; the classifier's fp16 bound of 2e-2 on the scores.
DETECT_FP16 = DetectTolerance(min_iou=0.97, max_score_error=2e-2, score_margin=4e-2)


@dataclass(frozen=True)
class ImageMatch:
    """One image's comparison: rows checked, rows without a partner, rows left out, and the matched pairs' worst
    IoU, worst score error and class disagreements."""

    boxes: int
    unmatched: int
    left_out: int
    pairs: int
    min_iou: float
    max_score_error: float
    class_mismatches: int


@dataclass(frozen=True)
class DetectParityResult:
    images: int
    boxes: int  # rows beyond the margin of the cut, eager's and the artifact's together
    unmatched: int
    left_out: int
    min_iou: float  # the lowest over every row beyond the margin of its best IoU with the other side's rows
    class_agreement: float  # of the matched pairs that involve a row beyond the margin
    max_score_error: float
    tolerance: DetectTolerance
    checked: bool = True
    note: str = ""
    error: str = ""
    masks: int | None = None  # a segmenter's instances beyond the margin, eager's and the artifact's together
    masks_unmatched: int = 0  # of those, without a partner at mask IoU >= MASK_MIN_IOU
    min_mask_iou: float = 1.0  # the lowest of an instance's best mask IoU with the other side's

    @property
    def passed(self) -> bool:
        if self.error:
            return False
        if not self.checked:
            return True
        return (
            self.masks_unmatched == 0
            and self.unmatched == 0
            and self.class_agreement == 1.0
            and self.max_score_error <= self.tolerance.max_score_error
            and self.min_iou >= self.tolerance.min_iou
        )

    @property
    def max_rel_error(self) -> float:
        """The export report's one-number column: the worst score error (a detector has no logits)."""
        return self.max_score_error

    def describe(self) -> str:
        if self.error:
            return f"FAIL: {self.error}"
        if not self.checked:
            return f"not checked ({self.note})"
        t = self.tolerance
        verdict = "pass" if self.passed else "FAIL"
        return (
            f"{verdict}: {self.boxes - self.unmatched}/{self.boxes} boxes matched at IoU >= {t.min_iou} (lowest "
            f"{self.min_iou:.4f}), class agreement {self.class_agreement:.2%}, max score error "
            f"{self.max_score_error:.2e} (limit {t.max_score_error:.0e}); {self.left_out} within {t.score_margin:g} "
            f"of the cut left out, on {self.images} images" + (f" ({self.note})" if self.note else "")
            + (f"; masks: {self.masks - self.masks_unmatched}/{self.masks} matched at IoU >= {MASK_MIN_IOU} (lowest "
               f"{self.min_mask_iou:.4f})" if self.masks is not None else "")
        )  # fmt: skip

    def record_fields(self) -> dict[str, Any]:
        """What spec.json's export record holds of this check."""
        t = self.tolerance
        record = DetectionParity(
            images=self.images, boxes=self.boxes, unmatched=self.unmatched, left_out=self.left_out,
            min_iou=self.min_iou, class_agreement=self.class_agreement, max_score_error=self.max_score_error,
            score_threshold=t.score_threshold, score_margin=t.score_margin, min_iou_limit=t.min_iou,
            max_score_error_limit=t.max_score_error, masks=self.masks,
            masks_unmatched=self.masks_unmatched if self.masks is not None else None,
            min_mask_iou=self.min_mask_iou if self.masks is not None else None,
            min_mask_iou_limit=MASK_MIN_IOU if self.masks is not None else None,
        )  # fmt: skip
        return {"detection_parity": record} if self.checked else {}


def _iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[len(a), len(b)]`` IoU of xyxy boxes. Two empty boxes (a zero width or height: a size head clamped at 0)
    have no area to compare: 1 where their corners agree to :data:`EMPTY_BOX_PX`, else 0."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(axis=2)
    area_a = np.clip(a[:, 2:] - a[:, :2], 0, None).prod(axis=1)
    area_b = np.clip(b[:, 2:] - b[:, :2], 0, None).prod(axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    same_corners = np.abs(a[:, None, :] - b[None, :, :]).max(axis=2) <= EMPTY_BOX_PX
    return np.where(union > 0, inter / np.maximum(union, 1e-12), same_corners.astype(np.float64))


def match_image(expected: np.ndarray, got: np.ndarray, tolerance: DetectTolerance) -> ImageMatch:
    """Compare one image's candidates ``[K, 6]``: eager's (``expected``) and the artifact's (``got``)."""
    cut = max(tolerance.score_threshold, float(expected[:, 4].min()) if len(expected) else 0.0)
    margin = tolerance.score_margin
    e = expected[expected[:, 4] >= cut - margin]
    e = e[np.argsort(-e[:, 4], kind="stable")]
    g = got[got[:, 4] >= cut - margin]
    e_sure, g_sure = e[:, 4] >= cut + margin, g[:, 4] >= cut + margin
    overlaps = _iou(e[:, :4], g[:, :4]) if len(e) and len(g) else np.zeros((len(e), len(g)))
    taken = np.zeros(len(g), bool)
    e_matched = np.zeros(len(e), bool)
    # Each row beyond the margin: its best overlap with any row of the other side (how far off an unmatched one is).
    best_e = overlaps.max(axis=1) if len(g) else np.zeros(len(e))
    best_g = overlaps.max(axis=0) if len(e) else np.zeros(len(g))
    min_iou = float(min(best_e[e_sure].min(initial=1.0), best_g[g_sure].min(initial=1.0)))
    worst, mismatches, pairs = 0.0, 0, 0
    for i, row in enumerate(e):
        free = np.flatnonzero(~taken & (overlaps[i] >= tolerance.min_iou))
        if len(free) == 0:
            continue
        same = g[free, 5] == row[5]
        pool = free[same] if same.any() else free
        j = int(pool[np.argmin(np.abs(g[pool, 4] - row[4]))])
        taken[j] = e_matched[i] = True
        pairs += 1
        min_iou = min(min_iou, float(overlaps[i, j]))
        worst = max(worst, float(abs(g[j, 4] - row[4])))
        mismatches += int(g[j, 5] != row[5] and (e_sure[i] or g_sure[j]))
    return ImageMatch(
        boxes=int(e_sure.sum() + g_sure.sum()),
        unmatched=int((e_sure & ~e_matched).sum() + (g_sure & ~taken).sum()),
        left_out=int((~e_sure).sum() + (~g_sure).sum()),
        pairs=pairs,
        min_iou=min_iou,
        max_score_error=worst,
        class_mismatches=mismatches,
    )


def compare_detections(
    reference: Sequence[np.ndarray],
    run: Callable[[np.ndarray], np.ndarray],
    batches: Sequence[np.ndarray],
    tolerance: DetectTolerance,
) -> DetectParityResult:
    """Run ``run`` on each batch and hold its candidates to ``reference`` (eager's, for the same batches)."""
    images = boxes = unmatched = left_out = pairs = mismatches = 0
    min_iou, worst = 1.0, 0.0
    for batch, expected in zip(batches, reference, strict=True):
        got = np.asarray(run(batch), dtype=np.float32)
        if got.shape != expected.shape:
            return DetectParityResult(images + len(batch), boxes, unmatched, left_out, 0.0, 0.0, math.inf, tolerance,
                                      note=f"shape {got.shape} != {expected.shape}")  # fmt: skip
        for mine, theirs in zip(got, expected, strict=True):
            m = match_image(theirs, mine, tolerance)
            boxes, unmatched, left_out = boxes + m.boxes, unmatched + m.unmatched, left_out + m.left_out
            pairs, mismatches = pairs + m.pairs, mismatches + m.class_mismatches
            min_iou, worst = min(min_iou, m.min_iou), max(worst, m.max_score_error)
        images += len(batch)
    agreement = 1.0 - mismatches / pairs if pairs else 1.0
    return DetectParityResult(images, boxes, unmatched, left_out, min_iou, agreement, worst, tolerance)


def reference_of(spec: ModelSpec, out: Any) -> Any:
    """What the gate keeps of eager's output on a batch (an array, or a dict of several outputs): what it compares
    (:func:`parity_rows`), or for a segmenter the outputs themselves (its masks are compared too)."""
    outputs = out if isinstance(out, dict) else {"output": out}
    return outputs if task_named(spec.task).gate == "masks" else parity_rows(spec, outputs)


def parity_rows(spec: ModelSpec, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """What the gate compares of a computed batch: a classifier's logits; a detector's candidate rows ``[N, K, 6]``
    (the graph's own for ``candidates``; for other layouts each image's :data:`PARITY_ROWS` best rows as the server
    reads them, :mod:`service.core.layouts`)."""
    if task_named(spec.task).gate not in BOXES or spec.output_layout == "candidates":
        return np.asarray(next(iter(outputs.values())), dtype=np.float32)
    rows = image_rows(spec.output_layout, outputs, spec.num_classes, SCORE_THRESHOLD)
    return top_rows(rows, PARITY_ROWS)


def check_parity(
    spec: ModelSpec,
    reference: Sequence[np.ndarray],
    run: Callable[[np.ndarray], Mapping[str, np.ndarray]],
    batches: Sequence[np.ndarray],
    precision: str,
) -> ParityResult | DetectParityResult:
    """The gate that fits ``spec``'s task: detection parity for a detector, logits and top-1 for a classifier;
    ``run`` answers a batch's named outputs (``reference``: :func:`parity_rows` of the reference's)."""

    def rows(batch: np.ndarray) -> np.ndarray:
        return parity_rows(spec, run(batch))

    gate = task_named(spec.task).gate
    tolerance = DETECT_FP32 if precision == "fp32" else DETECT_FP16
    if gate == "masks":
        return compare_masks(spec, reference, run, batches, tolerance)
    if gate == "boxes":
        return compare_detections(reference, rows, batches, tolerance)
    if gate == "pixels":
        return compare_pixels(reference, rows, batches, FP32 if precision == "fp32" else FP16)
    return compare(reference, rows, batches, FP32 if precision == "fp32" else FP16)


def compare_pixels(
    reference: Sequence[np.ndarray], run: Callable[[np.ndarray], np.ndarray], batches: Sequence[np.ndarray],
    tolerance: Tolerance,
) -> ParityResult:  # fmt: skip
    """A semantic model's gate: each pixel's logits ``[N, C, h, w]`` held as a classifier's are, and its class
    (``top1_agreement``: of the pixels whose two best logits are further apart than an error in bounds could close)."""
    worst, agree, pixels, images = 0.0, 0, 0, 0
    for batch, expected in zip(batches, reference, strict=True):
        got = np.asarray(run(batch), dtype=np.float32)
        images += len(batch)
        if got.shape != expected.shape:
            return ParityResult(images, math.inf, 0.0, tolerance, note=f"shape {got.shape} != {expected.shape}")
        scale = np.maximum(np.abs(expected).max(axis=1), 1e-12)
        worst = max(worst, float((np.abs(got - expected).max(axis=1) / scale).max()))
        top = np.sort(expected, axis=1)
        sure = top[:, -1] - top[:, -2] > 2 * tolerance.max_rel_error * scale
        agree += int((sure & (got.argmax(axis=1) == expected.argmax(axis=1))).sum())
        pixels += int(sure.sum())
    return ParityResult(images, worst, agree / max(pixels, 1), tolerance)


def compare_masks(
    spec: ModelSpec,
    reference: Sequence[Any],
    run: Callable[[np.ndarray], Mapping[str, np.ndarray]],
    batches: Sequence[np.ndarray],
    tolerance: DetectTolerance,
) -> DetectParityResult:
    """A segmenter's gate: its boxes as a detector's (:func:`compare_detections`), then its masks as the server
    answers them (in the input's pixels): every instance scored at least ``score_margin`` above the cut, on either
    side, matched one to one to an instance of its class on the other side scored above the cut less the margin,
    at mask IoU >= :data:`MASK_MIN_IOU`. ``reference``: eager's outputs on each batch, by name."""
    from service.core.boxes import match
    from service.core.masks import mask_ious
    from service.core.status import InferResult
    from service.core.tasks import Segment

    task = Segment(spec)
    cut = tolerance.score_threshold

    def instances(outputs: Mapping[str, np.ndarray], threshold: float) -> list[tuple[np.ndarray, list[Any]]]:
        options = msgspec.structs.replace(task.default, score_threshold=max(0.0, threshold))
        n = len(next(iter(outputs.values())))
        rows, masks, _ = task.instances(InferResult(dict(outputs), [None] * n), options)
        return list(zip(rows, masks, strict=True))

    answers = [run(batch) for batch in batches]
    shown = iter(answers)
    boxes = compare_detections([parity_rows(spec, r) for r in reference], lambda _: parity_rows(spec, next(shown)),
                               batches, tolerance)  # fmt: skip
    masks = unmatched = 0
    lowest = 1.0
    for expected, got in zip(reference, answers, strict=True):
        sides = [(instances(one, cut + tolerance.score_margin), instances(other, cut - tolerance.score_margin))
                 for one, other in ((expected, got), (got, expected))]  # fmt: skip
        for sure, near in sides:
            for (mine, my_masks), (theirs, their_masks) in zip(sure, near, strict=True):
                overlaps = mask_ious(my_masks, their_masks)
                # Two empty masks (a box narrower than a pixel, or nothing above 0.5) are the same mask.
                empty = np.array([m.area == 0 for m in my_masks], bool)[:, None]
                overlaps[empty & np.array([m.area == 0 for m in their_masks], bool)[None, :]] = 1.0
                found, _ = match(mine, theirs, MASK_MIN_IOU, overlaps)
                masks, unmatched = masks + len(mine), unmatched + len(mine) - len(found)
                if len(mine):
                    lowest = min(lowest, float(overlaps.max(axis=1, initial=0.0).min()))
    return replace(boxes, masks=masks, masks_unmatched=unmatched, min_mask_iou=lowest)


def refuse_unproved(spec: ModelSpec, *, formats: Sequence[str]) -> None:
    """Refuse what the detection gate does not prove yet, with the reason, before any work (a classifier passes)."""
    if task_named(spec.task).gate not in BOXES:
        return
    if "aoti" in formats:
        raise ConfigError(
            f"--formats aoti of {spec.name} is refused: it is a detector, and an AOTInductor package of one (its "
            f"top-K decoding compiled with a dynamic batch) has not been proved against eager; export onnx and "
            "torchscript, which the detection parity gate checks"
        )


def drop_refused(module: object, formats: Sequence[str]) -> tuple[tuple[str, ...], list[str]]:
    """``formats`` less those ``module`` refuses (its ``refused_formats``: format -> why; torchvision's detectors,
    ``models/tv_detectors.py``), and a note for each; refused outright when none is left."""
    refused: Mapping[str, str] = getattr(module, "refused_formats", {})
    kept = tuple(f for f in formats if f not in refused)
    notes = [f"{f} refused: {refused[f]}" for f in formats if f in refused]
    if not kept:
        raise ConfigError(f"--formats {','.join(formats)}: " + "; ".join(notes))
    return kept, notes
