"""``visionserve serve`` and ``visionserve bench``. Heavy imports wait until a command runs."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from service.core.arguments import comma_ints
from service.core.errors import ConfigError


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    allowed = ("onnxruntime", "torchscript", "aoti")
    bad = [n for n in names if n not in allowed]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(allowed)}, got {text!r}")
    return names


def _figures(text: str) -> tuple[str, ...]:
    from service.engine.bench import FIGURES

    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in FIGURES for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(FIGURES)}, got {text!r}")
    return names


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Measure the engine in-process (no HTTP): the runtime alone per batch size, the decode+run pipeline, "
        "the batcher under many concurrent single-image submitters, and the batcher's own ceiling. With several "
        "backends (--backend onnxruntime,torchscript,aoti) it measures each in turn and names the fastest per "
        "batch size."
    )
    p.add_argument("--model", required=True, help="model name in the repository")
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--backend",
        type=_backends,
        default=None,
        help="onnxruntime, torchscript or aoti, or a comma-separated list to compare; None: config.toml's",
    )
    p.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "fp16", "bf16", "int8"],
        help="fp16/bf16 on GPU, int8 (model.int8.onnx, onnxruntime) anywhere; None: config.toml's",
    )
    p.add_argument(
        "--cuda-graphs", default="on", choices=["on", "off"], help="torch runtimes on CUDA: a graph per batch bucket"
    )
    p.add_argument(
        "--figures",
        type=_figures,
        default=("engine", "pipeline", "decode", "batcher", "fake"),
        help="which figures to measure: engine, pipeline, decode (CPU pool vs nvJPEG), batcher, fake",
    )
    p.add_argument("--batch-sizes", type=comma_ints, default=(1, 8, 32), help="batch sizes; the largest is the maximum")
    p.add_argument("--seconds", type=float, default=5.0, help="measuring time per figure")
    p.add_argument("--concurrency", type=int, default=None, help="batcher submitters; default: 2 x largest batch")
    p.add_argument("--images", default=None, help="folder of images to decode; default: generated 500x375 JPEGs")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")


def _print_run(out: Any, result: dict[str, Any]) -> None:
    shown = result["device"].startswith("cuda") or result["precision"] == "int8"
    precision = f", {result['precision']}" if shown else ""
    graphs = ", CUDA graphs" if result.get("cuda_graphs") else ""
    out.print(f"{result['model']} v{result['version']} on {result['device']} ({result['runtime']}{precision}{graphs})")
    for size, rate in result["engine_images_per_s"].items():
        out.print(f"  engine, batch {size:>4}: {rate:10.1f} images/s")
    if "decode_cpu_images_per_s" in result:
        gpu = result.get("decode_gpu_images_per_s")
        gpu_text = f"{gpu:.1f} images/s" if gpu is not None else f"skipped ({result.get('decode_gpu_skipped')})"
        out.print(f"  decode, CPU pool: {result['decode_cpu_images_per_s']:.1f} images/s; nvJPEG: {gpu_text}")
    if "pipeline_images_per_s" in result:
        largest = max(result["batch_sizes"])
        out.print(f"  pipeline (decode + run, batch {largest}): {result['pipeline_images_per_s']:.1f} images/s")
    if "pipeline_gpu_decode_images_per_s" in result:
        out.print(f"  pipeline with GPU JPEG decode: {result['pipeline_gpu_decode_images_per_s']:.1f} images/s")
    if "batcher_images_per_s" in result:
        out.print(
            f"  batcher ({result['concurrency']} submitters): {result['batcher_images_per_s']:.1f} images/s, "
            f"efficiency {result['batcher_efficiency']:.3f} of the pipeline, "
            f"mean batch {result['batcher_mean_batch_size']:.1f}"
        )
    if "fake_items_per_s" in result:
        out.print(f"  batcher alone (no-op runtime): {result['fake_items_per_s']:.0f} items/s")


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from service.engine.bench import BenchOptions, compare_backends
    from service.engine.bench import run_bench as bench

    err = Console(stderr=True)
    backends: tuple[str, ...] = args.backend or ()
    options = BenchOptions(
        model=args.model,
        repository=args.repository,
        device=args.device,
        backend=backends[0] if len(backends) == 1 else None,
        batch_sizes=args.batch_sizes,
        seconds=args.seconds,
        concurrency=args.concurrency,
        images=args.images,
        precision=args.precision,
        cuda_graphs=args.cuda_graphs == "on",
        figures=args.figures,
    )
    say = None if args.no_progress else lambda m: err.print(f"[dim]... {m}[/dim]")
    out = Console(file=sys.stdout, width=max(Console().width, 100))
    if len(backends) > 1:
        compared = compare_backends(options, backends, say=say)
        if args.json:
            print(json.dumps(compared))
            return 0
        table = Table(title=f"engine images/s, {args.model} on {compared['device']} (in turns; ratio to the fastest)")
        table.add_column("batch")
        for result in compared["runs"]:
            table.add_column(result["runtime"], justify="right")
        table.add_column("fastest")
        for size in (str(b) for b in options.batch_sizes):
            rates = [r["engine_images_per_s"].get(size, 0.0) for r in compared["runs"]]
            ratios = compared["ratio_to_fastest"]
            cells = [
                f"{rate:.1f} ({ratios[r['runtime']].get(size, 0):.2f})"
                for rate, r in zip(rates, compared["runs"], strict=True)
            ]
            table.add_row(size, *cells, compared["fastest"].get(size, "-"))
        out.print(table)
        return 0
    result = bench(options, say=say)
    if args.json:
        print(json.dumps(result))
        return 0
    _print_run(out, result)
    return 0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Serve every model in the repository over HTTP (image API, Open Inference Protocol v2, /metrics)."
    p.add_argument("--repository", default="model_repository", help="model repository folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC (Open Inference Protocol) port; 0: no gRPC")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="HTTP front-end processes feeding one engine per device; 0: half the cores, 1 to 8 (printed at start)",
    )
    p.add_argument(
        "--shm-mb", type=int, default=64, help="each front end's shared-memory arena for image tensors (MiB)"
    )
    p.add_argument(
        "--engine-timeout-s", type=float, default=120.0, help="a request the engine has not answered by then is a 504"
    )
    p.add_argument("--admin-token", default=None, help="enables /v2/repository/* for 'Authorization: Bearer TOKEN'")
    p.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body (MiB)")
    p.add_argument("--max-images", type=int, default=64, help="most images in one request")
    p.add_argument("--max-pixels", type=int, default=40_000_000, help="most pixels in one image")
    p.add_argument(
        "--large-image-pixels",
        type=int,
        default=4_000_000,
        help="images that decode to more pixels than this are decoded in a lane of their own (half the decode "
        "workers, a short bounded queue, 503 past it), so that they never hold up small ones",
    )
    p.add_argument("--drain-timeout-s", type=float, default=10.0, help="how long SIGTERM waits for queued work")
    p.add_argument(
        "--max-header-kb", type=float, default=64.0, help="largest request head (request line and headers), KiB; 431"
    )
    p.add_argument(
        "--header-timeout-s",
        type=float,
        default=10.0,
        help="a request head must arrive within this of the connection opening or the request starting; else 408",
    )
    p.add_argument(
        "--stream-send-timeout-s",
        type=float,
        default=10.0,
        help="a stream's answer its client has not taken within this: the client is cut off (close 1008)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=10.0,
        help="a request body that stalls this long, or is slower than --min-body-bytes-per-s after it, is a 408",
    )
    p.add_argument(
        "--min-body-bytes-per-s",
        type=int,
        default=1024,
        help="slowest average a request body may arrive at once --body-timeout-s has passed (0: no minimum)",
    )
    p.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one access-log line per request"
    )
    p.add_argument("--no-metrics", action="store_true", help="turn /metrics and its recording off")
    p.add_argument(
        "--memory-budget",
        default="",
        help="memory for models per device: 2GB for each, or cpu=8GB,cuda:0=60GB; empty: 70%% of the machine's "
        'memory, 90%% of each GPU\'s (models with residency = "on_demand" are loaded and evicted within it)',
    )
    p.add_argument(
        "--min-residency-s", type=float, default=1.0, help="a model loaded more recently is not evicted (churn guard)"
    )
    p.add_argument("--max-parallel-loads", type=int, default=2, help="on-demand loads of different models at once")
    p.add_argument(
        "--cold-start-limit-s", type=float, default=60.0, help="longest a request waits for its model's load"
    )
    p.add_argument(
        "--strict-readiness",
        action="store_true",
        help="/v2/health/ready stays false while any model version of the repository failed to load (Triton's "
        "name); off: ready once the engines serve what did load",
    )


def run_serve(args: argparse.Namespace) -> int:
    from service.core.settings import ServerSettings
    from service.supervisor import SupervisorOptions, serve

    settings = ServerSettings(
        repository=args.repository,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        admin_token=args.admin_token,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_images_per_request=args.max_images,
        max_pixels=args.max_pixels,
        drain_timeout_s=args.drain_timeout_s,
        log_format=args.log_format,
        metrics=not args.no_metrics,
        engine_timeout_s=args.engine_timeout_s,
        max_header_bytes=int(args.max_header_kb * 1024),
        large_image_pixels=args.large_image_pixels,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        stream_send_timeout_s=args.stream_send_timeout_s,
        min_body_bytes_per_s=args.min_body_bytes_per_s,
        strict_readiness=args.strict_readiness,
        memory_budget=args.memory_budget,
        min_residency_s=args.min_residency_s,
        max_parallel_loads=args.max_parallel_loads,
        cold_start_limit_s=args.cold_start_limit_s,
    )
    if args.workers < 0 or args.shm_mb < 1:
        raise ConfigError(f"--workers must be >= 0 and --shm-mb >= 1, got {args.workers} and {args.shm_mb}")
    return serve(settings, SupervisorOptions(workers=args.workers, shm_mb=args.shm_mb, log_level=args.log_level))
