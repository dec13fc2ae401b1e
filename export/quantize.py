"""INT8 at export: onnxruntime static quantization of ``model.onnx``, gated on agreement with fp32.

``model.int8.onnx`` is onnxruntime's QDQ format (per-channel int8 weights, uint8 activations: the pairing its own
guide gives for x86 CPUs with VNNI, where resnet18 ran 3.0x fp32's images/s at batch 1 on this project's 2-core
VM), calibrated on real images that went through the model's own preprocessing. The calibration method is
measured, not assumed: with ``method="auto"`` MinMax and Percentile are both tried (Entropy too when neither
agrees well enough) and the one whose int8 outputs agree best with fp32 on the calibration images is kept.

The gate runs on held-out images, never the calibration set: top-1 agreement with fp32 of at least
:data:`MIN_TOP1_AGREEMENT` and, where the images' labels are known, accuracy within :data:`MAX_ACCURACY_DROP` of
fp32's. A model that fails is not written, and the message says by how much it missed and what to try.
``ungated`` writes it anyway, marked so in ``spec.json``: for speed work on models whose fp32 predictions mean
nothing (initial weights), where agreement is noise.

The graph's uint8 front (Cast, then the normalising Mul/Add, and a Transpose for NHWC models) stays in float:
quantizing it would only add a rounding step before the first convolution, which quantizes its input anyway.

This module needs onnx and onnxruntime, not torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from service.core.errors import ConfigError
from service.core.spec import Int8Record

MIN_TOP1_AGREEMENT = 0.99
MAX_ACCURACY_DROP = 0.01  # one point
MIN_HELD_OUT = 20
MIN_CALIBRATION = 4
MAX_CALIBRATION = 128  # onnxruntime's calibrators keep every activation of every image: bounded memory
CALIBRATION_BATCH = 16
METHODS = ("minmax", "percentile", "entropy")
INT8_FILE = "model.int8.onnx"
# The float front of an exported graph: uint8 -> float and the per-channel normalisation (outside ONNX models
# wrapped by export/outside.py add a Transpose and an Identity).
FRONT_OPS = ("Cast", "Mul", "Add", "Sub", "Div", "Transpose", "Identity")

Say = Callable[[str], None]


@dataclass(frozen=True)
class Int8Data:
    """Images for calibration and, apart from them, the held-out images of the gate (uint8 NCHW, preprocessed)."""

    calibration: np.ndarray
    calibration_source: str
    held_out: np.ndarray
    held_out_source: str
    held_out_labels: np.ndarray | None = None  # class indices, where known


@dataclass(frozen=True)
class Int8Options:
    method: str = "auto"  # auto | minmax | percentile | entropy
    ungated: bool = False
    exclude: tuple[str, ...] = ()  # node names kept in float, besides the input's front
    min_top1_agreement: float = MIN_TOP1_AGREEMENT
    max_accuracy_drop: float = MAX_ACCURACY_DROP


@dataclass
class Int8Verdict:
    """The gate's outcome, in the shape the export report prints for every artifact."""

    record: Int8Record
    max_rel_error: float
    hints: list[str] = field(default_factory=list)
    checked: bool = True

    @property
    def images(self) -> int:
        return self.record.held_out_images

    @property
    def top1_agreement(self) -> float:
        return self.record.top1_agreement

    @property
    def passed(self) -> bool:
        """Whether the artifact may be written: it met the gate, or the gate was waived."""
        return self.record.passed or not self.record.gated

    def describe(self) -> str:
        r = self.record
        verdict = "pass" if r.passed else ("UNGATED, would FAIL" if not r.gated else "FAIL")
        if r.passed and not r.gated:
            verdict = "UNGATED, would pass"
        text = (
            f"{verdict}: top-1 agreement with fp32 {r.top1_agreement:.2%} (limit {r.min_top1_agreement:.0%}"
            f"{_short_by(r.top1_agreement, r.min_top1_agreement, r.held_out_images)})"
        )
        if r.fp32_accuracy is not None and r.int8_accuracy is not None:
            drop = r.fp32_accuracy - r.int8_accuracy
            text += (
                f", accuracy {r.int8_accuracy:.2%} against fp32's {r.fp32_accuracy:.2%} "
                f"({'-' if drop >= 0 else '+'}{abs(drop) * 100:.2f} points, limit -{r.max_accuracy_drop * 100:.0f}"
                + (f": over by {(drop - r.max_accuracy_drop) * 100:.2f} points" if drop > r.max_accuracy_drop else "")
                + ")"
            )
        text += (
            f" on {r.held_out_images} held-out images ({r.held_out_source}); max relative logit error "
            f"{self.max_rel_error:.2e}; calibrated with {r.calibration_method} on {r.calibration_images} images "
            f"({r.calibration_source})"
        )
        if self.hints and not r.passed:
            text += ". Try: " + "; ".join(self.hints)
        return text


