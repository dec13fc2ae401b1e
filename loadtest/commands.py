"""``visionserve loadtest``: closed or open loop steps, the p99-target search, reports, plots and regressions.

Heavy imports (httpx, numpy, matplotlib) wait until the command runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from service.core.arguments import comma_floats, comma_ints, size_pair

if TYPE_CHECKING:
    from rich.console import Console

    from loadtest.inputs import Payload
    from loadtest.slo import SloSearch
    from loadtest.step import StepBounds, StepResult


def add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Load a server over HTTP and report throughput and latency per step. Closed loop: each virtual client sends, "
        "waits, sends again. Open loop: requests leave on a schedule whatever the answers do, and latency counts "
        "from each scheduled send (no coordinated omission)."
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--model", required=True, help="model to classify with")
    p.add_argument("--mode", default="closed", choices=["closed", "open"], help="closed or open loop")
    p.add_argument("--concurrency", type=comma_ints, default=(1, 4, 16), help="closed loop: clients per step")
    p.add_argument(
        "--rate",
        type=comma_floats,
        default=None,
        help="open loop: requests/s per step (None: 50,100); with --slo-p99-ms the first is where the "
        "search starts (None: 10)",
    )
    p.add_argument("--arrival", default="poisson", choices=["poisson", "constant"], help="open loop: arrivals")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per step")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds per step before measuring (not counted)")
    p.add_argument(
        "--drain",
        type=float,
        default=10.0,
        help="seconds after a step's window to wait for answers still owed; then they count as errors",
    )
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout in seconds")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="most requests per step (warm-up included)")
    p.add_argument("--images", default=None, help="folder of images, cycled; default: generated JPEGs")
    p.add_argument("--image-size", type=size_pair, default=(500, 375), help="generated JPEGs: WIDTHxHEIGHT")
    p.add_argument(
        "--protocol",
        default="image",
        choices=["image", "v2", "grpc"],
        help="image: POST /v1/models/M/classify; v2: /v2/models/M/infer with binary tensors; grpc: ModelInfer "
        "with raw contents at --grpc-url",
    )
    p.add_argument(
        "--grpc-url", default="127.0.0.1:8001", help="with --protocol grpc: the server's gRPC address (host:port)"
    )
    p.add_argument("--images-per-request", type=int, default=1, help="images in each request")
    p.add_argument("--processes", type=int, default=1, help="load-generating processes, each with its own loop")
    p.add_argument(
        "--max-send-lag-ms",
        type=float,
        default=10.0,
        help="open loop: flag a step as client-limited when the send lag p99 exceeds this",
    )
    p.add_argument("--max-inflight", type=int, default=1024, help="most requests in flight per process")
    p.add_argument(
        "--slo-p99-ms",
        type=float,
        default=None,
        help="search (open loop, bisection on the rate) for the highest rate meeting this p99",
    )
    p.add_argument("--slo-max-steps", type=int, default=10, help="most steps the p99-target search runs")
    p.add_argument("--compare", default=None, help="a previous results.json: print changes, exit 1 on a regression")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="with --compare: the throughput fall or p99 rise (a fraction) that counts as a regression",
    )
    p.add_argument("--out", default=None, help="folder for results.json, steps.csv and PNG plots")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson schedules")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of a table")


def _preflight_grpc(target: str, payload: Any, timeout_s: float) -> str | None:
    import grpc

    with grpc.insecure_channel(target.removeprefix("grpc://")) as channel:
        call = channel.unary_unary(payload.path, request_serializer=None, response_deserializer=None)
        try:
            call(payload.body, timeout=timeout_s)
        except grpc.RpcError as exc:
            return f"{payload.path} at {target} answered {exc.code().name}: {exc.details()}"
    return None


def _preflight(url: str, payload: Any) -> str | None:
    import httpx

    try:
        r = httpx.post(url + payload.path, content=payload.body, headers=payload.headers, timeout=60)
    except httpx.HTTPError as exc:
        return f"cannot reach {url}: {exc}"
    if r.status_code != 200:
        return f"{payload.path} answered {r.status_code}: {r.text[:300]}"
    return None


def run_loadtest(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loadtest.report import compare, print_comparison, print_report
    from loadtest.step import StepBounds

    err = Console(stderr=True)
    url = args.url.rstrip("/")
    ready = _payloads(args, url, err)
    if ready is None:
        return 2
    bodies, grpc_target = ready
    bounds = StepBounds(
        url=url, warmup_s=args.warmup, duration_s=args.duration, drain_s=args.drain, timeout_s=args.timeout,
        max_requests=args.max_requests, max_send_lag_ms=args.max_send_lag_ms, max_inflight=args.max_inflight,
        seed=args.seed, grpc_target=grpc_target,
    )  # fmt: skip
    mode = "open" if args.slo_p99_ms is not None else args.mode
    steps, slo = _run_steps(args, bodies, bounds, mode, err)
    report: dict[str, Any] = {
        "url": url, "model": args.model, "mode": mode, "protocol": args.protocol,
        "images_per_request": args.images_per_request, "processes": args.processes,
        "warmup_s": args.warmup, "duration_s": args.duration, "steps": [s.summary() for s in steps],
        "slo": slo.summary() if slo else None,
    }  # fmt: skip
    out = Console(width=None if sys.stdout.isatty() else 170)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report, out)
    if args.out:
        _write_files(args, report, steps, mode, err)
    if args.compare:
        rows, regressed = compare(report, json.loads(Path(args.compare).read_text()), args.tolerance)
        print_comparison(rows, args.tolerance, err if args.json else out)
        if not rows:
            return 2
        if regressed:
            return 1
    return 0


def _payloads(args: argparse.Namespace, url: str, err: Console) -> tuple[list[Payload], str] | None:
    """The request bodies, and the gRPC target ("" over HTTP), once the first body has been answered; None (and
    why, on ``err``) when the flags, the images or the server rule the load test out."""
    from loadtest.inputs import payloads
    from service.core.samples import image_files, photo_like_jpegs

    if args.processes < 1 or args.images_per_request < 1 or min(args.duration, args.timeout) <= 0:
        err.print("--processes and --images-per-request must be >= 1; --duration and --timeout > 0")
        return None
    try:
        images = image_files(args.images) if args.images else photo_like_jpegs(32, args.image_size)
    except (OSError, ValueError) as exc:
        err.print(f"--images: {exc}")
        return None
    bodies = payloads(args.model, images, protocol=args.protocol, per_request=args.images_per_request)
    grpc_target = args.grpc_url if args.protocol == "grpc" else ""
    problem = _preflight_grpc(grpc_target, bodies[0], 60) if grpc_target else _preflight(url, bodies[0])
    if problem:
        err.print(f"[red]not starting the load test:[/red] {problem}")
        return None
    return bodies, grpc_target


def _run_steps(
    args: argparse.Namespace, bodies: list[Payload], bounds: StepBounds, mode: str, err: Console
) -> tuple[list[StepResult], SloSearch | None]:
    """The steps the flags ask for (the p99-target search's, with ``--slo-p99-ms``), with progress bars."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from loadtest.pool import WorkerPool
    from loadtest.slo import search
    from loadtest.step import StepSpec, run_step

    progress = None if args.no_progress else Progress(
        TextColumn("{task.description:>18}"), BarColumn(), TextColumn("{task.fields[answers]} answers"),
        TimeRemainingColumn(), console=err, transient=False,
    )  # fmt: skip
    steps: list[StepResult] = []
    slo = None
    with WorkerPool(args.processes, bodies) as pool:
        if progress is not None:
            progress.start()
        try:

            def step(spec: StepSpec) -> StepResult:
                result = run_step(pool, spec, bounds, args.model, progress)
                steps.append(result)
                return result

            if args.slo_p99_ms is not None:
                start = args.rate[0] if args.rate else 10.0
                slo = search(lambda rate: step(StepSpec("open", rate=rate, arrival=args.arrival)), args.slo_p99_ms,
                             start_rate=start, max_steps=args.slo_max_steps)  # fmt: skip
            elif mode == "closed":
                for c in args.concurrency:
                    step(StepSpec("closed", concurrency=c))
            else:
                for rate in args.rate or (50.0, 100.0):
                    step(StepSpec("open", rate=rate, arrival=args.arrival))
        finally:
            if progress is not None:
                progress.stop()
    return steps, slo


def _write_files(
    args: argparse.Namespace, report: dict[str, Any], steps: list[StepResult], mode: str, err: Console
) -> None:
    """results.json, steps.csv and the plots into ``--out``."""
    from loadtest.plots import draw_all
    from loadtest.report import write_files

    folder = Path(args.out)
    files = write_files(report, folder)
    title = f"{args.model}: {mode} loop, {args.protocol} protocol"
    files += draw_all(sorted(steps, key=lambda s: (s.spec.concurrency, s.spec.rate)), folder, title,
                      args.slo_p99_ms)  # fmt: skip
    err.print("wrote " + ", ".join(str(f) for f in files))
