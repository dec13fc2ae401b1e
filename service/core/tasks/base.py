"""What a model's answers mean: its task (:class:`Task`), one module per task in this package, chosen by the
name in the model's spec (:func:`service.core.tasks.task_for`).

The engine never knows tasks: it batches uint8 tensors and answers what the model computed (each of the model's
named outputs, batch-first, in its own dtype and per-image shape: :class:`~service.core.status.InferResult`). A
task declares once what every protocol, the clients, the benchmarks and the gates read: its options
(:attr:`Task.Options`, one msgspec Struct: :mod:`service.core.tasks.options`), the v2 outputs it answers and which
a request may ask for (:meth:`Task.outputs`, :meth:`Task.wanted`), what a computed batch means
(:meth:`Task.postprocess`: the v2 tensors, which HTTP and gRPC write alike, and each image's rows in its own
pixels) and each image's answer (:meth:`Task.result` for the image API, :meth:`Task.fields` for streams and
sources). No module outside this package names a task.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgspec
import numpy as np

from service.core.boxes import Transform
from service.core.comparison import Comparison
from service.core.config import RolloutConfig
from service.core.errors import BadInputError
from service.core.parameters import flag
from service.core.status import InferResult
from service.core.tasks.options import Options, read

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
    """What an answer holds: the v2 ``outputs`` asked for (none: each image's rows), and the task's options (None:
    the model's defaults)."""

    outputs: tuple[Wanted, ...] = ()
    options: Any = None


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
        """The binary form: little-endian elements, or BYTES as strings each after its 4-byte little-endian length."""
        if self.array is None:
            return b"".join(struct.pack("<I", len(e)) + e for e in (s.encode() for s in self.strings))
        return np.ascontiguousarray(self.array, dtype=_LITTLE_ENDIAN[self.datatype]).tobytes()

    def values(self) -> list[Any]:
        """The JSON form: the elements flattened row by row."""
        return self.strings if self.array is None else self.array.ravel().tolist()


@dataclass(slots=True)
class Post:
    """A task's answer to one computed batch: the v2 tensors asked for, each row's predictions (top-k classes, or
    detections), and a detector's count of detections per row (the metrics' histogram)."""

    tensors: list[OutputTensor]
    predictions: list[list[dict[str, object]]]
    detections: list[int] | None = None
    failed: dict[int, str] = field(default_factory=dict)  # rows whose answer the model spoilt (NaN masks): why


class Task:
    """A model's task: its options, what its outputs are, which a request may ask for, and what they mean.
    A subclass sets :attr:`name` (the spec's ``task``, and the image API's route), :attr:`Options`,
    :attr:`result_type`, :attr:`response_type` and :attr:`rows_field` (the image API's answer), and implements the
    methods."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what the image API's route does, and what it answers
    about: ClassVar[str]
    Options: ClassVar[type[Options]]
    result_type: ClassVar[type[msgspec.Struct]]
    response_type: ClassVar[type[msgspec.Struct]]
    rows_field: ClassVar[str]  # the answer's list of rows (:meth:`fields`)
    boxes_field: ClassVar[str | None] = None  # the answer's list of boxed objects, which streams may track
    # What export and the spec read: the ``output_layout`` values its graph's outputs may be read by
    # (:mod:`service.core.layouts`), the output an export of ours names, what export's parity and INT8 gates judge
    # (``top1``: logits and top-1 classes; ``boxes``: matched boxes), and an outside model's preprocessing unless
    # told (``unit_input``: x / 255, mean 0 and std 1, rather than ImageNet's normalisation).
    layouts: ClassVar[tuple[str, ...]] = ()
    output_name: ClassVar[str]
    output_names: ClassVar[tuple[str, ...]]  # the v2 outputs it answers (how a client tells the task of a model)
    gate: ClassVar[str]
    resize: ClassVar[str] = "center_crop"
    unit_input: ClassVar[bool] = False

    def __init__(self, spec: Any) -> None:
        self.labels = spec.labels
        self.default: Any = self.defaults(spec)

    @classmethod
    def graph_outputs(cls) -> tuple[str, ...]:
        """The names an export of ours gives its graph's outputs, in order."""
        return (cls.output_name,)

    def defaults(self, spec: Any) -> Any:
        """The options a request that sets none has, for the model of ``spec`` (as declared, unless the spec
        says otherwise)."""
        return self.Options()

    def options(self, values: Mapping[str, Any], **how: Any) -> Any:
        """This task's options from ``values`` (a query, a JSON body, v2 parameters, keywords), each checked:
        :func:`~service.core.tasks.options.read`'s ``where``, ``said``, ``text``, ``v2`` and ``before``."""
        return read(self.Options, values, self.labels, default=self.default, **how)

    def outputs(self) -> list[OutputSpec]:
        """The outputs metadata lists."""
        raise NotImplementedError

    def wanted(self, outputs: list[tuple[str, dict[str, Any]]], binary: bool = False) -> tuple[Wanted, ...]:
        """The v2 outputs a request names (all it answers when it names none), each parameter checked; ``binary``:
        the request's ``binary_data_output``, which an output's ``binary_data`` overrides."""
        wanted = []
        for i, (name, params) in enumerate(outputs or [(name, {}) for name in self.output_names]):
            if name not in self.output_names:
                raise BadInputError(f"unknown output {name!r}: this model has {' and '.join(self.output_names)}")
            where = f"outputs[{i}].parameters"
            k = self.classification(params.get("classification"), f"{where}.classification")
            wanted.append(Wanted(name, k, flag(f"{where}.binary_data", params.get("binary_data"), binary)))
        return tuple(wanted)

    def classification(self, k: Any, where: str) -> int | None:
        """An output's ``classification`` parameter (``where``), checked: the k of Triton's classification extension
        (None: the tensor itself). A task without the extension ignores it."""
        return None

    @classmethod
    def named_outputs(cls, options: Any, given: Collection[str]) -> list[tuple[str, dict[str, Any]]]:
        """The v2 outputs (and their parameters) that ``options`` ask for, those ``given`` set (a gRPC stream's
        frame naming none, a load test's request); none: the task's default outputs."""
        return []

    def postprocess(self, result: InferResult, want: Want, transforms: Transforms = None) -> Post:
        """What ``result`` means, in the forms ``want`` asks for: its v2 tensors where it names outputs, else each
        image's rows; ``transforms``: each row's image's (a detector maps its boxes back with them)."""
        raise NotImplementedError

    def comparison(self, config: RolloutConfig) -> Comparison:
        """What a rollout of this model compares (its two versions' answers to the same images)."""
        raise NotImplementedError

    def fields(self, rows: list[dict[str, Any]], shown: Transform | None) -> dict[str, Any]:
        """One image's answer as streams and sources send it (``shown``: the image's transform, its size)."""
        assert shown is not None  # a decoded image has its transform (the image of the rows' boxes or masks)
        return {self.rows_field: rows, "width": shown.width, "height": shown.height}

    def result(self, name: str | None, rows: list[dict[str, Any]], shown: Transform | None) -> msgspec.Struct:
        """One image's answer in the image API (:attr:`result_type`; an error is ``result_type(error=...)``)."""
        return self.result_type(filename=name, **self.fields(rows, shown))