def _short_by(value: float, limit: float, images: int) -> str:
    if value >= limit:
        return ""
    missing = int(np.ceil(limit * images - value * images - 1e-9))
    return f": short by {(limit - value) * 100:.2f} points, {missing} more of {images} images had to agree"


def front_nodes(model: Any) -> list[str]:
    """Names of the nodes between the graph input and the first real layer (the uint8 -> normalised float front)."""
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    reached = {i.name for i in graph.input if i.name not in initializers}
    front: list[str] = []
    for node in graph.node:  # nodes are topologically sorted in a valid graph
        inputs = [i for i in node.input if i and i not in initializers]
        if node.op_type == "Constant":  # a constant (the mean, say) counts as an initializer
            initializers.update(node.output)
            continue
        if node.op_type in FRONT_OPS and inputs and all(i in reached for i in inputs):
            front.append(node.name)
            reached.update(node.output)
    return front


def layer_names(model: Any) -> tuple[str | None, str | None]:
    """The first convolution and the last Gemm/MatMul: the layers most often left in float when INT8 hurts."""
    first = next((n.name for n in model.graph.node if n.op_type == "Conv"), None)
    last = next((n.name for n in reversed(model.graph.node) if n.op_type in ("Gemm", "MatMul")), None)
    return first, last


class _Reader:
    """onnxruntime's CalibrationDataReader protocol (``get_next``) over uint8 batches."""

    def __init__(self, name: str, images: np.ndarray) -> None:
        self.batches: Iterator[np.ndarray] = iter(
            [images[i : i + CALIBRATION_BATCH] for i in range(0, len(images), CALIBRATION_BATCH)]
        )
        self.name = name

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self.batches, None)
        return None if batch is None else {self.name: np.ascontiguousarray(batch)}


def _session(path: Path) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _run(session: Any, images: np.ndarray, batch: int = 32) -> np.ndarray:
    name = session.get_inputs()[0].name
    outs = [session.run(None, {name: images[i : i + batch]})[0] for i in range(0, len(images), batch)]
    return np.concatenate(outs).astype(np.float32)


def _rel_error(got: np.ndarray, expected: np.ndarray) -> np.ndarray:
    scale = np.maximum(np.abs(expected).max(axis=1), 1e-12)
    return np.asarray(np.abs(got - expected).max(axis=1) / scale)


def _quantize(
    prepared: Path, target: Path, input_name: str, calibration: np.ndarray, method: str, exclude: list[str]
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
    }
    # Its histogram calibrators print progress to stdout, and it logs a warning through the root logger.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantize_static(
                str(prepared),
                str(target),
                _Reader(input_name, calibration),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=methods[method],
                nodes_to_exclude=exclude,
            )
    finally:
        root.setLevel(level)


def quantize_model(
    fp32_path: Path,
    target: Path,
    data: Int8Data,
    options: Int8Options = Int8Options(),
    *,
    progress: Say | None = None,
) -> Int8Verdict:
    """Quantize ``fp32_path`` into ``target``, gate it on ``data.held_out``, and delete ``target`` again when it
    fails (unless ``options.ungated``). Raises :class:`ConfigError` for unusable inputs (too few images, an
    unknown method or excluded node)."""
    say = progress or (lambda _m: None)
    _check(data, options)
    calibration = data.calibration[:MAX_CALIBRATION]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="int8-") as tmp:
        graph = _prepare(fp32_path, Path(tmp), options)
        fp32 = _session(fp32_path)
        best, tried = _calibrate(graph, fp32, calibration, options, say)
        (Path(tmp) / f"{best}.onnx").replace(target)
    quantize_s = time.perf_counter() - started

    say(f"int8: gate on {len(data.held_out)} held-out images")
    reference = _run(fp32, data.held_out)
    got = _run(_session(target), data.held_out)
    agreement = float((got.argmax(1) == reference.argmax(1)).mean())
    fp32_acc = int8_acc = None
    if data.held_out_labels is not None:
        fp32_acc = float((reference.argmax(1) == data.held_out_labels).mean())
        int8_acc = float((got.argmax(1) == data.held_out_labels).mean())
    passed = agreement >= options.min_top1_agreement and (
        fp32_acc is None or int8_acc is None or int8_acc >= fp32_acc - options.max_accuracy_drop - 1e-12
    )
    record = Int8Record(
        gated=not options.ungated,
        passed=passed,
        top1_agreement=agreement,
        fp32_accuracy=fp32_acc,
        int8_accuracy=int8_acc,
        min_top1_agreement=options.min_top1_agreement,
        max_accuracy_drop=options.max_accuracy_drop,
        held_out_images=len(data.held_out),
        held_out_source=data.held_out_source,
        calibration_images=len(calibration),
        calibration_source=data.calibration_source,
        calibration_method=best,  # type: ignore[arg-type]
        methods_tried=tried,
        excluded_nodes=tuple(graph.exclude),
        quantize_s=round(quantize_s, 3),
    )
    verdict = Int8Verdict(record, float(_rel_error(got, reference).max()))
    if not passed:
        verdict.hints = _hints(record, options, graph.first_layer, graph.last_layer)
        if not options.ungated:
            target.unlink(missing_ok=True)
    return verdict


