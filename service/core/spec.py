"""ModelSpec: what a model expects and what its outputs mean.

This is the one record shared by ``models/`` (it travels with the weights), ``export/`` (it is written to
``spec.json`` beside each artifact) and ``service/`` (it drives preprocessing and labelling). It imports neither
torch nor onnxruntime, so the serving path can read it without the model zoo.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

from service.core.errors import ConfigError
from service.core.layouts import Layout
from service.core.tasks import TASKS, DetectOptions

SPEC_FILE = "spec.json"

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Interpolation = Literal["bilinear", "bicubic", "nearest"]
# How an image is brought to the input's size: ``center_crop`` resizes the shorter side to ``resize_size`` and crops
# the centre (torchvision's classification transform); ``letterbox`` keeps the aspect, scales the image to fit the
# input and centres it on ``pad_value``; ``stretch`` scales each axis to the input's, aspect not kept.
Resize = Literal["center_crop", "letterbox", "stretch"]


class InputSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The tensor the model takes: uint8 NCHW, normalised inside the graph."""

    channels: Literal[1, 3] = 3
    height: PositiveInt
    width: PositiveInt
    dtype: Literal["uint8"] = "uint8"
    layout: Literal["NCHW"] = "NCHW"


class Int8Speed(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """INT8 against its fp32 source (``model.onnx``), timed with onnxruntime on the device the export targeted:
    median latency per batch size, the two in alternating blocks. ``passed`` when the worst ratio (int8 / fp32) is at
    most ``1 - min_speedup``; ``allowed_slower`` marks an artifact written although it was not."""

    device: Literal["cpu", "cuda"]  # where it was measured: `precision = "auto"` picks int8 only there
    provider: str  # onnxruntime's execution provider
    runs: int  # timed runs per model and batch size, after warm-up (the fewest of any batch size)
    fp32_median_ms: dict[int, float]  # batch size -> median latency
    int8_median_ms: dict[int, float]
    ratio: float  # the largest int8 / fp32 median ratio over the batch sizes: below 1 is faster
    min_speedup: float  # a fraction: 0.05 asks int8 to take at most 95% of fp32's time
    passed: bool
    allowed_slower: bool = False  # written though not faster (--int8-allow-slower, or --int8-ungated)
    cpu: str = ""  # on the CPU: its model and the instruction sets int8 speed depends on (service/core/cpu.py)


class Int8Record(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How an INT8 artifact was calibrated, and its gate against fp32 on held-out images (never the calibration
    set). ``gated`` is False for an artifact written with ``--int8-ungated`` whatever its figures."""

    gated: bool
    passed: bool  # the figures met the gate (recorded for ungated artifacts too)
    top1_agreement: float | None = None  # a classifier's, with fp32, on the held-out images
    fp32_accuracy: float | None = None  # where the held-out images' labels are known
    int8_accuracy: float | None = None
    min_top1_agreement: float | None = None
    # A detector's (export/int8_gate.py): mAP@0.5 of int8's boxes with fp32's as the truth, and where the held-out
    # images' boxes are known each one's labelled mAP@0.5.
    box_map50_vs_fp32: float | None = None
    min_box_map50: float | None = None
    fp32_map50: float | None = None
    int8_map50: float | None = None
    # A segmenter's: the same of its instances' masks (pycocotools' COCOeval, iouType "segm"), int8's against fp32's
    # and, where the held-out images' masks are known, each one's.
    mask_map50_vs_fp32: float | None = None
    min_mask_map50: float | None = None
    fp32_mask_map50: float | None = None
    int8_mask_map50: float | None = None
    max_accuracy_drop: float  # a fraction: 0.01 is one point (of accuracy, or of a detector's labelled mAP)
    held_out_images: int
    held_out_source: str
    calibration_images: int
    calibration_source: str
    calibration_method: Literal["minmax", "entropy", "percentile"]
    methods_tried: dict[str, float] = {}  # method -> agreement with fp32 (as judged) on the calibration images
    per_channel: bool = True
    activation_type: str = "QUInt8"
    weight_type: str = "QInt8"
    excluded_nodes: tuple[str, ...] = ()  # left in float: the input's uint8 -> normalised float front, and any asked
    quantize_s: float = 0.0
    speed: Int8Speed | None = None  # against fp32, where the accuracy gate passed or was waived (absent before)


class DetectionParity(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A detector's artifact against eager PyTorch (export/detect_parity.py): per image, the candidates above the
    cut (``score_threshold``, or eager's K-th score when all K are above it) matched one to one at IoU >=
    ``min_iou_limit``; candidates within ``score_margin`` of the cut left out (counted in ``left_out``)."""

    images: int
    boxes: int  # candidates beyond the margin, eager's and the artifact's together
    unmatched: int  # of those, without a partner (0 in a written artifact)
    left_out: int
    min_iou: float  # the lowest IoU of a matched pair
    class_agreement: float  # of the matched pairs
    max_score_error: float  # the largest |eager - artifact| score of a matched pair
    score_threshold: float
    score_margin: float
    min_iou_limit: float
    max_score_error_limit: float
    # A segmenter's masks (in the input's pixels): its instances beyond the margin matched at mask IoU >= the limit.
    masks: int | None = None
    masks_unmatched: int | None = None
    min_mask_iou: float | None = None
    min_mask_iou_limit: float | None = None


class ExportRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one artifact was made and how closely it matches eager PyTorch (or, for INT8, its fp32 source)."""

    format: Literal["onnx", "torchscript", "aoti"]
    file: str
    precision: Literal["fp32", "fp16", "int8"] = "fp32"
    opset: int | None = None
    versions: dict[str, str] = {}
    source_sha256: str | None = None
    parity_max_rel_error: float | None = None
    parity_top1_agreement: float | None = None
    parity_checked_on: str | None = None
    created_at: str | None = None
    int8: Int8Record | None = None  # INT8 artifacts only (absent from spec.json files written before INT8)
    detection_parity: DetectionParity | None = None  # a detector's gate (its parity_* fields are the classifier's)


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A model's contract: input shape, preprocessing policy, normalisation and labels.

    Preprocessing is: decode, apply the EXIF orientation, convert to RGB (or L for one channel), then ``resize``:
    by default resize the shorter side to ``resize_size`` with ``interpolation`` and centre-crop to ``input.height``
    x ``input.width`` (``letterbox`` and ``stretch``: :data:`Resize`). The graph then divides by 255 and applies
    ``(x - mean) / std`` per channel.

    ``task`` says what the outputs mean: ``classify`` (one logit per label), or ``detect`` (``output_layout``, at
    most ``max_detections`` boxes an image after the server's suppression). Every field added after the first
    specs has a default, so an older spec.json reads unchanged.
    """

    name: str
    architecture: str
    input: InputSpec
    resize_size: PositiveInt
    interpolation: Interpolation = "bilinear"
    mean: tuple[float, ...]
    std: tuple[float, ...]
    labels: tuple[str, ...]
    exports: tuple[ExportRecord, ...] = ()
    format_version: Literal[1] = 1
    task: str = "classify"
    resize: Resize = "center_crop"
    pad_value: Annotated[int, msgspec.Meta(ge=0, le=255)] = 114
    output_layout: Layout | None = None  # a detector's (service/core/layouts.py); None for a classifier
    max_detections: PositiveInt = DetectOptions().max_detections  # the served default, declared once

    def __post_init__(self) -> None:
        channels = self.input.channels
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(
                f"mean and std need one value per input channel ({channels}), got {len(self.mean)} and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be > 0, got {list(self.std)}")
        if not self.labels:
            raise ValueError("labels must hold at least one class name")
        task = TASKS.get(self.task)
        if task is None:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        readers = " or ".join(repr(name) for name, t in TASKS.items() if t.layouts)
        if task.layouts and self.output_layout not in task.layouts:
            raise ValueError(
                f"a {self.task} model needs output_layout: one of {', '.join(task.layouts)}, got {self.output_layout}"
            )
        if not task.layouts and self.output_layout is not None:
            raise ValueError(f"output_layout is for detectors (task {readers}), got it on task {self.task!r}")
        if self.resize == "center_crop" and self.resize_size < max(self.input.height, self.input.width):
            raise ValueError(
                f"resize_size ({self.resize_size}) must be >= the crop "
                f"({self.input.height}x{self.input.width}), or the centre crop would run off the image"
            )

    @property
    def num_classes(self) -> int:
        return len(self.labels)

    def export_record(self, file: str) -> ExportRecord | None:
        """The export record of artifact ``file`` (e.g. ``model.int8.onnx``), if spec.json has one."""
        return next((e for e in self.exports if e.file == file), None)


def encode_spec(spec: ModelSpec) -> bytes:
    """The spec as indented JSON, as written to ``spec.json``."""
    return msgspec.json.format(msgspec.json.encode(spec), indent=2) + b"\n"


def decode_spec(data: bytes | str, *, source: str = "spec") -> ModelSpec:
    """Parse and validate a spec; errors name ``source`` and the offending field."""
    try:
        return msgspec.json.decode(data, type=ModelSpec)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid model spec ({source}): {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError(f"model spec is not valid JSON ({source}): {exc}") from exc


def load_spec(path: str | Path) -> ModelSpec:
    """Read ``spec.json`` from ``path``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read model spec {path}: {exc.strerror or exc}") from exc
    return decode_spec(data, source=str(path))


def write_spec(spec: ModelSpec, path: str | Path) -> None:
    Path(path).write_bytes(encode_spec(spec))
