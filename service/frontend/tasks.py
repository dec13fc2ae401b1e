"""What a model's answers mean: its task, one class per task behind one small interface (:class:`Task`).

The engine never knows tasks: it batches uint8 tensors and answers what the model computed (each of the model's
named outputs, batch-first, in its own dtype and per-image shape: :class:`~service.core.status.InferResult`). A
task turns that into what the protocols answer, in one function (:meth:`Task.postprocess`): the v2 output tensors,
which HTTP and gRPC write alike (:class:`OutputTensor`), and each image's top-k predictions (the image API and the
streams). It also says which outputs a v2 request may ask for (:meth:`Task.wanted`) and lists them in metadata
(:meth:`Task.outputs`). A new task is one new class here plus its encoders; no protocol handler changes.

Detection (:class:`Detect`) suppresses each image's candidates with the request's thresholds
(:func:`~service.core.boxes.suppress`) and maps the boxes kept to the image's own pixels with the transform its
decoding recorded (input pixels for a v2 ``INPUT``, which has none).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.core.boxes import DetectOptions, Transform, identity, listed, to_original
from service.core.errors import BadInputError
from service.core.layouts import image_rows, keep, suppresses
from service.core.scores import classification_strings, predictions, softmax
from service.core.spec import ModelSpec
from service.core.status import InferResult
from service.frontend.detect_options import v2_options
from service.frontend.parameters import classification_k, flag

LOGITS = "LOGITS"
DETECTIONS, NUM_DETECTIONS = "DETECTIONS", "NUM_DETECTIONS"
_LITTLE_ENDIAN = {"FP32": "<f4", "UINT8": "u1", "INT32": "<i4"}
Transforms = Sequence[Transform | None] | None  # each computed row's, where its image was decoded here


@dataclass(frozen=True, slots=True)
class Wanted:
    """One requested output, checked before any work is done: its name, the classification extension's k (None:
    the tensor itself) and whether it goes in the binary part (HTTP only; gRPC answers raw contents always)."""

    name: str
    k: int | None = None
    binary: bool = False


@dataclass(frozen=True, slots=True)
class Want:
    """What an answer holds: the v2 ``outputs`` asked for, and ``top_k`` predictions per image (0: none); a
    detector's suppression (``detect``; None: its defaults)."""

    outputs: tuple[Wanted, ...] = ()
    top_k: int = 0
    detect: DetectOptions | None = None


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """An output as metadata lists it: name, v2 datatype and the dims of one image's row."""

    name: str
    datatype: str
    dims: list[int]


@dataclass(slots=True)
class OutputTensor:
    """One v2 output, built once (by the task) and written by each wire: HTTP's JSON ``data`` or binary part,
    gRPC's ``raw_output_contents``. It holds an ``array`` or, for BYTES, ``strings``."""

    name: str
    datatype: str
    shape: list[int]
    array: np.ndarray | None = None
    strings: list[str] = field(default_factory=list)

    def raw(self) -> bytes:
        """The binary form: little-endian elements, or BYTES as length-prefixed strings."""
        if self.array is None:
            return bytes_tensor(self.strings)
        return np.ascontiguousarray(self.array, dtype=_LITTLE_ENDIAN[self.datatype]).tobytes()

    def values(self) -> list[Any]:
        """The JSON form: the elements flattened row by row."""
        return self.strings if self.array is None else self.array.ravel().tolist()


def bytes_tensor(elements: list[str]) -> bytes:
    """The binary form of a BYTES tensor of strings: each a 4-byte little-endian length, then its UTF-8 bytes."""
    encoded = [e.encode() for e in elements]
    return b"".join(struct.pack("<I", len(e)) + e for e in encoded)


@dataclass(slots=True)
class Post:
    """A task's answer to one computed batch: the v2 tensors asked for, each row's predictions (top-k classes, or
    detections), and a detector's count of detections per row (the metrics' histogram)."""

    tensors: list[OutputTensor]
    predictions: list[list[dict[str, object]]]
    detections: list[int] | None = None


class Task(Protocol):
    """A model's task: what its outputs are, which a request may ask for, and what they mean."""

    name: str

    def outputs(self) -> list[OutputSpec]:
        """The outputs metadata lists."""
        ...

    def wanted(self, outputs: list[tuple[str, dict[str, Any]]], binary: bool = False) -> tuple[Wanted, ...]:
        """The v2 outputs a request names (its default when it names none), each parameter checked; ``binary``:
        the request's ``binary_data_output``, which an output's ``binary_data`` overrides."""
        ...

    def options(self, params: Mapping[str, Any]) -> DetectOptions | None:
        """A v2 request's task parameters (a detector's thresholds), checked; None where the task has none."""
        ...

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        """What ``result`` means, in the forms ``want`` asks for; ``transforms``: each row's image's (a
        detector maps its boxes back with them)."""
        ...


