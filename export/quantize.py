"""INT8 at export: onnxruntime static quantization of ``model.onnx``, gated on agreement with fp32, then on speed.

The gates, their figures and flags are README's ("INT8"). ``model.int8.onnx`` is onnxruntime's QDQ format
(per-channel int8 weights, uint8 activations: the pairing its own guide gives for x86 CPUs with VNNI, where resnet18
ran 3.0x fp32's images/s at batch 1 on this project's 2-core VM). The graph's uint8 front (Cast, then the
normalising Mul/Add, and a Transpose for NHWC models) stays in float: quantizing it would only add a rounding step
before the first convolution, which quantizes its input anyway.

This module needs onnx and onnxruntime, not torch.
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from export.int8_gate import MIN_BOX_MAP, MIN_MASK_MAP, Int8Verdict, Judge, Truth, describe_speed, judge_for, passed
from service.core.cpu import describe_cpu
from service.core.errors import ConfigError
from service.core.spec import Int8Record, Int8Speed, ModelSpec
from service.core.tasks import task_named

MIN_TOP1_AGREEMENT = 0.99
MAX_ACCURACY_DROP = 0.01  # one point
MIN_HELD_OUT = 20
MIN_CALIBRATION = 4
MAX_CALIBRATION = 128  # onnxruntime's calibrators keep every activation of every image: bounded memory
CALIBRATION_BATCH = 16
METHODS = ("minmax", "percentile", "entropy")
# int8 must take at most 95% of fp32's median time: that refuses onnxruntime #17389's 3.8% (not worth up to a point
# of accuracy); at 90% smallcnn (0.67-0.90x at batch 1 here) passed or not run to run. resnet18 ran 2.9-4.1x fp32.
MIN_SPEEDUP = 0.05
SPEED_BATCH_SIZES = (1, 8)
# Per batch size, SPEED_ROUNDS rounds of a block of SPEED_BLOCK_RUNS timed runs of each model, the order
# alternating, each block after 2 untimed runs: switching session every run measured fp32 at batch 1 1.4x slower
# than in blocks on 2 cores (likely the other session's spinning threads); 4 rounds left smallcnn's batch-8 ratio
# anywhere in 0.77-1.04x, 12 in 0.77-0.79x. A large model stops after the round that passes SPEED_BUDGET_S.
SPEED_ROUNDS = 12  # about 0.1 s for smallcnn
SPEED_BLOCK_RUNS = 4
SPEED_BUDGET_S = 2.0
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
    # Where known: class indices, a detector's boxes, or a segmenter's masks (a COCO annotations document)
    held_out_labels: np.ndarray | Truth | dict[str, Any] | None = None


@dataclass(frozen=True)
class Int8Options:
    method: str = "auto"  # auto | minmax | percentile | entropy
    ungated: bool = False
    exclude: tuple[str, ...] = ()  # node names kept in float, besides the input's front
    min_top1_agreement: float = MIN_TOP1_AGREEMENT
    min_box_map: float = MIN_BOX_MAP  # a detector's: mAP@0.5 of int8's boxes against fp32's
    min_mask_map: float = MIN_MASK_MAP  # a segmenter's: mask mAP@0.5 of int8's instances against fp32's
    max_accuracy_drop: float = MAX_ACCURACY_DROP
    min_speedup: float = MIN_SPEEDUP  # int8 may take at most 1 - this of fp32's time; < 0 accepts any speed
    allow_slower: bool = False  # write it even when it is not faster, marked in spec.json


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


def tail_nodes(model: Any) -> list[str]:
    """Names of the nodes after the last Conv/Gemm/MatMul: a detector's decoding (sigmoid, peaks, top-K, box
    arithmetic in input pixels), kept in float. Quantized, its uint8 activations cost the shipped detector 46
    points of mAP@0.5 (95.4 -> 49.2); in float, int8 lost none (95.4 -> 95.4, 99.9 against fp32's boxes)."""
    nodes = model.graph.node
    last = max((i for i, n in enumerate(nodes) if n.op_type in ("Conv", "Gemm", "MatMul")), default=len(nodes) - 1)
    return [n.name for n in nodes[last + 1 :]]


def layer_names(model: Any) -> tuple[str | None, str | None]:
    """The first convolution and the last Gemm/MatMul: the layers most often left in float when INT8 hurts."""
    first = next((n.name for n in model.graph.node if n.op_type == "Conv"), None)
    last = next((n.name for n in reversed(model.graph.node) if n.op_type in ("Gemm", "MatMul")), None)
    return first, last


class _Reader:
    """onnxruntime's CalibrationDataReader protocol (``get_next``) over uint8 batches."""

    def __init__(self, name: str, images: np.ndarray) -> None:
        # Batches of one size: onnxruntime's histogram calibrators (percentile, entropy) stack each tensor's batches
        # and fail on a short last one ("inhomogeneous shape"; 24 images in batches of 16 did). The last is filled
        # from the first images again.
        size = min(CALIBRATION_BATCH, len(images))
        padded = np.resize(images, (-(-len(images) // size) * size, *images.shape[1:]))
        self.batches: Iterator[np.ndarray] = iter([padded[i : i + size] for i in range(0, len(padded), size)])
        self.name = name

    def get_next(self) -> dict[str, np.ndarray] | None:
        batch = next(self.batches, None)
        return None if batch is None else {self.name: np.ascontiguousarray(batch)}


def _session(path: Path, providers: list[Any] | None = None) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # the rest as the server's runtime has it: all graph optimizations, spinning
    return ort.InferenceSession(str(path), options, providers=providers or ["CPUExecutionProvider"])


def _run(session: Any, images: np.ndarray, batch: int = 32) -> dict[str, np.ndarray]:
    """Each of the graph's outputs over ``images``, by name (most have one; a segmenter, its head and prototypes)."""
    name = session.get_inputs()[0].name
    runs = [session.run(None, {name: images[i : i + batch]}) for i in range(0, len(images), batch)]
    outputs = enumerate(o.name for o in session.get_outputs())
    return {n: np.concatenate([r[k] for r in runs]).astype(np.float32) for k, n in outputs}


def _rel_error(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> np.ndarray:
    errors = []  # each image's, of each output (a segmenter's head and prototypes apart): the worst
    for name, want in expected.items():
        have, want = got[name].reshape(len(want), -1), want.reshape(len(want), -1)  # a detector's rows too
        errors.append(np.abs(have - want).max(axis=1) / np.maximum(np.abs(want).max(axis=1), 1e-12))
    return np.asarray(np.max(errors, axis=0))


def _quantize(
    prepared: Path, target: Path, input_name: str, calibration: np.ndarray, method: str, exclude: list[str]
) -> None:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    methods = {m.name.lower(): m for m in CalibrationMethod}  # minmax, percentile, entropy (and distribution)
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
    device: str = "cpu",
    progress: Say | None = None,
    spec: ModelSpec | None = None,
) -> Int8Verdict:
    """Quantize ``fp32_path`` into ``target``, gate it on ``data.held_out``, time it against ``fp32_path`` on
    ``device`` (cpu, cuda or cuda:N) where it passed, and delete ``target`` again when it fails either gate (unless
    ``options.ungated``, or ``options.allow_slower`` for speed). Raises :class:`ConfigError` for unusable inputs
    (too few images, an unknown method or excluded node, a ``min_speedup`` of 1 or more)."""
    say = progress or (lambda _m: None)
    _check(data, options)
    judge = judge_for(spec, min_top1=options.min_top1_agreement, max_drop=options.max_accuracy_drop,
                      min_box_map=options.min_box_map, min_mask_map=options.min_mask_map)  # fmt: skip
    calibration = data.calibration[:MAX_CALIBRATION]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="int8-") as tmp:
        tail = spec is not None and bool(task_named(spec.task).layouts)  # a detector's decoding stays in float
        graph = _prepare(fp32_path, Path(tmp), options, float_tail=tail)
        fp32 = _session(fp32_path)
        best, tried = _calibrate(graph, fp32, calibration, options, judge, say)
        (Path(tmp) / f"{best}.onnx").replace(target)
    quantize_s = time.perf_counter() - started

    say(f"int8: gate on {len(data.held_out)} held-out images")
    int8 = _session(target)
    reference = _run(fp32, data.held_out)
    got = _run(int8, data.held_out)
    agreement = judge.agreement(got, reference)
    fp32_acc = int8_acc = None
    if data.held_out_labels is not None:
        fp32_acc = judge.accuracy(reference, data.held_out_labels)
        int8_acc = judge.accuracy(got, data.held_out_labels)
    ok = passed(judge, agreement, fp32_acc, int8_acc)
    record = Int8Record(
        gated=not options.ungated,
        passed=ok,
        **judge.record(agreement, fp32_acc, int8_acc),
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
    if ok or options.ungated:  # a refused model's speed is beside the point
        images = data.held_out if len(data.held_out) else calibration
        speed = _speed((fp32_path, target), (fp32, int8), images, device, options, say)
        say(f"int8: {describe_speed(speed)}")
        record = msgspec.structs.replace(record, speed=speed)
    verdict = Int8Verdict(record, float(_rel_error(got, reference).max()))
    if not ok:
        verdict.hints = _hints(record, options, graph.first_layer, graph.last_layer)
    elif record.speed is not None and not record.speed.passed and not record.speed.allowed_slower:
        verdict.hints = _speed_hints(record.speed)
    if not verdict.passed:
        target.unlink(missing_ok=True)
    return verdict


def _speed(paths: tuple[Path, Path], cpu: tuple[Any, Any], images: np.ndarray, device: str, options: Int8Options,
           say: Say) -> Int8Speed:  # fmt: skip
    """Median latency of fp32 and int8 (``paths``) per batch size, in alternating blocks so that a machine's
    drifting load falls on both alike (the lesson of the runtime benches, docs/performance.md)."""
    kind, provider, sessions = _speed_sessions(paths, device, cpu, say)
    say(f"int8: timing against fp32 on {kind}, batch sizes {', '.join(map(str, SPEED_BATCH_SIZES))}")
    medians: tuple[dict[int, float], dict[int, float]] = ({}, {})
    runs = SPEED_ROUNDS * SPEED_BLOCK_RUNS
    for size in SPEED_BATCH_SIZES:
        batch = np.ascontiguousarray(np.resize(images, (size, *images.shape[1:])))
        feeds = [{s.get_inputs()[0].name: batch} for s in sessions]
        times: tuple[list[float], list[float]] = ([], [])
        started = time.perf_counter()
        for r in range(SPEED_ROUNDS):
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                for n in range(2 + SPEED_BLOCK_RUNS):
                    began = time.perf_counter()
                    sessions[i].run(None, feeds[i])
                    if n >= 2:
                        times[i].append(time.perf_counter() - began)
            if time.perf_counter() - started > SPEED_BUDGET_S:
                break
        runs = min(runs, len(times[0]))
        for i in (0, 1):
            medians[i][size] = round(statistics.median(times[i]) * 1e3, 4)
    ratio = max(medians[1][n] / max(medians[0][n], 1e-9) for n in SPEED_BATCH_SIZES)
    passed = ratio <= 1 - options.min_speedup
    return Int8Speed(
        device=kind,
        provider=provider,
        runs=runs,
        fp32_median_ms=medians[0],
        int8_median_ms=medians[1],
        ratio=round(ratio, 4),
        min_speedup=options.min_speedup,
        passed=passed,
        allowed_slower=not passed and (options.allow_slower or options.ungated),
        cpu=describe_cpu() if kind == "cpu" else "",
    )


def _speed_sessions(
    paths: tuple[Path, Path], device: str, cpu: tuple[Any, Any], say: Say
) -> tuple[Literal["cpu", "cuda"], str, tuple[Any, Any]]:
    """(device type, provider, the fp32 and int8 sessions) to time on ``device``: the CUDA execution provider for
    a CUDA export where this onnxruntime has it (export has imported torch, which loads the CUDA libraries it
    needs), else the CPU sessions the gate ran."""
    import onnxruntime as ort

    if device.startswith("cuda"):
        if "CUDAExecutionProvider" in ort.get_available_providers():
            # HEURISTIC as the server's default (conv_algo_search): exhaustive search per shape is not serving.
            options = {"device_id": int(device.partition(":")[2] or 0), "cudnn_conv_algo_search": "HEURISTIC"}
            providers = [("CUDAExecutionProvider", options), "CPUExecutionProvider"]
            sessions = (_session(paths[0], providers), _session(paths[1], providers))
            if all("CUDAExecutionProvider" in s.get_providers() for s in sessions):
                return "cuda", "CUDAExecutionProvider", sessions
        say(f"int8: onnxruntime has no usable CUDA execution provider for {device}: timing on the CPU instead")
    return "cpu", "CPUExecutionProvider", cpu


def _speed_hints(speed: Int8Speed) -> list[str]:
    hints = ['--int8-allow-slower to write it anyway, marked in spec.json (precision "auto" then serves fp32)',
             f"a lower --int8-min-speedup (it was {speed.min_speedup:g})"]  # fmt: skip
    if speed.device == "cuda":
        hints.append("--device cpu, to time it on the CPU (onnxruntime's INT8 kernels are its CPU path)")
    return hints


@dataclass(frozen=True)
class _Prepared:
    """The fp32 graph made ready to quantize, and what quantizing it needs to know."""

    path: Path  # shape-inferred and fused, in the working folder
    input_name: str
    exclude: list[str]  # nodes kept in float: the input's front, and the ones asked for
    first_layer: str | None
    last_layer: str | None


def _prepare(fp32_path: Path, folder: Path, options: Int8Options, float_tail: bool = False) -> _Prepared:
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
    exclude = [*front_nodes(model), *(tail_nodes(model) if float_tail else ()), *options.exclude]
    return _Prepared(prepared, model.graph.input[0].name, exclude, first_layer, last_layer)


def _calibrate(
    graph: _Prepared, fp32: Any, calibration: np.ndarray, options: Int8Options, judge: Judge, say: Say
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
        tried[method] = judge.agreement(got, reference_cal)
        errors[method] = float(_rel_error(got, reference_cal).mean())
        best = max(tried, key=lambda m: (tried[m], -errors[m]))
        auto = options.method == "auto" and not options.ungated
        if auto and not candidates and "entropy" not in tried and tried[best] < judge.minimum:
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


def check_min_speedup(value: float) -> None:
    """Refuse a ``min_speedup`` no INT8 model could meet (1 or more: no time at all), or NaN."""
    if not value < 1:
        raise ConfigError(
            f"--int8-min-speedup must be a number below 1 (the fraction of fp32's time int8 must save; negative "
            f"accepts any speed), got {value!r}"
        )


def _check(data: Int8Data, options: Int8Options) -> None:
    if options.method not in ("auto", *METHODS):
        raise ConfigError(f"--int8-method must be auto, {', '.join(METHODS)}, got {options.method!r}")
    check_min_speedup(options.min_speedup)
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
