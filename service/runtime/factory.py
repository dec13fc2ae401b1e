"""A loaded runtime instance for a model version on a device: which backend, which file, warmed up how.

``backend = "auto"`` picks, per device type, the fastest runtime measured there among the artifacts the version
has (:data:`PREFERENCE`); the CPU fallback of a GPU-served model resolves "auto" again for the CPU.
``precision = "int8"`` and ``"auto"`` resolve as the README's export section says (:func:`resolve_precision`): int8
is refused at load where it cannot run, never served in fp32 instead, and the runtime instance carries the
precision it really runs, which metadata and metrics report.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from service.core.config import ModelConfig
from service.core.devices import may_have_gpu
from service.core.errors import ConfigError
from service.core.repository import INT8_FILES, MODEL_FILES, ModelVersion
from service.core.spec import Int8Speed
from service.runtime.aoti import AotiRuntime
from service.runtime.base import RuntimeLike
from service.runtime.fake import FakeRuntime
from service.runtime.onnxrt import OnnxRuntime
from service.runtime.torchscript import TorchScriptRuntime, bucket_sizes

log = logging.getLogger(__name__)

BACKENDS = ("onnxruntime", "torchscript", "aoti")

# The order "auto" tries, per device type (the first runtime whose artifact the version has wins).
PREFERENCE: dict[str, tuple[str, ...]] = {
    # CPU, measured (docs/performance.md, "Three runtimes on the CPU", 2-core VM, 2026-11-23): onnxruntime won 5 of 6
    # model and batch sizes (by 1.1-1.6x), and aoti beat TorchScript in 4 of 6 on the quieter run (under a load
    # average of 4-9 TorchScript ranked above aoti on resnet18: close enough to re-measure).
    "cpu": ("onnxruntime", "aoti", "torchscript"),
    # CUDA: UNMEASURED until `make gpu-check` has run on a GPU. The order follows PyTorch's own guidance (torch
    # 2.14 deprecates TorchScript in favour of torch.export, and AOTInductor is its compiled serving path with
    # Triton/cuBLAS kernels chosen at compile time), then TorchScript with CUDA graphs, then onnxruntime (which
    # needs the onnxruntime-gpu build's CUDA execution provider). Replace with the report's numbers.
    "cuda": ("aoti", "torchscript", "onnxruntime"),
}


def artifact(version: ModelVersion, backend: str, device: str, precision: str = "fp32") -> Path | None:
    """The file ``backend`` would load for ``version`` on ``device`` at ``precision``, or None if it has none."""
    cuda = device.startswith("cuda")
    if precision == "int8":
        return version.int8_files.get("onnx") if backend == "onnxruntime" else None
    half = cuda and precision == "fp16"
    if backend == "aoti":
        if not cuda:
            return version.files.get("aoti")
        if precision == "bf16":
            return None
        return (version.fp16_files if half else version.files).get("aoti-cuda")
    fmt = "onnx" if backend == "onnxruntime" else "torchscript"
    if half:
        return version.fp16_files.get(fmt) or version.files.get(fmt)
    return version.files.get(fmt) or version.fp16_files.get(fmt)


def served_precision(version: ModelVersion, backend: str, path: Path, precision: str) -> str:
    """The precision ``backend`` really runs ``path`` at. A TorchScript or AOTInductor module is cast (or compiled)
    at the precision asked; an ONNX graph runs at the one it was exported in: fp16 with no ``model.fp16.onnx``, or
    bf16 (export writes none), runs the fp32 graph, and must say so rather than report fp16."""
    if backend != "onnxruntime" or precision in ("fp32", "int8"):
        return precision
    return "fp16" if precision == "fp16" and path == version.fp16_files.get("onnx") else "fp32"


def int8_gated_on(version: ModelVersion, device: str) -> bool:
    """Whether ``version``'s ``model.int8.onnx`` passed export's accuracy gate (not ``--int8-ungated``) and its
    speed gate (not ``--int8-allow-slower``), timed on ``device``'s type (cpu or cuda), per ``spec.json``."""
    if "onnx" not in version.int8_files or version.int8_ungated:
        return False
    record = version.spec.export_record(INT8_FILES["onnx"])
    gate = record.int8 if record is not None else None
    speed = gate.speed if gate is not None and gate.passed else None  # None before the speed gate: never timed
    return speed is not None and speed.passed and speed.device == ("cuda" if device.startswith("cuda") else "cpu")


def _auto_int8(version: ModelVersion, config: ModelConfig, device: str, backend: str | None = None) -> bool:
    """Whether precision "auto" serves int8 on ``device``: onnxruntime may run it, and it passed both gates there."""
    runs_onnx = backend in (None, "onnxruntime") and config.backend in ("auto", "onnxruntime")
    return config.precision == "auto" and runs_onnx and int8_gated_on(version, device)


def _int8_speed(version: ModelVersion) -> Int8Speed | None:
    record = version.spec.export_record(INT8_FILES["onnx"])
    return record.int8.speed if record is not None and record.int8 is not None else None


def resolve_precision(version: ModelVersion, config: ModelConfig, device: str, backend: str | None = None) -> str:
    """The precision asked of a runtime on ``device``: ``config.precision``, "auto" resolved (module docstring),
    and fp16/bf16 on the CPU run as fp32. ``backend``: the one chosen, where it is (int8 needs onnxruntime)."""
    precision = config.precision
    cuda = device.startswith("cuda")
    if precision == "auto":
        if _auto_int8(version, config, device, backend):
            return "int8"
        if not cuda:
            return "fp32"
        if backend is None:
            return "fp16"  # what the backend choice looks for; make_runtime settles what is served
        path = artifact(version, backend, device, "fp16")
        return served_precision(version, backend, path, "fp16") if path is not None else "fp32"
    return precision if cuda or precision == "int8" else "fp32"


