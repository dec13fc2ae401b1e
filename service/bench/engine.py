"""``visionserve bench``: the engine's limits in-process, with no HTTP. The yardstick served throughput is held
against.

Four figures, on the same model, device and images:

- ``engine_images_per_s[B]``: the runtime alone on ready uint8 batches of size B (no preprocessing).
- ``pipeline_images_per_s``: decode and preprocess real JPEG files in the decoding pool, stack, run; at the
  largest batch size, with no batcher: the best a server could do without dynamic batching's costs.
- ``batcher_images_per_s``: many concurrent submitters of one JPEG each, through the decoding pool and the
  batcher: what the server's engine does. ``batcher_efficiency`` is its ratio to the pipeline figure.
- ``fake_items_per_s``: the batcher alone, with a runtime that does no work: its own overhead ceiling.

A detector's pipeline figure includes suppression and mapping; ``candidates`` adds its figures at 1,000
candidates an image (:mod:`service.bench.detect`).

And, on request (``figures``), ``decode_cpu_images_per_s`` (the CPU decoding pool on every core) beside
``decode_gpu_images_per_s`` (nvJPEG batch decode, resize and crop on the GPU) on the same JPEGs.

:func:`compare_backends` runs the same figures once per backend, in one process, and names the fastest per batch
size: the measurement behind ``backend = "auto"``.
"""

from __future__ import annotations

import asyncio
import platform
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from service.bench import detect
from service.bench.detect import default_images
from service.core.config import ModelConfig
from service.core.decoding import GpuJpegDecoder, Preprocessor
from service.core.errors import ConfigError
from service.core.repository import ModelRepository, ModelVersion, random_batch
from service.core.samples import image_files, photo_like_jpegs
from service.core.spec import ModelSpec
from service.core.tasks import Detect, task_for
from service.engine.batcher import Batcher, InferRequest
from service.engine.model import batcher_config, cuda_devices, plan_devices, serving_precision
from service.runtime import FakeRuntime, RuntimeLike, choose_backend, make_runtime, warm_up

Say = Callable[[str], None]


FIGURES = ("engine", "pipeline", "decode", "batcher", "fake", "candidates")
ROUNDS = 4  # compare_backends: turns per batch size


@dataclass(frozen=True)
class BenchOptions:
    model: str
    repository: str = "model_repository"
    device: str = "auto"
    backend: str | None = None
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    seconds: float = 5.0
    concurrency: int | None = None  # default: 2 x the largest batch size
    images: str | None = None  # a folder of JPEG/PNG files; default: generated photo-like JPEGs
    gpu_decode: bool = True
    precision: str | None = None  # default: config.toml
    cuda_graphs: bool = True
    figures: tuple[str, ...] = FIGURES


def load_images(folder: str) -> list[bytes]:
    try:
        return image_files(folder, (".jpg", ".jpeg", ".png", ".webp"))
    except ValueError:
        raise ConfigError(f"--images {folder} holds no JPEG, PNG or WebP files") from None


def _timed(seconds: float, step: Callable[[], int], min_rounds: int = 3) -> float:
    """Items per second of ``step`` (which returns how many items it did) over ``seconds`` (one warm-up round)."""
    step()
    done = rounds = 0
    started = time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - started < seconds:
        done += step()
        rounds += 1
    return done / (time.perf_counter() - started)


