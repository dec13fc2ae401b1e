"""Semantic segmentation: one class a pixel. The graph's one output is each class's logits over its input
(``[N, C, h, w]``, torchvision's ``lraspp``/``deeplabv3`` ``out``); each image's answer is a mask for every class
that wins some pixel of it, in the image's own pixels (:func:`service.core.masks.class_masks`), written as a
segmenter's; a rollout compares the two versions' class maps (:class:`PixelComparison`). What each protocol
answers: docs/tasks.md, "Semantic segmentation".
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
import numpy as np

from service.core.boxes import identity
from service.core.comparison import Comparison
from service.core.config import RolloutConfig
from service.core.masks import class_masks, encoded
from service.core.status import InferResult
from service.core.tasks.base import OutputSpec, Post, Task, Transforms, Want
from service.core.tasks.options import Options
from service.core.tasks.segment import MASKS, MaskFormat, masks_tensor


class SemanticOptions(Options, frozen=True, kw_only=True):
    """A semantic model's options: which classes' masks, and how each is written."""

    classes: Annotated[tuple[int, ...] | None, msgspec.Meta(
        description="only these classes' masks (labels or indices)", extra={"kind": "classes"})] = None  # fmt: skip
    mask_format: MaskFormat = "rle"


class ClassMask(msgspec.Struct, frozen=True):
    label: str
    index: int
    area: int
    mask: Any


class SemanticResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image's answer from a semantic model: its size and a mask for each class present; or why not."""

    filename: str | None = None
    width: int | None = None
    height: int | None = None
    classes: list[ClassMask] | None = None
    error: str | None = None


class SemanticResponse(msgspec.Struct):
    model: str
    version: int
    results: list[SemanticResult]


class Semantic(Task):
    name = "semantic"
    summary = "Label every pixel of images"
    about = "Each image's classes present, a mask each in the image's own pixels."
    Options = SemanticOptions
    output_name = "masks"
    output_names = (MASKS,)
    gate = "pixels"
    resize = "letterbox"
    result_type = SemanticResult
    response_type = SemanticResponse
    rows_field = "classes"

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.size = (spec.input.width, spec.input.height)
        self.input = identity(*self.size)

    def outputs(self) -> list[OutputSpec]:
        return [OutputSpec(MASKS, "BYTES", [len(self.labels)])]

    def masks(self, result: InferResult, options: SemanticOptions, transforms: Transforms) -> list[list[Any]]:
        """Each image's (class, mask) pairs, by class index."""
        logits = result.logits
        each = [(t or self.input) for t in transforms] if transforms else [self.input] * len(logits)
        return [class_masks(row, where, self.size, options.classes) for row, where in zip(logits, each, strict=True)]

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        options: SemanticOptions = want.options or self.default
        found = self.masks(result, options, transforms)
        reason = "the model answered logits that are not numbers (NaN or infinite)"
        failed = {row: reason for row, logits in enumerate(result.logits) if not np.isfinite(logits).all()}
        found = [[] if row in failed else pairs for row, pairs in enumerate(found)]
        if want.outputs:
            return Post([masks_tensor(found, len(self.labels))], [], None, failed)
        answers = [
            [
                {"label": self._label(c), "index": c, "area": m.area, "mask": e}
                for (c, m), e in zip(pairs, encoded([m for _, m in pairs], options.mask_format), strict=True)
            ]
            for pairs in found
        ]
        return Post([], answers, None, failed)

    def _label(self, c: int) -> str:
        return self.labels[c] if c < len(self.labels) else str(c)

    def comparison(self, config: RolloutConfig) -> Comparison:
        return PixelComparison(list(self.labels), confidence=config.confidence, min_agreement=config.min_box_f1)


class PixelComparison(Comparison):
    """A candidate's class maps beside the primary's: an image agrees when the share of the model's pixels given
    the same class is at least ``min_agreement`` (``[rollout] min_box_f1``)."""

    def __init__(self, labels: list[str], *, confidence: float, min_agreement: float) -> None:
        super().__init__(labels, confidence=confidence)
        self.measure = "pixel agreement"
        self.min_agreement = min_agreement
        self.share_sum = 0.0

    def rows(self, result: InferResult, ok: list[int]) -> np.ndarray:
        return np.asarray(result.logits[ok]).argmax(axis=1)  # [N, h, w]: each grid cell's class

    def record(
        self, primary: np.ndarray, candidate: np.ndarray, primary_s: float, candidate_s: float,
        sizes: tuple[int, int] = (1, 1),
    ) -> None:  # fmt: skip
        n = len(primary)
        if n == 0:
            return
        same = primary == candidate if primary.shape == candidate.shape else np.zeros(primary.shape, dtype=bool)
        shares = same.reshape(n, -1).mean(axis=1)
        self.share_sum += float(shares.sum())
        self.agreed += int((shares >= self.min_agreement).sum())
        self.samples += n
        self.record_times(n, primary_s, candidate_s, sizes)

    def summary(self) -> dict[str, Any]:
        out = super().summary()
        out.update(
            measure=f"images whose class maps agree with the primary's on >= {self.min_agreement:g} of the pixels",
            topk=None,
            topk_overlap=None,
            pixel_agreement_mean=self.share_sum / self.samples if self.samples else None,
        )
        return out
