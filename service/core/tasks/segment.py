"""Instance segmentation: a detector whose every box carries its mask. A ``yolo-seg`` graph (ultralytics'
segmentation export: a YOLO head with 32 mask coefficients an anchor, and the prototypes) is read as a detector is,
suppressed with the request's options (detection's, and ``mask_format``), and each instance kept gets its mask:
its coefficients times the prototypes, resampled to the image's own pixels and cropped to its box
(:func:`service.core.masks.instance_masks`). What each protocol answers (each mask COCO's RLE, its polygons or a
PNG; v2's ``MASKS``): docs/tasks.md, "Segmentation".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from service.core.boxes import listed, to_original
from service.core.comparison import Comparison
from service.core.config import RolloutConfig
from service.core.layouts import anchor_rows, keep, seg_outputs
from service.core.masks import Mask, encoded, instance_masks, mask_ious, rles
from service.core.status import InferResult
from service.core.tasks.base import OutputSpec, OutputTensor, Post, Transforms, Want
from service.core.tasks.box_comparison import BoxComparison, box_f1
from service.core.tasks.detect import DETECTIONS, NUM_DETECTIONS, Detect, DetectOptions

MASKS = "MASKS"
# How each mask is written: one declaration for every task that answers masks (a segmenter's, a semantic model's).
MaskFormat = Annotated[
    Literal["rle", "polygon", "png"],
    msgspec.Meta(
        description="rle (COCO's compressed RLE), polygon (outer rings, holes apart) or png (base64)",
        extra={"v2": False},
    ),
]


class SegmentOptions(DetectOptions, frozen=True, kw_only=True):
    """A segmenter's options: detection's, and how each mask is written."""

    mask_format: MaskFormat = "rle"


class Instance(msgspec.Struct, frozen=True):
    """One object: its box (as a detection's), label, index, score, its mask's pixel count and its mask."""

    box: list[float]
    label: str
    index: int
    score: float
    area: int
    mask: Any


class SegmentResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image's answer from a segmenter: its size as a viewer shows it and its instances, best first; or the
    reason it could not be read."""

    filename: str | None = None
    width: int | None = None
    height: int | None = None
    instances: list[Instance] | None = None
    error: str | None = None


class SegmentResponse(msgspec.Struct):
    model: str
    version: int
    results: list[SegmentResult]


class Segment(Detect):
    name = "segment"
    summary = "Segment the objects in images"
    about = "Each image's objects, each a box and a mask in the image's own pixels, best first."
    Options = SegmentOptions
    result_type = SegmentResult
    response_type = SegmentResponse
    layouts = ("yolo-seg",)
    output_names = (DETECTIONS, NUM_DETECTIONS, MASKS)
    rows_field = boxes_field = "instances"
    gate = "masks"  # export's parity gate judges its boxes as a detector's, and its masks (export/detect_parity.py)

    @classmethod
    def graph_outputs(cls) -> tuple[str, ...]:
        return ("output0", "output1")  # as ultralytics names a segmentation export's

    def outputs(self) -> list[OutputSpec]:
        return [*super().outputs(), OutputSpec(MASKS, "BYTES", [self.default.max_detections])]

    def instances(
        self, result: InferResult, options: DetectOptions, transforms: Transforms = None
    ) -> tuple[list[np.ndarray], list[list[Any]], dict[int, str]]:
        """Each image's kept rows (in its own pixels) and each row's mask; and the images whose masks the model
        answered as NaN or infinite (no rows: that image fails alone)."""
        head_name, protos_name = seg_outputs(result.outputs)
        heads, protos = result.outputs[head_name], result.outputs[protos_name]
        classes, count = len(self.labels), protos.shape[1]
        each = [(t or self.input) for t in transforms] if transforms else [self.input] * len(heads)
        kept_rows, chosen, failed = [], [], {}
        for row, (head, proto, where) in enumerate(zip(heads, protos, each, strict=True)):
            values = np.asarray(head, dtype=np.float32)
            rows, anchors = anchor_rows(values[: 4 + classes], classes, options.score_threshold)
            kept = keep(self.layout, rows, options)
            coefficients = values[4 + classes : 4 + classes + count][:, _anchors_of(kept, rows, anchors)].T  # [M, P]
            if len(kept) and not (np.isfinite(coefficients).all() and np.isfinite(proto).all()):
                failed[row] = "the model answered masks that are not numbers (NaN or infinite)"
                kept, coefficients = kept[:0], coefficients[:0]
            chosen.append(coefficients)
            kept_rows.append(to_original(kept, where))
        # Every instance of the batch at once, each with its image's prototypes and transform.
        image = np.repeat(np.arange(len(kept_rows)), [len(k) for k in kept_rows])
        boxes = np.concatenate([k[:, :4] for k in kept_rows])
        found = instance_masks(np.concatenate(chosen), protos, boxes, [each[i] for i in image], self.size, image)
        ends = np.cumsum([len(k) for k in kept_rows]).tolist()
        masks = [found[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        return kept_rows, masks, failed

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        options: SegmentOptions = want.options or self.default
        kept, masks, failed = self.instances(result, options, transforms)
        each = [(t or self.input) for t in transforms] if transforms else [self.input] * len(kept)
        most = options.max_detections
        tensors = [
            masks_tensor([list(enumerate(found[:most])) for found in masks], most)
            if out.name == MASKS
            else self._tensor(out.name, kept, most)
            for out in want.outputs
        ]
        answers = []
        if not want.outputs:  # every mask written at once, then each row given its own
            written = iter(encoded([m for found in masks for m in found], options.mask_format))
            for k, found, t in zip(kept, masks, each, strict=True):
                rows = zip(listed(k, t, options, self.labels), found, strict=True)
                answers.append([{**d, "area": m.area, "mask": next(written)} for d, m in rows])
        return Post(tensors, answers, [len(k) for k in kept], failed)

    def comparison(self, config: RolloutConfig) -> Comparison:
        return MaskComparison(self, config)


def masks_tensor(found: list[list[tuple[int, Mask]]], columns: int) -> OutputTensor:
    """v2's ``MASKS``, BYTES ``[N, columns]``: each image's masks' RLE as JSON at their columns, empty elsewhere."""
    strings = []
    for pairs in found:
        row = [""] * columns
        for (c, _), text in zip(pairs, rles([m for _, m in pairs]), strict=True):
            if c < columns:
                row[c] = json.dumps(text)
        strings += row
    return OutputTensor(MASKS, "BYTES", [len(found), columns], strings=strings)


def _anchors_of(kept: np.ndarray, rows: np.ndarray, anchors: np.ndarray) -> np.ndarray:
    """The anchor each of the ``kept`` rows came from (suppression keeps rows, not their places): the row of its
    score, or, where two rows share a score, the row equal to it whole."""
    if not len(kept):
        return anchors[:0]
    first = (rows[None, :, 4] == kept[:, None, 4]).argmax(axis=1)
    if not (rows[first] == kept).all():
        first = (rows[None, :, :] == kept[:, None, :]).all(axis=2).argmax(axis=1)
    return anchors[first]


class MaskComparison(BoxComparison):
    """A candidate segmenter's instances beside the primary's: a detector's comparison (the same counts, verdict
    and summary), each pair matched on its masks' IoU (in the model's input pixels) rather than its boxes'."""

    measure = "mask agreement"
    what = "masks'"
    task: Segment

    def rows(self, result: InferResult, ok: list[int]) -> Any:
        """Each image's kept rows and their masks, in the input's pixels."""
        outputs = {name: array[ok] for name, array in result.outputs.items()}
        kept, masks, _ = self.task.instances(InferResult(outputs, [None] * len(ok)), self.options)
        return list(zip(kept, masks, strict=True))

    def agreement(self, primary: Any, candidate: Any) -> tuple[float, np.ndarray, np.ndarray]:
        (mine, my_masks), (theirs, their_masks) = primary, candidate
        return box_f1(mine, theirs, mask_ious(their_masks, my_masks))