async def _drive(
    batcher: Batcher, make: Callable[[int], Any], concurrency: int, seconds: float, warmup_s: float
) -> float:
    """Images per second through ``batcher`` from ``concurrency`` submitters; ``make(i)`` gives one request."""
    counting = False
    done = 0
    stop_at = time.perf_counter() + warmup_s + seconds

    async def submitter(k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < stop_at:
            request = await make(i)
            await batcher.submit(request)
            if counting:
                done += 1
            i += concurrency

    tasks = [asyncio.create_task(submitter(k)) for k in range(concurrency)]
    await asyncio.sleep(warmup_s)
    counting, started = True, time.perf_counter()
    await asyncio.gather(*tasks)
    return done / (time.perf_counter() - started)


def run_bench(options: BenchOptions, say: Say | None = None) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring) as a JSON-ready dict."""
    say = say or (lambda _m: None)
    entry = ModelRepository(options.repository).model(options.model)
    version = entry.latest
    config = _bench_config(entry.config, options)
    devices, _degraded, note = plan_devices(config, cuda_devices())
    device = devices[0]
    backend = choose_backend(version, config, device)
    spec: ModelSpec = version.spec
    largest = max(options.batch_sizes)
    concurrency = options.concurrency or 2 * largest
    if options.images:
        jpegs, described = load_images(options.images), options.images
    elif isinstance(task_for(spec), Detect):
        jpegs, described = default_images()
    else:
        jpegs = photo_like_jpegs()
        described = f"{len(jpegs)} generated 500x375 JPEGs"
    say(f"loading {options.model} v{version.version} ({backend}) on {device}")
    runtime = make_runtime(version, config, backend, device, cuda_graphs=options.cuda_graphs)
    warm_up(runtime, largest)
    pool = Preprocessor(spec)
    result: dict[str, Any] = {
        "model": options.model,
        "version": version.version,
        "device": device,
        "runtime": backend,
        "precision": serving_precision(config, [device]),
        "cuda_graphs": options.cuda_graphs and device.startswith("cuda"),
        "figures": list(options.figures),
        "input": [spec.input.channels, spec.input.height, spec.input.width],
        "batch_sizes": list(options.batch_sizes),
        "images": described,
        "decode_workers": pool.workers,
        "concurrency": concurrency,
        "max_queue_delay_ms": config.max_queue_delay_ms,
        "seconds_per_figure": options.seconds,
        "python": platform.python_version(),
    }
    if note:
        result["note"] = note
    try:
        _measure(result, options, say, runtime=runtime, pool=pool, jpegs=jpegs, config=config, version=version)
    finally:
        pool.close()
        runtime.close()
    return result


def _bench_config(config: ModelConfig, options: BenchOptions) -> ModelConfig:
    """The model's config with what the bench's flags override."""
    wanted = {"device": options.device if options.device != "auto" else None}
    wanted |= {"backend": options.backend, "precision": options.precision}
    overrides = {k: v for k, v in wanted.items() if v} | {"max_batch_size": max(options.batch_sizes), "warmup": True}
    return msgspec.structs.replace(config, **overrides)


def _measure(
    result: dict[str, Any],
    options: BenchOptions,
    say: Say,
    *,
    runtime: RuntimeLike,
    pool: Preprocessor,
    jpegs: list[bytes],
    config: ModelConfig,
    version: ModelVersion,
) -> None:
    """Each figure asked for, into ``result``."""
    figures, spec = set(options.figures), version.spec
    device, largest, concurrency = result["device"], max(options.batch_sizes), result["concurrency"]
    engine: dict[str, float] = {}
    for size in options.batch_sizes if "engine" in figures else ():
        say(f"engine: batch {size}")
        batch = random_batch(spec, size)

        def engine_step(b: np.ndarray = batch) -> int:
            return len(runtime.run(b))

        engine[str(size)] = _timed(options.seconds, engine_step)
    result["engine_images_per_s"] = engine
    if "decode" in figures:
        result.update(_decode_figures(jpegs, largest, spec, device, pool, options, say))
    # A detector's pipeline reads its output layout as the server does: suppressed, or only selected where the graph
    # suppressed its rows itself (the 1,000-candidate figure needs a "candidates" graph: service/bench/detect.py).
    if isinstance(task_for(spec), Detect) and ("pipeline" in figures or "batcher" in figures):
        say(f"pipeline: decode + resize + run + suppression (where the server does it) and mapping, batch {largest}")
        result.update(detect.pipeline_figures(_timed, jpegs, largest, runtime, pool, options.seconds))
        if "candidates" in figures:
            say(f"the same graph emitting {detect.THOUSAND} candidates an image, and dense candidates")
            result["at_1000"] = detect.thousand(_timed, version, config, device, jpegs, largest, pool, options.seconds)
    elif "pipeline" in figures or "batcher" in figures:  # the batcher's efficiency is measured against it
        say(f"pipeline: decode + preprocess + run, batch {largest}")
        step = _Pipeline(jpegs, largest, runtime, pool.decode_many)
        result["pipeline_images_per_s"] = _timed(options.seconds, step)
        if device.startswith("cuda") and options.gpu_decode:
            say("pipeline with GPU JPEG decoding")
            gpu = GpuJpegDecoder(spec, device)
            step = _Pipeline(jpegs, largest, runtime, lambda chunk: gpu.decode_many(chunk, pool))
            result["pipeline_gpu_decode_images_per_s"] = _timed(options.seconds, step)
    if "batcher" in figures:
        say(f"batcher: {concurrency} concurrent submitters of one JPEG each")
        result["batcher_images_per_s"], result["batcher_mean_batch_size"] = asyncio.run(
            _batcher_figure(runtime, pool, jpegs, config, concurrency, options)
        )
        result["batcher_efficiency"] = result["batcher_images_per_s"] / result["pipeline_images_per_s"]
    if "fake" in figures:
        say("batcher alone, with a runtime that does no work")
        result["fake_items_per_s"], result["fake_mean_batch_size"] = asyncio.run(
            _fake_figure(spec, config, concurrency, options)
        )


def _decode_figures(
    jpegs: list[bytes], size: int, spec: ModelSpec, device: str, pool: Preprocessor, options: BenchOptions, say: Say
) -> dict[str, Any]:
    """Images per second decoded (and resized, cropped) in batches of ``size``: the CPU pool, and nvJPEG on CUDA."""
    cursor = [0]

    def chunk() -> list[bytes]:
        start = cursor[0]
        cursor[0] += size
        return [jpegs[(start + i) % len(jpegs)] for i in range(size)]

    say(f"decode: CPU pool of {pool.workers} threads, batches of {size}")
    out: dict[str, Any] = {"decode_cpu_images_per_s": _timed(options.seconds, lambda: len(pool.decode_many(chunk())))}
    if device.startswith("cuda") and options.gpu_decode:
        say(f"decode: nvJPEG on {device}, batches of {size}")
        gpu = GpuJpegDecoder(spec, device)
        out["decode_gpu_images_per_s"] = _timed(options.seconds, lambda: len(gpu.decode_many(chunk(), pool)))
    else:
        out["decode_gpu_skipped"] = "no CUDA device" if not device.startswith("cuda") else "GPU decode turned off"
    return out


def compare_backends(options: BenchOptions, backends: Sequence[str], say: Say | None = None) -> dict[str, Any]:
    """The engine figure of several backends (same model, device, batches), measured in turns, and the fastest.

    Every runtime is loaded and warmed up first; then, for each batch size, ``ROUNDS`` rounds each give every
    backend an equal slice of ``options.seconds``, in alternating order. Measured one after the other, a shared
    machine's load drifts between backends and decides the ranking (seen on a 2-core VM: whichever backend ran
    first won); in turns, the drift falls on all of them alike. Other requested figures are measured per backend
    with :func:`run_bench`. ``fastest[B]`` names the backend with the most engine images/s at batch B and
    ``ratio_to_fastest[b][B]`` each backend's fraction of that figure.
    """
    say = say or (lambda _m: None)
    entry = ModelRepository(options.repository).model(options.model)
    version = entry.latest
    config = _bench_config(entry.config, replace(options, backend=None))
    devices, _degraded, _note = plan_devices(config, cuda_devices())
    device = devices[0]
    runtimes: dict[str, RuntimeLike] = {}
    try:
        for backend in backends:
            say(f"loading {options.model} ({backend}) on {device}")
            chosen = msgspec.structs.replace(config, backend=backend)
            runtimes[backend] = make_runtime(version, chosen, backend, device, cuda_graphs=options.cuda_graphs)
            warm_up(runtimes[backend], max(options.batch_sizes))
        done = {b: {str(n): 0 for n in options.batch_sizes} for b in backends}
        spent = {b: {str(n): 0.0 for n in options.batch_sizes} for b in backends}
        slice_s = options.seconds / ROUNDS
        for size in options.batch_sizes:
            say(f"engine, in turns: batch {size}")
            batch = random_batch(version.spec, size)
            for r in range(ROUNDS):
                for backend in backends if r % 2 == 0 else tuple(reversed(backends)):
                    runtime = runtimes[backend]
                    started = time.perf_counter()
                    while True:  # at least one batch per slice
                        done[backend][str(size)] += len(runtime.run(batch))
                        if time.perf_counter() - started >= slice_s:
                            break
                    spent[backend][str(size)] += time.perf_counter() - started
    finally:
        for runtime in runtimes.values():
            runtime.close()
    rates = {b: {k: done[b][k] / spent[b][k] for k in done[b]} for b in backends}
    runs: list[dict[str, Any]] = []
    rest = tuple(f for f in options.figures if f != "engine")
    for backend in backends:
        run: dict[str, Any] = {"runtime": backend, "device": device, "engine_images_per_s": rates[backend]}
        more = run_bench(replace(options, backend=backend, figures=rest), say) if rest else {}
        run.update({k: v for k, v in more.items() if k not in ("engine_images_per_s", "runtime")})
        runs.append(run)
    fastest: dict[str, str] = {}
    ratios: dict[str, dict[str, float]] = {b: {} for b in backends}
    for key in (str(n) for n in options.batch_sizes):
        best = max(backends, key=lambda b: rates[b][key])
        fastest[key] = best
        for backend in backends:
            ratios[backend][key] = rates[backend][key] / rates[best][key]
    return {
        "model": options.model,
        "device": device,
        "precision": serving_precision(config, [device]),
        "batch_sizes": list(options.batch_sizes),
        "seconds_per_figure": options.seconds,
        "rounds": ROUNDS,
        "python": platform.python_version(),
        "runs": runs,
        "fastest": fastest,
        "ratio_to_fastest": ratios,
    }


class _Pipeline:
    """The in-process limit without a batcher: decoding the next batch overlaps running the current one."""

    def __init__(
        self, jpegs: list[bytes], size: int, runtime: RuntimeLike, decode: Callable[[list[bytes]], list[Any]]
    ) -> None:
        self.jpegs, self.size, self.runtime, self.decode = jpegs, size, runtime, decode
        self.cursor = 0
        self._decoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-decode")
        self._next = self._decoder.submit(self._decode_next)

    def _decode_next(self) -> np.ndarray:
        chunk = [self.jpegs[(self.cursor + i) % len(self.jpegs)] for i in range(self.size)]
        self.cursor += self.size
        return np.stack([a for a in self.decode(chunk) if isinstance(a, np.ndarray)])

    def __call__(self) -> int:
        batch = self._next.result()
        self._next = self._decoder.submit(self._decode_next)
        return len(self.runtime.run(batch))


async def _batcher_figure(
    runtime: RuntimeLike,
    pool: Preprocessor,
    jpegs: list[bytes],
    config: ModelConfig,
    concurrency: int,
    options: BenchOptions,
) -> tuple[float, float]:
    batcher = Batcher([runtime], batcher_config(config), name=options.model)

    async def make(i: int) -> InferRequest:
        array = await asyncio.wrap_future(pool.submit(jpegs[i % len(jpegs)]))
        return InferRequest(request_id=str(i), model=options.model, images=array[np.newaxis])

    try:
        rate = await _drive(batcher, make, concurrency, options.seconds, warmup_s=1.0)
        return rate, batcher.images / max(batcher.batches, 1)
    finally:
        await batcher.close(timeout_s=5, close_runtimes=False)  # run_bench closes the runtime


async def _fake_figure(
    spec: ModelSpec, config: ModelConfig, concurrency: int, options: BenchOptions
) -> tuple[float, float]:
    fake = FakeRuntime(spec, name="fake")
    batcher = Batcher([fake], batcher_config(config), name="fake")
    images = random_batch(spec, 1)

    async def make(i: int) -> InferRequest:
        return InferRequest(request_id="", model="fake", images=images)

    try:
        rate = await _drive(batcher, make, concurrency, options.seconds, warmup_s=0.5)
        return rate, batcher.images / max(batcher.batches, 1)
    finally:
        await batcher.close(timeout_s=5)
