"""Classification: one ``LOGITS`` row per image; Triton's classification extension ("score:index:label" of the k
best logits) on any output; softmax top-k predictions for the image API, streams and sources."""

from __future__ import annotations

from collections.abc import Collection
from typing import Annotated, Any

import msgspec
import numpy as np

from service.core.answers import ClassifyResponse, ImageResult
from service.core.boxes import Transform
from service.core.comparison import Comparison
from service.core.config import RolloutConfig
from service.core.parameters import MAX_TOP_K, classification_k
from service.core.scores import classification_strings, predictions, softmax
from service.core.status import InferResult
from service.core.tasks.base import OutputSpec, OutputTensor, Post, Task, Transforms, Want, Wanted
from service.core.tasks.options import Options

LOGITS = "LOGITS"


class ClassifyOptions(Options, frozen=True, kw_only=True):
    """A classifier's options."""

    top_k: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOP_K, description="classes per image", extra={"v2": False})] = 5


class Classify(Task):
    name = "classify"
    summary = "Classify images"
    about = "The k best classes of each image, softmax scores."
    Options = ClassifyOptions
    output_name = "logits"
    output_names = (LOGITS,)
    gate = "top1"
    result_type = ImageResult
    response_type = ClassifyResponse
    rows_field = "predictions"

    def outputs(self) -> list[OutputSpec]:
        return [OutputSpec(LOGITS, "FP32", [len(self.labels)])]

    def classification(self, k: Any, where: str) -> int | None:
        return None if k is None else classification_k(k, len(self.labels), where)

    @classmethod
    def named_outputs(cls, options: Any, given: Collection[str]) -> list[tuple[str, dict[str, Any]]]:
        # top_k, given, asks for the classification extension's k best, as "score:index:label" strings.
        return [(LOGITS, {"classification": options.top_k})] if "top_k" in given else []

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        logits = result.logits  # a classifier's one output
        tensors = [self._tensor(logits, out) for out in want.outputs]
        k = (want.options or self.default).top_k
        best = [] if want.outputs else predictions(softmax(logits), self.labels, k)
        return Post(tensors, best)

    def comparison(self, config: RolloutConfig) -> Comparison:
        return Comparison(list(self.labels), confidence=config.confidence)  # top-1 classes

    def fields(self, rows: list[dict[str, Any]], shown: Transform | None) -> dict[str, Any]:
        return {self.rows_field: rows}  # no size: a class is of the whole image

    def _tensor(self, logits: np.ndarray, out: Wanted) -> OutputTensor:
        if out.k is None:
            return OutputTensor(out.name, "FP32", list(logits.shape), logits)
        flat = [s for row in classification_strings(logits, self.labels, out.k) for s in row]
        return OutputTensor(out.name, "BYTES", [logits.shape[0], out.k], strings=flat)
