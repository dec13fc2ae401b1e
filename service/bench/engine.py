"""``visionserve bench``: the engine's limits in-process, with no HTTP. The yardstick served throughput is held
against.

Four figures, on the same model, device and images (docs/performance.md, "The engine in-process", says more):
``engine_images_per_s[B]``, the runtime alone on ready uint8 batches of size B; ``pipeline_images_per_s``, decode,
stack and run at the largest batch size with no batcher; ``batcher_images_per_s``, many submitters of one JPEG each
through the decoding pool and the batcher (``batcher_efficiency``: its ratio to the pipeline); ``fake_items_per_s``,
the batcher alone with a runtime that does no work. On request, the CPU decoding pool beside nvJPEG, and a
detector's suppression figures (:mod:`service.bench.detect`). :func:`compare_backends` runs the same figures once per
backend and names the fastest per batch size: the measurement behind ``backend = "auto"``.
"""

from __future__ import annotations

import asyncio
import itertools
import platform
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from service.bench.flags import FIGURES
from service.bench.pipeline import Pipeline, timed
from service.core.config import ModelConfig
from service.core.decoding import GpuJpegDecoder, Preprocessor
from service.core.errors import ConfigError
from service.core.repository import ModelRepository, random_batch
from service.core.samples import image_files, photo_like_jpegs
from service.core.tasks import Detect, task_for
from service.engine.batcher import Batcher, InferRequest
from service.engine.model import batcher_config, cuda_devices, plan_devices, serving_precision
from service.runtime import FakeRuntime, RuntimeLike, choose_backend, make_runtime, warm_up

Say = Callable[[str], None]
Make = Callable[[int], Awaitable[InferRequest]]
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


def _pipeline_rate(seconds: float, jpegs: list[bytes], size: int, runtime: RuntimeLike, decode: Any) -> float:
    def stacked(chunk: list[bytes]) -> np.ndarray:
        return np.stack([a for a in decode(chunk) if isinstance(a, np.ndarray)])

    with closing(Pipeline(jpegs, size, runtime, stacked)) as step:
        return timed(seconds, step)


async def _batcher_figure(
    runtime: RuntimeLike, make: Make, name: str, config: ModelConfig, concurrency: int, seconds: float, warmup_s: float
) -> tuple[float, float]:
    """Images per second through a batcher on ``runtime`` from ``concurrency`` submitters (``make(i)``: the i-th
    request) and its mean batch size."""
    batcher = Batcher([runtime], batcher_config(config), name=name)
    counting, done = False, 0
    stop_at = time.perf_counter() + warmup_s + seconds

    async def submitter(i: int) -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await batcher.submit(await make(i))
            if counting:
                done += 1
            i += concurrency

    try:
        tasks = [asyncio.create_task(submitter(k)) for k in range(concurrency)]
        await asyncio.sleep(warmup_s)
        counting, started = True, time.perf_counter()
        await asyncio.gather(*tasks)
        return done / (time.perf_counter() - started), batcher.images / max(batcher.batches, 1)
    finally:
        await batcher.close(timeout_s=5, close_runtimes=False)  # the caller closes the runtime


def run_bench(options: BenchOptions, say: Say | None = None) -> dict[str, Any]:
    """Measure and return the figures (see the module docstring) as a JSON-ready dict."""
    from service.bench import detect

    say = say or (lambda _m: None)
    entry = ModelRepository(options.repository).model(options.model)
    version, spec = entry.latest, entry.latest.spec
    config = _bench_config(entry.config, options)
    devices, _degraded, note = plan_devices(config, cuda_devices())
    device = devices[0]
    backend = choose_backend(version, config, device)
    figures, largest = set(options.figures), max(options.batch_sizes)
    concurrency = options.concurrency or 2 * largest
    if options.images:
        jpegs, described = load_images(options.images), options.images
    elif isinstance(task_for(spec), Detect):
        jpegs, described = detect.default_images()
    else:
        jpegs = photo_like_jpegs()
        described = f"{len(jpegs)} generated 500x375 JPEGs"
    say(f"loading {options.model} v{version.version} ({backend}) on {device}")
    runtime = make_runtime(version, config, backend, device, cuda_graphs=options.cuda_graphs)
    warm_up(runtime, largest)
    with closing(runtime), closing(Preprocessor(spec)) as pool:
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
        result.update(_figures(options, figures, version, config, spec, device, runtime, pool, jpegs, say))
    return result


