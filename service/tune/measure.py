"""``tune``'s first phase (README, "Tuning", 1): the model on this device, in-process, as the server would run it.
int8 is measured only when its agreement gate passed at export; each batch size's times are kept as samples (the
prediction draws from them, so the machine's own variance reaches the predicted tail); batch sizes stop growing once
one batch alone takes longer than the latency target, since no configuration could use them.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import numpy as np

from service.core.config import ModelConfig
from service.core.preprocess import preprocess_image
from service.core.repository import ModelRepository, ModelVersion, random_batch
from service.engine.model import cuda_devices, plan_devices
from service.runtime import make_runtime, warm_up
from service.runtime.factory import BACKENDS, artifact
from service.supervisor import cpu_count
from service.tune.candidates import Say

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class RuntimeFigures:
    """One runtime variant's batch times: ``batch_ms[b]`` holds the measured milliseconds of batches of ``b``."""

    backend: str
    precision: str
    threads: int  # 0: the runtime's default
    batch_ms: dict[int, list[float]] = field(default_factory=dict)
    load_s: float = 0.0

    @property
    def key(self) -> tuple[str, str, int]:
        return self.backend, self.precision, self.threads

    def mean_ms(self, size: int) -> float:
        return float(np.mean(self.batch_ms[size]))

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "precision": self.precision, "threads": self.threads,
                "load_s": self.load_s, "batch_ms": {str(b): v for b, v in self.batch_ms.items()},
                "images_per_s": {str(b): 1000 * b / self.mean_ms(b) for b in self.batch_ms}}  # fmt: skip


@dataclass
class Measurements:
    model: str
    version: int
    device: str
    cores: int
    decode_ms: float  # one image, decode + preprocess, on one core
    images: str
    seconds: float = 0.0
    complete: bool = True  # False: the budget or an interruption cut the measuring short
    skipped: dict[str, str] = field(default_factory=dict)  # variant -> why it was not measured
    runtimes: list[RuntimeFigures] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"runtimes": [r.to_dict() for r in self.runtimes]}


def runtime_variants(version: ModelVersion, device: str) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """(backend, precision) pairs with an artifact for ``device``, and why the others are left out."""
    precisions = ("fp32", "fp16", "bf16", "int8") if device.startswith("cuda") else ("fp32", "int8")
    found: list[tuple[str, str]] = []
    skipped: dict[str, str] = {}
    for backend in BACKENDS:
        for precision in precisions:
            if precision == "bf16" and backend != "torchscript":
                continue
            path = artifact(version, backend, device, precision)
            if path is None:
                continue
            if precision == "fp16" and ".fp16." not in path.name and backend != "torchscript":
                continue  # no fp16 artifact: the fp32 file under another name, not a variant of its own
            if precision == "int8" and version.int8_ungated:
                skipped[f"{backend}/int8"] = "model.int8.onnx was written ungated (its agreement with fp32 unproven)"
                continue
            found.append((backend, precision))
    return found, skipped


def decode_cost_ms(version: ModelVersion, images: list[bytes], seconds: float) -> float:
    """Milliseconds of one core to decode and preprocess one image (the corpus cycled for ``seconds``)."""
    done, started = 0, time.thread_time()
    wall = time.perf_counter()
    while done < len(images) or time.perf_counter() - wall < seconds:
        preprocess_image(images[done % len(images)], version.spec)
        done += 1
    return 1000 * (time.thread_time() - started) / done


def _time_batches(runtime: Any, spec: Any, size: int, seconds: float, min_runs: int = 3) -> list[float]:
    batch = random_batch(spec, size)
    # The first runs of a shape are not counted: buffers, kernel choice, and TorchScript's profiling executor,
    # which specialises a graph on its second run of a new shape.
    for _ in range(1 if runtime.kind == "onnxruntime" else 2):
        runtime.run(batch)
    samples: list[float] = []
    started = time.perf_counter()
    while len(samples) < min_runs or (time.perf_counter() - started < seconds and len(samples) < 200):
        t0 = time.perf_counter()
        runtime.run(batch)
        samples.append(1000 * (time.perf_counter() - t0))
    return samples


def measure(
    repository: str,
    model: str,
    *,
    images: list[bytes],
    slo_p99_ms: float,
    seconds: float,
    threads: tuple[int, ...],
    device: str = "auto",
    say: Say,
    out: Measurements,
) -> Measurements:
    """Measure within about ``seconds``, filling ``out`` (named for the model and its images) in place, so an
    interruption leaves in it what was measured so far."""
    started = time.perf_counter()
    entry = ModelRepository(repository).model(model)
    version = entry.latest
    config: ModelConfig = entry.config if device == "auto" else msgspec.structs.replace(entry.config, device=device)
    devices, _degraded, _note = plan_devices(config, cuda_devices())
    target = devices[0]
    variants, skipped = runtime_variants(version, target)
    if target.startswith("cuda"):
        threads = (0,)
    out.version, out.device, out.cores = version.version, target, cpu_count()
    out.skipped.update(skipped)
    decode_s = min(2.0, 0.1 * seconds)
    say(f"decode: {out.images} for {decode_s:.1f} s")
    out.decode_ms = decode_cost_ms(version, images, decode_s)
    cells = max(1, len(variants) * len(threads) * len(BATCH_SIZES))
    cell_s = max(0.05, (seconds - decode_s - 2.0 * len(variants) * len(threads)) / cells)
    largest = max(BATCH_SIZES)
    try:
        for backend, precision in variants:
            for count in threads:
                name = f"{backend}/{precision}, {count or 'default'} threads"
                if time.perf_counter() - started > seconds:
                    out.skipped[name] = "measuring budget spent"
                    out.complete = False
                    continue
                say(f"runtime: {name}")
                chosen = msgspec.structs.replace(config, backend=backend, precision=precision, threads=count,
                                                 max_batch_size=largest)  # fmt: skip
                t0 = time.perf_counter()
                runtime = make_runtime(version, chosen, backend, target)
                try:
                    warm_up(runtime, 1)
                    figures = RuntimeFigures(backend, precision, count, load_s=time.perf_counter() - t0)
                    out.runtimes.append(figures)
                    for size in BATCH_SIZES:
                        figures.batch_ms[size] = _time_batches(runtime, version.spec, size, cell_s)
                        if figures.mean_ms(size) > slo_p99_ms or time.perf_counter() - started > 1.5 * seconds:
                            break  # one batch alone misses the target: larger ones cannot be served within it
                finally:
                    runtime.close()
    finally:
        out.seconds = time.perf_counter() - started
    return out
