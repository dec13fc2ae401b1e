"""Detection: the graph's outputs read as each image's candidate rows (x1, y1, x2, y2 in input pixels, score,
class; :mod:`service.core.layouts`), suppressed per image with the request's :class:`DetectOptions` (or, for a
graph that suppresses itself, only thresholded and selected) and mapped to the image's own pixels with the
transform its decoding recorded (input pixels for a v2 ``INPUT``, which has none). v2 answers ``DETECTIONS``
(FP32 ``[N, max_detections, 6]``, the rows past an image's count zero) and ``NUM_DETECTIONS`` (INT32 ``[N]``); the
image API, streams and sources each image's ``{"box", "label", "index", "score"}``, best first."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Final, Literal

import msgspec
import numpy as np

from service.core.answers import DetectResponse, DetectResult
from service.core.boxes import identity, listed, to_original
from service.core.comparison import Comparison
from service.core.config import RolloutConfig
from service.core.errors import BadInputError
from service.core.layouts import image_rows, keep, suppresses
from service.core.status import InferResult
from service.core.tasks.base import OutputSpec, OutputTensor, Post, Task, Transforms, Want
from service.core.tasks.box_comparison import BoxComparison
from service.core.tasks.options import Options, fields

DETECTIONS, NUM_DETECTIONS = "DETECTIONS", "NUM_DETECTIONS"
MAX_DETECTIONS: Final = 10_000  # the most a request may ask for: a cap on its answer's size
_ROWS = {"v2": False}  # an option of the answer's rows: v2's DETECTIONS are xyxy in pixels always


class DetectOptions(Options, frozen=True, kw_only=True):
    """A detector's options: boxes scoring below ``score_threshold`` are dropped, then of two boxes (of one class,
    or any two with ``class_agnostic``) overlapping by more than ``iou_threshold`` the lower scored one; at most
    ``max_detections`` are kept, best first. ``classes``: class indices to keep (None: all)."""

    score_threshold: Annotated[float, msgspec.Meta(ge=0, le=1, description="boxes scoring less are dropped")] = 0.25
    iou_threshold: Annotated[float, msgspec.Meta(
        ge=0, le=1, description="of two boxes overlapping more, the lower scored is dropped",
        extra={"suppression": True})] = 0.45  # fmt: skip
    max_detections: Annotated[
        int, msgspec.Meta(ge=1, le=MAX_DETECTIONS, description="at most this many boxes an image")
    ] = 100
    classes: Annotated[tuple[int, ...] | None, msgspec.Meta(
        description="keep only these classes (labels or indices)", extra={"kind": "classes"})] = None  # fmt: skip
    class_agnostic: Annotated[
        bool, msgspec.Meta(description="suppress across classes", extra={"suppression": True})
    ] = False
    box_format: Annotated[
        Literal["xyxy", "xywh", "cxcywh"], msgspec.Meta(description="xyxy, xywh (corner, size) or cxcywh", extra=_ROWS)
    ] = "xyxy"
    normalized: Annotated[
        bool, msgspec.Meta(description="boxes as fractions of the image's width and height", extra=_ROWS)
    ] = False


class Detect(Task):
    name = "detect"
    summary = "Detect objects in images"
    about = "Each image's boxes in its own pixels, best first."
    Options = DetectOptions
    layouts: ClassVar[tuple[str, ...]] = ("candidates", "yolo", "yolov5", "end2end", "efficientnms")
    output_name = "candidates"
    output_names: ClassVar[tuple[str, ...]] = (DETECTIONS, NUM_DETECTIONS)
    rows_field = boxes_field = "detections"
    gate = "boxes"
    resize = "letterbox"  # as YOLO exports are
    unit_input = True
    result_type: ClassVar[type[msgspec.Struct]] = DetectResult
    response_type: ClassVar[type[msgspec.Struct]] = DetectResponse

    def __init__(self, spec: Any) -> None:
        super().__init__(spec)
        self.size = (spec.input.width, spec.input.height)
        self.input = identity(*self.size)
        self.layout = spec.output_layout
        self.suppresses = suppresses(spec.output_layout)

    def defaults(self, spec: Any) -> DetectOptions:
        return self.Options(max_detections=spec.max_detections)

    def options(self, values: Mapping[str, Any], **how: Any) -> Any:
        """As every task's, and a graph that suppresses its own boxes refuses the suppression's options: they would
        act on nothing."""
        named = [f.name for f in fields(DetectOptions) if f.suppression and f.name in values]
        if named and not self.suppresses:
            raise BadInputError(
                f"{' and '.join(named)}: this detector's graph suppresses its own boxes (output_layout "
                f"{self.layout}), so the server suppresses nothing; score_threshold, classes and max_detections apply"
            )
        return super().options(values, **how)

    def outputs(self) -> list[OutputSpec]:
        return [
            OutputSpec(DETECTIONS, "FP32", [self.default.max_detections, 6]),
            OutputSpec(NUM_DETECTIONS, "INT32", []),
        ]

    def classification(self, k: Any, where: str) -> int | None:
        if k is not None:
            raise BadInputError(f"{where} is for classifiers, not detector outputs")
        return None

    def kept(self, result: InferResult, options: DetectOptions, transforms: Transforms = None) -> list[np.ndarray]:
        """Each image's boxes kept (rows x1, y1, x2, y2, score, class in its own pixels, best first)."""
        rows = image_rows(self.layout, result.outputs, len(self.labels), options.score_threshold)
        each = [(t or self.input) for t in transforms] if transforms else [self.input] * len(rows)
        return [to_original(keep(self.layout, r, options), t) for r, t in zip(rows, each, strict=True)]

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        options: DetectOptions = want.options or self.default
        kept = self.kept(result, options, transforms)
        tensors = [self._tensor(out.name, kept, options.max_detections) for out in want.outputs]
        each = [(t or self.input) for t in transforms] if transforms else [self.input] * len(kept)
        answers = [] if want.outputs else [listed(k, t, options, self.labels) for k, t in zip(kept, each, strict=True)]
        return Post(tensors, answers, [len(k) for k in kept])

    def comparison(self, config: RolloutConfig) -> Comparison:
        return BoxComparison(self, config)

    def _tensor(self, name: str, kept: list[np.ndarray], most: int) -> OutputTensor:
        if name == NUM_DETECTIONS:
            counts = np.array([len(k) for k in kept], dtype=np.int32)
            return OutputTensor(name, "INT32", [len(kept)], counts)
        out = np.zeros((len(kept), most, 6), dtype=np.float32)
        for row, k in enumerate(kept):
            out[row, : len(k)] = k
        return OutputTensor(name, "FP32", list(out.shape), out)