def _any_artifact(version: ModelVersion, backend: str) -> bool:
    return any(artifact(version, backend, d, p) is not None for d in ("cpu", "cuda") for p in ("fp32", "fp16"))


def cuda_devices() -> list[str]:
    """The usable CUDA devices (none when torch has no working CUDA). A machine with no NVIDIA device file has
    none, and is told so without importing torch (2.2 s and ~650 MB on every engine start, for nothing)."""
    if not may_have_gpu():
        return []
    try:
        import torch

        if not torch.cuda.is_available():
            return []
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    except Exception:  # a broken driver is the same as no GPU, for choosing a device
        return []


def _planned_device(config: ModelConfig) -> str:
    if config.device != "auto":
        return config.device
    return "cuda" if cuda_devices() else "cpu"


def choose_backend(version: ModelVersion, config: ModelConfig, device: str | None = None) -> str:
    """The backend for ``version`` on ``device`` (default: the device the config will use)."""
    faults = config.faults
    if faults.noop and (not faults.versions or version.version in faults.versions):  # the drill: no model work
        return "noop"
    if config.precision == "int8":
        return _int8_backend(version, config)
    # The artifact is looked for first: without one, no GPU probe to plan the device.
    auto_int8 = config.precision == "auto" and "onnx" in version.int8_files
    if auto_int8 and _auto_int8(version, config, device or _planned_device(config)):
        return "onnxruntime"
    if config.backend != "auto":
        if not _any_artifact(version, config.backend):
            files = " or ".join(n for k, n in MODEL_FILES.items() if k.startswith(config.backend[:4]))
            raise ConfigError(f"backend {config.backend} asked for, but {version.path} has no {files} artifact")
        return config.backend
    present = [b for b in BACKENDS if _any_artifact(version, b)]
    if len(present) == 1:  # one choice: no need to look for a GPU (the ONNX-only path stays torch-free)
        return present[0]
    target = device or _planned_device(config)
    order = PREFERENCE["cuda" if target.startswith("cuda") else "cpu"]
    precision = resolve_precision(version, config, target)
    for backend in order:
        if artifact(version, backend, target, precision) is not None:
            return backend
    if present:
        return present[0]
    raise ConfigError(f"{version.path} holds no artifact that a runtime can load")


def _int8_backend(version: ModelVersion, config: ModelConfig) -> str:
    if config.backend not in ("auto", "onnxruntime"):
        raise ConfigError(
            f"precision int8 is served by onnxruntime (model.int8.onnx), but backend is {config.backend!r}: "
            'set backend = "onnxruntime" or "auto"'
        )
    if "onnx" not in version.int8_files:
        raise ConfigError(
            f'precision = "int8" asked for, but {version.path} has no {INT8_FILES["onnx"]}: export it with '
            "`visionserve export ... --int8`, or serve precision fp32"
        )
    return "onnxruntime"


def make_runtime(
    version: ModelVersion, config: ModelConfig, backend: str, device: str, *, cuda_graphs: bool = True
) -> RuntimeLike:
    """A loaded runtime instance of ``version`` on ``device`` (``cuda_graphs``: capture per bucket on CUDA)."""
    name = f"{version.model}-v{version.version}"
    if backend == "noop":
        return FakeRuntime(version.spec, device=device, name=name)
    if config.backend == "auto":  # per device: the CPU fallback of a GPU model takes the CPU's fastest
        backend = choose_backend(version, config, device)
    precision = resolve_precision(version, config, device, backend)
    if config.precision == "auto":
        log.info("model %s: precision auto on %s serves %s (%s)", name, device, precision, backend)
    path = artifact(version, backend, device, precision)
    if path is None:
        raise ConfigError(
            f"backend {backend} has no artifact in {version.path} for {device} at {precision}"
            + (" (AOTInductor packages are compiled per device type: export on a GPU for model.cuda.pt2)"
               if backend == "aoti" else "")
        )  # fmt: skip
    if backend == "onnxruntime":
        served = served_precision(version, backend, path, precision)
        if served != precision:
            log.warning("model %s: precision %s asked for on %s, but %s is an %s graph (export --fp16 writes "
                        "model.fp16.onnx): serving %s", name, precision, device, path.name, served, served)  # fmt: skip
            precision = served
        if precision == "int8" and version.int8_ungated:
            log.warning(
                "model %s: serving %s, written with --int8-ungated: its agreement with fp32 was not gated "
                "(spec.json records what was measured)",
                name,
                path,
            )
        speed = _int8_speed(version) if precision == "int8" else None
        if speed is not None and not speed.passed:
            log.warning("model %s: serving %s, written with --int8-allow-slower: it took %.2fx fp32's time on %s "
                        "at export (limit %.2fx; spec.json has the figures)", name, path, speed.ratio, speed.device,
                        1 - speed.min_speedup)  # fmt: skip
        return OnnxRuntime(version.spec, path, device=device, name=name, precision=precision,
                           threads=config.threads or None, spinning=config.intra_op_spinning,
                           conv_algo_search=config.conv_algo_search)  # fmt: skip
    cls = AotiRuntime if backend == "aoti" else TorchScriptRuntime
    return cls(
        version.spec,
        path,
        device=device,
        name=name,
        precision=precision,
        max_batch_size=config.max_batch_size,
        cuda_graphs=cuda_graphs,
        threads=config.threads or None,
    )


def warm_up(runtime: RuntimeLike, max_batch_size: int) -> None:
    """Run every batch-size bucket once, so the first requests do not pay for kernel selection."""
    spec = runtime.spec
    for size in bucket_sizes(max_batch_size):
        runtime.run(np.zeros((size, spec.input.channels, spec.input.height, spec.input.width), dtype=np.uint8))
