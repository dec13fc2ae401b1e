"""Export: eager model -> artifacts -> parity gate -> model repository entry.

Formats: ONNX and TorchScript (portable across devices, the default: a few seconds each) and AOTInductor
(``aoti``, opt-in: the C++ compile costs ~14 s for smallcnn and ~1 min for resnet18 on a 2-core VM, too slow for
``make serve``'s first start). An AOTInductor package runs only on the device type it was compiled for, so
``aoti`` writes ``model.pt2`` for the CPU and, where a GPU is usable, ``model.cuda.pt2`` (and
``model.fp16.cuda.pt2`` with ``--fp16``), each gated on its own device.

Nothing reaches the repository before its parity is proved: artifacts are written to a hidden staging folder
beside the version, checked, and only the ones that pass are moved into ``<repository>/<name>/<version>/`` with
``spec.json`` (which records each artifact's measured error). With ``int8`` the fp32 ``model.onnx`` that passed is
quantized there too and gated (:mod:`export.quantize`).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import torch
from torch import nn

from export.artifacts import (
    DEFAULT_OPSET,
    cuda_toolkit_missing,
    example_input,
    half_model,
    to_aoti,
    to_onnx,
    to_torchscript,
)
from export.detect_parity import DetectParityResult, check_parity, drop_refused, reference_of, refuse_unproved
from export.int8_gate import MIN_BOX_MAP, NO_INT8_DATA, Int8Verdict
from export.parity import FP16, FP32, ParityResult, eager_outputs, exact_fp32, parity_batches
from export.quantize import INT8_FILE, MIN_SPEEDUP, Int8Data, Int8Options, quantize_model
from models.records import library_versions
from service.core.config import CONFIG_FILE, default_config_text, load_config
from service.core.errors import ConfigError, VisionServeError
from service.core.repository import FP16_FILES, MODEL_FILES, ModelRepository
from service.core.spec import SPEC_FILE, ExportRecord, ModelSpec, write_spec
from service.core.tasks import task_named
from service.runtime import AotiRuntime, OnnxRuntime, Runtime, TorchScriptRuntime
from service.runtime.onnxrt import NO_CUDA_PROVIDER, runnable_device

if TYPE_CHECKING:
    from export.sources import Source

FORMATS = ("onnx", "torchscript", "aoti")
DEFAULT_FORMATS = ("onnx", "torchscript")
Progress = Callable[[str], None]
Checked = ParityResult | DetectParityResult  # a classifier's parity, or a detector's
Int8Source = Callable[[ModelSpec], Int8Data]  # the calibration and held-out images, preprocessed for the spec


class ExportRequest(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    repository: str = "model_repository"
    version: int | None = None
    formats: tuple[str, ...] = DEFAULT_FORMATS
    fp16: bool = False
    opset: int = DEFAULT_OPSET
    max_batch_size: int | None = None  # None: the model's config.toml, else 32
    latency: bool = True
    device: str = "auto"
    aoti_devices: tuple[str, ...] = ()  # where AOTInductor packages are compiled for: () is the CPU, and CUDA if usable
    int8: bool = False  # also model.int8.onnx, gated on agreement with fp32 on held-out images
    int8_ungated: bool = False  # write it whatever the gate says, marked ungated in spec.json
    int8_method: str = "auto"  # calibration: auto (measured) | minmax | percentile | entropy
    int8_exclude: tuple[str, ...] = ()  # graph nodes kept in float
    int8_min_speedup: float = MIN_SPEEDUP  # int8 must take at most 1 - this of fp32's time on the export's device
    int8_allow_slower: bool = False  # write it even when it is not that much faster, marked in spec.json
    int8_min_map: float = MIN_BOX_MAP  # a detector's: mAP@0.5 of int8's boxes against fp32's


@dataclass
class ArtifactReport:
    format: str
    precision: str
    file: str
    size_bytes: int
    export_s: float
    parity: Checked | Int8Verdict
    latency_ms: dict[int, float] = field(default_factory=dict)
    written: bool = False


@dataclass
class ExportReport:
    name: str
    version: int
    path: Path
    opset: int | None
    device: str
    artifacts: list[ArtifactReport]
    spec: ModelSpec | None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.artifacts) and all(a.parity.passed for a in self.artifacts)


def check_request(request: ExportRequest) -> None:
    bad = [f for f in request.formats if f not in FORMATS]
    if bad or not request.formats:
        raise ConfigError(f"--formats takes a comma-separated list of {', '.join(FORMATS)}, got {bad or '(none)'}")
    if not request.name or "/" in request.name or request.name.startswith("."):
        raise ConfigError(f"--name must be a plain folder name, got {request.name!r}")
    if request.version is not None and request.version < 1:
        raise ConfigError(f"--version must be an integer >= 1, got {request.version}")
    if any(d not in ("cpu", "cuda") for d in request.aoti_devices):
        raise ConfigError(f"--aoti-devices takes cpu and/or cuda, got {','.join(request.aoti_devices)}")
    if request.opset < 18:
        raise ConfigError(f"--opset must be >= 18 (torch's ONNX exporter), got {request.opset}")
    if request.int8 and "onnx" not in request.formats:
        raise ConfigError("--int8 quantizes the ONNX artifact: add onnx to --formats")


def make_runtime(fmt: str, spec: ModelSpec, path: Path, device: str, max_batch_size: int) -> Runtime:
    if fmt == "onnx":
        return OnnxRuntime(spec, path, device=device, name=spec.name)
    cls = AotiRuntime if fmt.startswith("aoti") else TorchScriptRuntime
    return cls(spec, path, device=device, name=spec.name, max_batch_size=max_batch_size, cuda_graphs=False)


def measure_latency(runtime: Runtime, spec: ModelSpec, sizes: list[int], repeats: int = 5) -> dict[int, float]:
    """Median milliseconds per batch for each size (after two warm-up runs)."""
    rng = np.random.default_rng(1)
    result: dict[int, float] = {}
    for n in sizes:
        batch = rng.integers(0, 256, size=(n, spec.input.channels, spec.input.height, spec.input.width), dtype=np.uint8)
        for _ in range(2):
            runtime.run(batch)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            runtime.run(batch)
            times.append((time.perf_counter() - started) * 1000)
        result[n] = statistics.median(times)
    return result


def _versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    return {**library_versions(), "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


@dataclass(frozen=True)
class Candidate:
    """An artifact to produce in the staging folder, then gate on parity."""

    format: str  # onnx | torchscript | aoti | aoti-cuda (the repository's file key)
    precision: str  # fp32 | fp16
    produce: Callable[[Path], None]
    device: str | None = None  # where it runs: None for any device, else the one it was compiled for

    @property
    def file(self) -> str:
        return (FP16_FILES if self.precision == "fp16" else MODEL_FILES)[self.format]


def module_candidates(module: nn.Module, spec: ModelSpec, request: ExportRequest) -> list[Candidate]:
    """Candidates that export ``module`` (and its fp16 copy with ``request.fp16``) in each requested format."""
    shape = (spec.input.channels, spec.input.height, spec.input.width)
    variants: list[tuple[str, nn.Module]] = [("fp32", module)]
    if request.fp16:
        variants.append(("fp16", half_model(module)))
    out: list[Candidate] = []
    output = task_named(spec.task).graph_outputs()  # logits for a classifier, candidates for a detector
    for precision, variant in variants:
        for fmt in request.formats:
            if fmt == "aoti":
                out += _aoti_candidates(variant, precision, shape, request.aoti_devices)
            elif fmt == "onnx":
                onnx = partial(to_onnx, variant, example_input(*shape), opset=request.opset, output=output)
                out.append(Candidate(fmt, precision, onnx))
            else:
                out.append(Candidate(fmt, precision, partial(to_torchscript, variant, example_input(*shape))))
    return out


def _aoti_candidates(
    module: nn.Module, precision: str, shape: tuple[int, int, int], wanted: tuple[str, ...] = ()
) -> list[Candidate]:
    """A package per device type it can be checked on here: the CPU (fp32 only), and CUDA when usable."""
    devices = (["cpu"] if precision == "fp32" else []) + (["cuda"] if torch.cuda.is_available() else [])
    if wanted:
        devices = [d for d in devices if d in wanted]
    out = []
    for device in devices:

        def produce(path: Path, m: nn.Module = module, d: str = device) -> None:
            if d == "cuda" and (missing := cuda_toolkit_missing()):
                raise ConfigError(missing)
            to_aoti(m, example_input(*shape), path, device=d)

        out.append(Candidate("aoti" if device == "cpu" else "aoti-cuda", precision, produce, device=device))
    return out


def export_model(
    eager: nn.Module,
    spec: ModelSpec,
    request: ExportRequest,
    *,
    real_images: np.ndarray | None = None,
    real_source: str = "random uint8 batches only",
    source_sha256: str | None = None,
    artifact_model: nn.Module | None = None,
    progress: Progress | None = None,
    int8_data: Int8Source | None = None,
) -> ExportReport:
    """Export ``eager`` (uint8 in: a classifier, or a detector's candidates out) in each requested format, gate on
    parity (:mod:`export.detect_parity` for a detector), write what passes. ``artifact_model`` is exported instead
    when given (tests prove a broken wrapper is refused); by default ``eager``."""
    check_request(request)
    refuse_unproved(spec, formats=request.formats)
    formats, notes = drop_refused(artifact_model or eager, request.formats)  # e.g. a torchvision detector's onnx
    request, eager = msgspec.structs.replace(request, formats=formats), eager.eval()
    candidates = module_candidates((artifact_model or eager).eval(), spec, request)

    def reference(batches: list[np.ndarray]) -> list[np.ndarray]:  # read as the artifact's are (end2end: top rows)
        return [reference_of(spec, out) for out in eager_outputs(eager, batches)]

    return publish(
        spec,
        request,
        candidates,
        reference,
        real_images=real_images,
        real_source=real_source,
        source_sha256=source_sha256,
        progress=progress,
        int8_data=int8_data,
        notes=notes,
    )


def export_source(
    source: Source,
    request: ExportRequest,
    *,
    progress: Progress | None = None,
    int8_data: Int8Source | None = None,
) -> ExportReport:
    """Export where an export starts (:mod:`export.sources`: a checkpoint or a zoo architecture), its parity proved
    on the source's own real images and its checkpoint's sha256 recorded."""
    return export_model(
        source.eager,
        source.spec,
        request,
        real_images=source.real_images,
        real_source=source.real_source,
        source_sha256=source.sha256,
        progress=progress,
        int8_data=int8_data,
    )


@dataclass
class _Stage:
    """One export in progress: its staging folder, and what each candidate is checked against there."""

    spec: ModelSpec
    request: ExportRequest
    folder: Path
    device: str  # where the latency is measured
    max_batch: int
    batches: list[np.ndarray]
    expected: list[np.ndarray]  # the reference's outputs on ``batches``
    real_source: str
    source_sha256: str | None
    say: Progress


def publish(
    spec: ModelSpec,
    request: ExportRequest,
    candidates: list[Candidate],
    reference: Callable[[list[np.ndarray]], list[np.ndarray]],
    *,
    real_images: np.ndarray | None = None,
    real_source: str = "random uint8 batches only",
    source_sha256: str | None = None,
    progress: Progress | None = None,
    notes: list[str] | None = None,
    int8_data: Int8Source | None = None,
) -> ExportReport:
    """Produce each candidate in a staging folder, prove its parity against ``reference``, and move the ones that
    pass into the repository with ``spec.json``; with ``request.int8``, quantize the fp32 ONNX artifact on
    ``int8_data(spec)`` and add it if it passes its gate."""
    check_request(request)
    say = progress or (lambda _msg: None)
    int8 = None
    if request.int8:
        if int8_data is None:
            raise ConfigError(NO_INT8_DATA)
        int8 = int8_data(spec)  # before any export: unusable images are refused at once
    model_dir = Path(request.repository) / request.name
    version, max_batch = _next_version(request, model_dir)
    version_dir = model_dir / str(version)
    device = request.device if request.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    shape = (spec.input.channels, spec.input.height, spec.input.width)
    batches = parity_batches(real_images, shape, max_batch)
    say(f"reference outputs on {sum(len(b) for b in batches)} images")
    expected = reference(batches)

    model_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".export-", dir=model_dir))
    stage = _Stage(spec, request, staging, device, max_batch, batches, expected, real_source, source_sha256, say)
    reports: list[ArtifactReport] = []
    records: list[ExportRecord] = []
    final_spec: ModelSpec | None = None
    try:
        for candidate in candidates:
            report, record = _gate_alone(stage, candidate)
            reports.append(report)
            if record is not None:
                records.append(record)
        if int8 is not None:
            record = _int8_artifact(stage, int8, reports)
            if record is not None:
                records.append(msgspec.structs.replace(record, source_sha256=source_sha256))
        if records:
            final_spec = _commit(stage, records, version_dir)
            for report in reports:
                report.written = report.parity.passed
    finally:
        if staging.exists():
            shutil.rmtree(staging)
        if not any(model_dir.iterdir()):
            model_dir.rmdir()
    return ExportReport(
        name=request.name,
        version=version,
        path=version_dir,
        opset=request.opset if "onnx" in request.formats else None,
        device=device,
        artifacts=reports,
        spec=final_spec,
        notes=list(notes or []),
    )


def _next_version(request: ExportRequest, model_dir: Path) -> tuple[int, int]:
    """(the version to write, refused if it exists; the largest batch to check: the request's, else the config's)."""
    repo = ModelRepository(request.repository)
    version = request.version or repo.next_version(request.name)
    version_dir = model_dir / str(version)
    if version_dir.exists():
        raise ConfigError(f"{version_dir} already exists: pick another --version or leave it out for the next free one")
    existing_config = load_config(model_dir / CONFIG_FILE)
    return version, request.max_batch_size or existing_config.max_batch_size


def _gate_alone(stage: _Stage, candidate: Candidate) -> tuple[ArtifactReport, ExportRecord | None]:
    """:func:`_gate`, a candidate that raises failing alone with its reason: the others are still checked and
    written (one format that cannot be produced here, an AOTInductor compile or a CUDA session, stopped them all)."""
    try:
        return _gate(stage, candidate)
    except Exception as exc:
        (stage.folder / candidate.file).unlink(missing_ok=True)
        reason = str(exc) if isinstance(exc, VisionServeError) else f"{type(exc).__name__}: {exc}"
        stage.say(f"{candidate.format} {candidate.precision} failed: {reason}")
        tolerance = FP32 if candidate.precision == "fp32" else FP16
        parity = ParityResult(0, float("nan"), float("nan"), tolerance, error=reason)
        return ArtifactReport(candidate.format, candidate.precision, candidate.file, 0, 0.0, parity), None


def _gate(stage: _Stage, candidate: Candidate) -> tuple[ArtifactReport, ExportRecord | None]:
    """Produce ``candidate`` in the staging folder and check its parity (and latency); its record if it passed,
    else it is deleted again."""
    fmt, precision, file_name = candidate.format, candidate.precision, candidate.file
    target = stage.folder / file_name
    stage.say(f"exporting {fmt} {precision}")
    started = time.perf_counter()
    candidate.produce(target)
    export_s = time.perf_counter() - started
    runtime: Runtime | None = None
    check_device = candidate.device or ("cpu" if precision == "fp32" else "cuda")
    if precision == "fp16" and (not torch.cuda.is_available() or runnable_device(fmt, check_device) == "cpu"):
        note = NO_CUDA_PROVIDER if torch.cuda.is_available() else "no GPU here"
        parity: Checked = ParityResult(0, math.nan, math.nan, FP16, checked=False, note=note)
    else:
        stage.say(f"parity {fmt} {precision}")
        runtime = make_runtime(fmt, stage.spec, target, check_device, stage.max_batch)
        with exact_fp32(check_device if precision == "fp32" else "cpu"):
            outputs = runtime.submit_outputs  # every named output, on the runtime's own worker thread
            parity = check_parity(stage.spec, stage.expected, lambda b: outputs(b).result(), stage.batches, precision)
    report = ArtifactReport(fmt, precision, file_name, target.stat().st_size, export_s, parity)
    if runtime is not None and parity.passed and stage.request.latency:
        if runtime.device != stage.device and candidate.device is None:  # a compiled package stays on its own
            runtime.close()
            runtime = make_runtime(fmt, stage.spec, target, runnable_device(fmt, stage.device), stage.max_batch)
        stage.say(f"latency {fmt} {precision} on {runtime.device}")
        sizes = sorted({1, min(8, stage.max_batch), stage.max_batch})
        report.latency_ms = measure_latency(runtime, stage.spec, sizes)
    if runtime is not None:
        runtime.close()
    if not parity.passed:
        target.unlink()
        return report, None
    checked_on = f"{stage.real_source}; {parity.images} images" if parity.checked else parity.note
    fields = {**parity.record_fields(), "source_sha256": stage.source_sha256, "parity_checked_on": checked_on}
    return report, _export_record(stage.request, fmt, precision, file_name, **fields)


def _export_record(request: ExportRequest, fmt: str, precision: str, file_name: str, **fields: Any) -> ExportRecord:
    """spec.json's record of an artifact written: its file, format and precision, the versions, and ``fields``."""
    return ExportRecord(
        format="onnx" if fmt == "onnx" else ("aoti" if fmt.startswith("aoti") else "torchscript"),
        file=file_name,
        precision=precision,  # type: ignore[arg-type]
        opset=request.opset if fmt == "onnx" else None,
        versions=_versions(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        **fields,
    )


def _commit(stage: _Stage, records: list[ExportRecord], version_dir: Path) -> ModelSpec:
    """Write ``spec.json`` into the staging folder and move it into place as the version (and a default
    ``config.toml`` beside it, for a new model); the spec written."""
    final_spec = msgspec.structs.replace(stage.spec, name=stage.request.name, exports=tuple(records))
    write_spec(final_spec, stage.folder / SPEC_FILE)
    stage.folder.rename(version_dir)
    config = version_dir.parent / CONFIG_FILE
    if not config.exists():
        config.write_text(default_config_text(stage.max_batch))
    return final_spec


def _int8_artifact(stage: _Stage, data: Int8Data, reports: list[ArtifactReport]) -> ExportRecord | None:
    """Quantize the staged fp32 ``model.onnx`` into ``model.int8.onnx`` and gate it; its record if it is kept."""
    fp32 = stage.folder / MODEL_FILES["onnx"]
    if not fp32.is_file():  # its own parity failed: there is nothing trustworthy to quantize
        return None
    target = stage.folder / INT8_FILE
    request = stage.request
    options = Int8Options(method=request.int8_method, ungated=request.int8_ungated, exclude=request.int8_exclude,
                          min_speedup=request.int8_min_speedup, allow_slower=request.int8_allow_slower,
                          min_box_map=request.int8_min_map)  # fmt: skip
    started = time.perf_counter()
    verdict = quantize_model(fp32, target, data, options, device=stage.device, progress=stage.say, spec=stage.spec)
    report = ArtifactReport("onnx", "int8", INT8_FILE, 0, time.perf_counter() - started, verdict)
    reports.append(report)
    if not target.is_file():
        return None
    report.size_bytes = target.stat().st_size
    gate = verdict.record
    if request.latency and gate.speed is not None:  # the speed gate timed it on the export's device already
        report.latency_ms = dict(gate.speed.int8_median_ms)
    checked_on = f"{gate.held_out_source}; {gate.held_out_images} held-out images, against model.onnx"
    figures = {"parity_max_rel_error": verdict.max_rel_error, "parity_top1_agreement": gate.top1_agreement}
    return _export_record(request, "onnx", "int8", INT8_FILE, **figures, parity_checked_on=checked_on, int8=gate)