@dataclass(frozen=True)
class _Prepared:
    """The fp32 graph made ready to quantize, and what quantizing it needs to know."""

    path: Path  # shape-inferred and fused, in the working folder
    input_name: str
    exclude: list[str]  # nodes kept in float: the input's front, and the ones asked for
    first_layer: str | None
    last_layer: str | None


def _prepare(fp32_path: Path, folder: Path, options: Int8Options) -> _Prepared:
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = folder / "prepared.onnx"
    # Shape inference and onnxruntime's graph fusions first (Conv+BatchNorm, ...), as its guide asks: a tensor
    # of unknown shape cannot be quantized.
    quant_pre_process(str(fp32_path), str(prepared))
    model = onnx.load(str(prepared))
    names = {n.name for n in model.graph.node}
    unknown = [n for n in options.exclude if n not in names]
    if unknown:
        convs = [n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")][:8]
        raise ConfigError(f"--int8-exclude names no node of the graph: {unknown} (layers include {convs})")
    first_layer, last_layer = layer_names(model)
    exclude = [*front_nodes(model), *options.exclude]
    return _Prepared(prepared, model.graph.input[0].name, exclude, first_layer, last_layer)


def _calibrate(
    graph: _Prepared, fp32: Any, calibration: np.ndarray, options: Int8Options, say: Say
) -> tuple[str, dict[str, float]]:
    """Quantize with each method to try (``<method>.onnx`` beside the prepared graph) and pick the one whose
    outputs agree best with fp32 on the calibration images: (that method, the agreement of each one tried)."""
    reference_cal = _run(fp32, calibration)
    tried: dict[str, float] = {}
    errors: dict[str, float] = {}
    candidates = [options.method] if options.method != "auto" else ["minmax", "percentile"]
    if options.method == "auto" and options.ungated:
        candidates = ["minmax"]  # nothing meaningful to choose on when fp32's answers are noise
    best: str | None = None
    while candidates:
        method = candidates.pop(0)
        out = graph.path.parent / f"{method}.onnx"
        say(f"int8: calibrating with {method} on {len(calibration)} images")
        _quantize(graph.path, out, graph.input_name, calibration, method, graph.exclude)
        got = _run(_session(out), calibration)
        tried[method] = float((got.argmax(1) == reference_cal.argmax(1)).mean())
        errors[method] = float(_rel_error(got, reference_cal).mean())
        best = max(tried, key=lambda m: (tried[m], -errors[m]))
        auto = options.method == "auto" and not options.ungated
        if auto and not candidates and "entropy" not in tried and tried[best] < options.min_top1_agreement:
            candidates.append("entropy")  # slower (histograms), so only when the quick two miss
    assert best is not None
    return best, tried


def _hints(record: Int8Record, options: Int8Options, first: str | None, last: str | None) -> list[str]:
    hints = []
    if record.calibration_images < MAX_CALIBRATION:
        hints.append(
            f"more calibration images (--calibration-images DIR with up to {2 * MAX_CALIBRATION} real images; "
            f"{record.calibration_images} were used)"
        )
    others = [m for m in METHODS if m not in record.methods_tried]
    tried = ", ".join(f"{m} {a:.2%}" for m, a in record.methods_tried.items())
    if others:
        hints.append(f"another method (--int8-method {' or '.join(others)}; tried: {tried} agreement on calibration)")
    layers = [n for n in (first, last) if n and n not in options.exclude]
    if layers:
        hints.append(f"excluding layers from quantization (--int8-exclude {','.join(layers)})")
    if not options.ungated:
        hints.append("or --int8-ungated to write it anyway, marked ungated")
    return hints


def _check(data: Int8Data, options: Int8Options) -> None:
    if options.method not in ("auto", *METHODS):
        raise ConfigError(f"--int8-method must be auto, {', '.join(METHODS)}, got {options.method!r}")
    if len(data.calibration) < MIN_CALIBRATION:
        raise ConfigError(
            f"INT8 calibration needs at least {MIN_CALIBRATION} images, got {len(data.calibration)} "
            f"({data.calibration_source})"
        )
    if len(data.held_out) < MIN_HELD_OUT and not options.ungated:
        raise ConfigError(
            f"the INT8 gate needs at least {MIN_HELD_OUT} held-out images apart from the calibration set, got "
            f"{len(data.held_out)} ({data.held_out_source}): give --calibration-images a folder of at least "
            f"{2 * MIN_HELD_OUT} images (half calibrate, half are held out)"
        )
