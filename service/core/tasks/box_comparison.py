"""A candidate detector's boxes beside the primary's: the evidence a detector's rollout decides on.

Top-1 says nothing about boxes. Each compared image is read as the server answers it (the model's output layout,
suppressed with the default options: :func:`service.core.layouts.keep`), and the candidate's boxes are matched one
to one to the primary's, best scored first, of the same class at IoU >= 0.5. The image *agrees* when the F1 of that
matching (twice the pairs over both counts of boxes; 1 when neither found any) is at least ``[rollout]
min_box_f1``; agreement is then a binomial proportion over images, with the same Wilson interval, promotion and
abort as a classifier's (:func:`service.core.comparison.verdict`). The summary adds the F1's mean, a histogram of
the matched pairs' IoU, and the score shift of matched pairs (the candidate's score minus the primary's).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.core.boxes import iou_matrix, match
from service.core.comparison import SHIFT_EDGES, Comparison
from service.core.config import RolloutConfig
from service.core.layouts import image_rows, keep
from service.core.status import InferResult

MATCH_IOU = 0.5
IOU_EDGES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def box_f1(
    primary: np.ndarray, candidate: np.ndarray, overlaps: np.ndarray | None = None
) -> tuple[float, np.ndarray, np.ndarray]:
    """(F1, the matched pairs' IoU, the matched pairs' score shift) of one image's kept rows ``[M, 6]``;
    ``overlaps``: each candidate row's IoU with each primary row where not their boxes' (a segmenter's masks')."""
    if len(primary) == 0 or len(candidate) == 0:  # agreeing when neither found any
        return float(len(primary) == len(candidate)), np.zeros(0), np.zeros(0)
    rows, cols = match(candidate, primary, MATCH_IOU, overlaps)  # best scored first, each to its best free partner
    if overlaps is None:
        overlaps = iou_matrix(candidate[:, :4], primary[:, :4])
    ious = overlaps[rows, cols] if len(rows) else np.zeros(0)
    shifts = (candidate[rows, 4] - primary[cols, 4]).astype(np.float64)
    return 2.0 * len(rows) / (len(primary) + len(candidate)), ious, shifts


class BoxComparison(Comparison):
    """:class:`Comparison` for detectors: the same counts, latencies and verdict, agreement judged on boxes."""

    measure = "box agreement"
    what = "boxes'"

    def __init__(self, task: Any, config: RolloutConfig) -> None:  # a Detect (or Segment): its labels, layout, default
        super().__init__(list(task.labels), confidence=config.confidence)
        self.task = task
        self.min_box_f1 = config.min_box_f1
        self.options = task.default  # the model's defaults: both versions' boxes as the server answers them
        self.f1_sum = 0.0
        self.pairs = 0
        self.iou_counts = [0] * (len(IOU_EDGES) - 1)

    def rows(self, result: InferResult, ok: list[int]) -> list[np.ndarray]:  # type: ignore[override]
        outputs = {name: array[ok] for name, array in result.outputs.items()}
        found = image_rows(self.task.layout, outputs, len(self.labels), self.options.score_threshold)
        return [keep(self.task.layout, rows, self.options) for rows in found]

    def record(  # type: ignore[override]
        self,
        primary: list[np.ndarray],
        candidate: list[np.ndarray],
        primary_s: float,
        candidate_s: float,
        sizes: tuple[int, int] = (1, 1),
    ) -> None:
        """Both versions' kept rows for the same images, as :meth:`rows` reads them."""
        n = len(primary)
        if n == 0:
            return
        for mine, theirs in zip(primary, candidate, strict=True):
            f1, ious, shifts = self.agreement(mine, theirs)
            self.f1_sum += f1
            self.agreed += int(f1 >= self.min_box_f1)
            self.pairs += len(ious)
            self.shift_sum += float(shifts.sum())
            for counts, edges, values in ((self.iou_counts, IOU_EDGES, ious), (self.shift_counts, SHIFT_EDGES, shifts)):
                for bucket in np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(counts) - 1):
                    counts[int(bucket)] += 1
        self.samples += n
        self.record_times(n, primary_s, candidate_s, sizes)

    def agreement(self, primary: Any, candidate: Any) -> tuple[float, np.ndarray, np.ndarray]:
        """One image's (F1, the matched pairs' IoU, their score shifts), as :func:`box_f1` reads them."""
        return box_f1(primary, candidate)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(
            measure=f"images whose {self.what} F1 against the primary's (same class, IoU >= {MATCH_IOU}) >= "
            f"{self.min_box_f1:g}",
            topk=None,
            topk_overlap=None,
            box_f1_mean=self.f1_sum / self.samples if self.samples else None,
            box_iou={"edges": list(IOU_EDGES), "counts": list(self.iou_counts), "pairs": self.pairs},
            score_shift={
                "edges": list(SHIFT_EDGES),
                "counts": list(self.shift_counts),
                "mean": self.shift_sum / self.pairs if self.pairs else None,
            },
        )
        return out