class Classify:
    """Classification: one ``LOGITS`` row per image; Triton's classification extension ("score:index:label" of
    the k best logits) on any output; softmax top-k predictions for the image API and streams."""

    name = "classify"

    def __init__(self, labels: tuple[str, ...], classes: int) -> None:
        self.labels = labels
        self.classes = classes

    def outputs(self) -> list[OutputSpec]:
        return [OutputSpec(LOGITS, "FP32", [self.classes])]

    def wanted(self, outputs: list[tuple[str, dict[str, Any]]], binary: bool = False) -> tuple[Wanted, ...]:
        wanted = []
        for i, (name, params) in enumerate(outputs or [(LOGITS, {})]):
            if name != LOGITS:
                raise BadInputError(f"unknown output {name!r}: this model has LOGITS")
            where = f"outputs[{i}].parameters"
            k = params.get("classification")
            if k is not None:
                k = classification_k(k, self.classes, f"{where}.classification")
            wanted.append(Wanted(name, k, flag(f"{where}.binary_data", params.get("binary_data"), binary)))
        return tuple(wanted)

    def options(self, params: Mapping[str, Any]) -> DetectOptions | None:
        return None

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        logits = result.logits  # a classifier's one output
        tensors = [self._tensor(logits, out) for out in want.outputs]
        best = predictions(softmax(logits), self.labels, want.top_k) if want.top_k else []
        return Post(tensors, best)

    def _tensor(self, logits: np.ndarray, out: Wanted) -> OutputTensor:
        if out.k is None:
            return OutputTensor(out.name, "FP32", list(logits.shape), logits)
        flat = [s for row in classification_strings(logits, self.labels, out.k) for s in row]
        return OutputTensor(out.name, "BYTES", [logits.shape[0], out.k], strings=flat)


class Detect:
    """Detection: the graph's outputs read as each image's candidate rows (x1, y1, x2, y2 in input pixels, score,
    class; :mod:`service.core.layouts`), suppressed per image with the request's :class:`DetectOptions` (or, for a
    graph that suppresses itself, only thresholded and selected). v2 answers ``DETECTIONS``
    (FP32 ``[N, max_detections, 6]``, the rows past an image's count zero) and ``NUM_DETECTIONS`` (INT32 ``[N]``);
    the image API and streams each image's ``{"box", "label", "index", "score"}``, best first."""

    name = "detect"

    def __init__(self, spec: ModelSpec) -> None:
        self.labels = spec.labels
        self.default = DetectOptions(max_detections=spec.max_detections)
        self.input = identity(spec.input.width, spec.input.height)
        self.layout = spec.output_layout
        self.suppresses = suppresses(spec.output_layout)

    def refuse_suppression(self, given: Sequence[str]) -> None:
        """Refuse a request's suppression options (``given``: those it set) on a graph that suppresses itself:
        they would act on nothing."""
        if given and not self.suppresses:
            raise BadInputError(
                f"{' and '.join(given)}: this detector's graph suppresses its own boxes (output_layout "
                f"{self.layout}), so the server suppresses nothing; score_threshold, classes and max_detections apply"
            )

    def outputs(self) -> list[OutputSpec]:
        return [
            OutputSpec(DETECTIONS, "FP32", [self.default.max_detections, 6]),
            OutputSpec(NUM_DETECTIONS, "INT32", []),
        ]

    def wanted(self, outputs: list[tuple[str, dict[str, Any]]], binary: bool = False) -> tuple[Wanted, ...]:
        wanted = []
        for i, (name, params) in enumerate(outputs or [(DETECTIONS, {}), (NUM_DETECTIONS, {})]):
            if name not in (DETECTIONS, NUM_DETECTIONS):
                raise BadInputError(f"unknown output {name!r}: this detector has {DETECTIONS} and {NUM_DETECTIONS}")
            if params.get("classification") is not None:
                raise BadInputError(f"outputs[{i}].parameters.classification is for classifiers, not detector outputs")
            where = f"outputs[{i}].parameters.binary_data"
            wanted.append(Wanted(name, None, flag(where, params.get("binary_data"), binary)))
        return tuple(wanted)

    def options(self, params: Mapping[str, Any]) -> DetectOptions | None:
        self.refuse_suppression([name for name in ("iou_threshold", "class_agnostic") if name in params])
        return v2_options(params, self.labels, self.default)

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        options = want.detect or self.default
        rows = image_rows(self.layout, result.outputs, len(self.labels), options.score_threshold)
        each = [(t or self.input) for t in transforms] if transforms else [self.input] * len(rows)
        kept = [to_original(keep(self.layout, r, options), t) for r, t in zip(rows, each, strict=True)]
        tensors = [self._tensor(out.name, kept, options.max_detections) for out in want.outputs]
        answers = [] if want.outputs else [listed(k, t, options, self.labels) for k, t in zip(kept, each, strict=True)]
        return Post(tensors, answers, [len(k) for k in kept])

    def _tensor(self, name: str, kept: list[np.ndarray], most: int) -> OutputTensor:
        if name == NUM_DETECTIONS:
            counts = np.array([len(k) for k in kept], dtype=np.int32)
            return OutputTensor(name, "INT32", [len(kept)], counts)
        out = np.zeros((len(kept), most, 6), dtype=np.float32)
        for row, k in enumerate(kept):
            out[row, : len(k)] = k
        return OutputTensor(name, "FP32", list(out.shape), out)


def task_for(spec: ModelSpec) -> Task:
    """The task of a model, from its spec."""
    if spec.task == "detect":
        return Detect(spec)
    return Classify(spec.labels, spec.num_classes)
