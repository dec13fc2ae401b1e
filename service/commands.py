"""``visionserve bench`` (and, later, ``serve``). Heavy imports wait until a command runs."""

from __future__ import annotations

import argparse
import json
import sys


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
    return sizes


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure the engine in-process (no HTTP): the runtime alone per batch size, the decode+run pipeline, "
        "the batcher under many concurrent single-image submitters, and the batcher's own ceiling."
    )
    p.add_argument("--model", required=True, help="model name in the repository")
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--backend", default=None, choices=["onnxruntime", "torchscript"], help="default: config.toml")
    p.add_argument("--batch-sizes", type=_sizes, default=(1, 8, 32), help="batch sizes; the largest is the maximum")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per figure")
    p.add_argument("--concurrency", type=int, default=None, help="batcher submitters; default: 2 x largest batch")
    p.add_argument("--images", default=None, help="folder of images to decode; default: generated 500x375 JPEGs")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from service.bench import BenchOptions
    from service.bench import run_bench as bench

    err = Console(stderr=True)
    options = BenchOptions(
        model=args.model,
        repository=args.repository,
        device=args.device,
        backend=args.backend,
        batch_sizes=args.batch_sizes,
        seconds=args.seconds,
        concurrency=args.concurrency,
        images=args.images,
    )
    result = bench(options, say=None if args.no_progress else lambda m: err.print(f"[dim]... {m}[/dim]"))
    if args.json:
        print(json.dumps(result))
        return 0
    out = Console(file=sys.stdout)
    out.print(f"{result['model']} v{result['version']} on {result['device']} ({result['runtime']})")
    for size, rate in result["engine_images_per_s"].items():
        out.print(f"  engine, batch {size:>4}: {rate:10.1f} images/s")
    out.print(
        f"  pipeline (decode + run, batch {max(options.batch_sizes)}): {result['pipeline_images_per_s']:.1f} images/s"
    )
    if "pipeline_gpu_decode_images_per_s" in result:
        out.print(f"  pipeline with GPU JPEG decode: {result['pipeline_gpu_decode_images_per_s']:.1f} images/s")
    out.print(
        f"  batcher ({result['concurrency']} submitters): {result['batcher_images_per_s']:.1f} images/s, "
        f"efficiency {result['batcher_efficiency']:.3f} of the pipeline, "
        f"mean batch {result['batcher_mean_batch_size']:.1f}"
    )
    out.print(f"  batcher alone (no-op runtime): {result['fake_items_per_s']:.0f} items/s")
    return 0
