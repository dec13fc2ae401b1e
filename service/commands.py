"""``visionserve serve`` and ``visionserve bench``. Heavy imports wait until a command runs."""

from __future__ import annotations

import argparse
import json
import sys

from service.cli import comma_ints


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure the engine in-process (no HTTP): the runtime alone per batch size, the decode+run pipeline, "
        "the batcher under many concurrent single-image submitters, and the batcher's own ceiling."
    )
    p.add_argument("--model", required=True, help="model name in the repository")
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--backend", default=None, choices=["onnxruntime", "torchscript"], help="default: config.toml")
    p.add_argument("--batch-sizes", type=comma_ints, default=(1, 8, 32), help="batch sizes; the largest is the maximum")
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


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Serve every model in the repository over HTTP (image API, Open Inference Protocol v2, /metrics)."
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--workers", type=int, default=1, help="server processes, each with its own engines")
    p.add_argument("--admin-token", default=None, help="enables /v2/repository/* for 'Authorization: Bearer TOKEN'")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body (MiB)")
    p.add_argument("--max-images", type=int, default=64, help="most images in one request")
    p.add_argument("--max-pixels", type=int, default=40_000_000, help="most pixels in one image")
    p.add_argument("--drain-timeout-s", type=float, default=10.0, help="how long SIGTERM waits for queued work")
    p.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one access-log line per request"
    )
    p.add_argument("--no-metrics", action="store_true", help="turn /metrics and its recording off")


def run_serve(args: argparse.Namespace) -> int:
    from service.server import serve
    from service.settings import ServerSettings

    settings = ServerSettings(
        repository=args.repository,
        host=args.host,
        port=args.port,
        admin_token=args.admin_token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_images_per_request=args.max_images,
        max_pixels=args.max_pixels,
        drain_timeout_s=args.drain_timeout_s,
        log_format=args.log_format,
        metrics=not args.no_metrics,
    )
    serve(settings, workers=args.workers, log_level=args.log_level)
    return 0