def _figures(
    options: BenchOptions, figures: set[str], version: Any, config: ModelConfig, spec: Any, device: str,
    runtime: RuntimeLike, pool: Preprocessor, jpegs: list[bytes], say: Say,
) -> dict[str, Any]:  # fmt: skip
    """The figures ``options`` ask for, on the loaded ``runtime`` and the decoding ``pool``."""
    from service.bench import detect

    largest = max(options.batch_sizes)
    concurrency = options.concurrency or 2 * largest
    result: dict[str, Any] = {}
    result["engine_images_per_s"] = {}
    for size in options.batch_sizes if "engine" in figures else ():
        say(f"engine: batch {size}")
        batch = random_batch(spec, size)

        def engine_step(b: np.ndarray = batch) -> int:
            return len(runtime.run(b))

        result["engine_images_per_s"][str(size)] = timed(options.seconds, engine_step)
    if "decode" in figures:
        result.update(_decode_figures(jpegs, largest, device, pool, options, say))
    # A detector's pipeline reads its output layout as the server does: suppressed, or only selected where the
    # graph suppressed its rows itself (the 1,000-candidate figure needs a "candidates" graph: detect.py).
    if isinstance(task_for(spec), Detect) and ("pipeline" in figures or "batcher" in figures):
        say(f"pipeline: decode + resize + run + suppression (where the server does it) and mapping, batch {largest}")
        result.update(detect.pipeline_figures(jpegs, largest, runtime, pool, options.seconds))
        if spec.output_layout == "yolo-seg":
            say("a YOLO-seg head at 640 with 30 instances: the server's answer, masks as RLE")
            result["yolo_seg"] = detect.time_yolo_seg(options.seconds)
        if "candidates" in figures:
            say(f"the same graph emitting {detect.THOUSAND} candidates an image, and dense candidates")
            result["at_1000"] = detect.thousand(version, config, device, jpegs, largest, pool, options.seconds)
    elif "pipeline" in figures or "batcher" in figures:  # the batcher's efficiency is measured against it
        say(f"pipeline: decode + preprocess + run, batch {largest}")
        result["pipeline_images_per_s"] = _pipeline_rate(options.seconds, jpegs, largest, runtime, pool.decode_many)
        if device.startswith("cuda") and options.gpu_decode:
            say("pipeline with GPU JPEG decoding")
            decoder = GpuJpegDecoder(spec, device)
            rate = _pipeline_rate(options.seconds, jpegs, largest, runtime, lambda c: decoder.decode_many(c, pool))
            result["pipeline_gpu_decode_images_per_s"] = rate
    if "batcher" in figures:
        say(f"batcher: {concurrency} concurrent submitters of one JPEG each")

        async def one_jpeg(i: int) -> InferRequest:
            array = await asyncio.wrap_future(pool.submit(jpegs[i % len(jpegs)]))
            return InferRequest(request_id=str(i), model=options.model, images=array[np.newaxis])

        served = _batcher_figure(runtime, one_jpeg, options.model, config, concurrency, options.seconds, 1.0)
        result["batcher_images_per_s"], result["batcher_mean_batch_size"] = asyncio.run(served)
        result["batcher_efficiency"] = result["batcher_images_per_s"] / result["pipeline_images_per_s"]
    if "fake" in figures:
        say("batcher alone, with a runtime that does no work")
        images = random_batch(spec, 1)

        async def ready(i: int) -> InferRequest:
            return InferRequest(request_id="", model="fake", images=images)

        with closing(FakeRuntime(spec, name="fake")) as fake:
            idle = _batcher_figure(fake, ready, "fake", config, concurrency, options.seconds, 0.5)
            result["fake_items_per_s"], result["fake_mean_batch_size"] = asyncio.run(idle)
    return result


def _bench_config(config: ModelConfig, options: BenchOptions) -> ModelConfig:
    """The model's config with what the bench's flags override."""
    wanted = {"device": options.device if options.device != "auto" else None}
    wanted |= {"backend": options.backend, "precision": options.precision}
    overrides = {k: v for k, v in wanted.items() if v} | {"max_batch_size": max(options.batch_sizes), "warmup": True}
    return msgspec.structs.replace(config, **overrides)


def _decode_figures(
    jpegs: list[bytes], size: int, device: str, pool: Preprocessor, options: BenchOptions, say: Say
) -> dict[str, Any]:
    """Images per second decoded (and resized, cropped) in batches of ``size``: the CPU pool, and nvJPEG on CUDA."""
    images = itertools.cycle(jpegs)

    def chunk() -> list[bytes]:
        return list(itertools.islice(images, size))

    say(f"decode: CPU pool of {pool.workers} threads, batches of {size}")
    out: dict[str, Any] = {"decode_cpu_images_per_s": timed(options.seconds, lambda: len(pool.decode_many(chunk())))}
    if device.startswith("cuda") and options.gpu_decode:
        say(f"decode: nvJPEG on {device}, batches of {size}")
        gpu = GpuJpegDecoder(pool.spec, device)
        out["decode_gpu_images_per_s"] = timed(options.seconds, lambda: len(gpu.decode_many(chunk(), pool)))
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
    device = plan_devices(config, cuda_devices())[0][0]
    keys = [str(n) for n in options.batch_sizes]
    done = {b: dict.fromkeys(keys, 0) for b in backends}
    spent = {b: dict.fromkeys(keys, 0.0) for b in backends}
    runtimes: dict[str, RuntimeLike] = {}
    try:
        for backend in backends:
            say(f"loading {options.model} ({backend}) on {device}")
            chosen = msgspec.structs.replace(config, backend=backend)
            runtimes[backend] = make_runtime(version, chosen, backend, device, cuda_graphs=options.cuda_graphs)
            warm_up(runtimes[backend], max(options.batch_sizes))
        for size, key in zip(options.batch_sizes, keys, strict=True):
            say(f"engine, in turns: batch {size}")
            batch = random_batch(version.spec, size)
            for r in range(ROUNDS):
                for backend in backends if r % 2 == 0 else backends[::-1]:
                    started = time.perf_counter()
                    while True:  # at least one batch per slice
                        done[backend][key] += len(runtimes[backend].run(batch))
                        if time.perf_counter() - started >= options.seconds / ROUNDS:
                            break
                    spent[backend][key] += time.perf_counter() - started
    finally:
        for runtime in runtimes.values():
            runtime.close()
    rates = {b: {k: done[b][k] / spent[b][k] for k in keys} for b in backends}
    fastest = {k: max(backends, key=lambda b: rates[b][k]) for k in keys}
    rest = tuple(f for f in options.figures if f != "engine")
    runs = []
    for backend in backends:
        more = run_bench(replace(options, backend=backend, figures=rest), say) if rest else {}
        more = {k: v for k, v in more.items() if k not in ("engine_images_per_s", "runtime")}
        runs.append({"runtime": backend, "device": device, "engine_images_per_s": rates[backend], **more})
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
        "ratio_to_fastest": {b: {k: rates[b][k] / rates[fastest[k]][k] for k in keys} for b in backends},
    }
