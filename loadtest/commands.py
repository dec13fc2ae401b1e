"""``visionserve loadtest``: closed or open loop steps, the p99-target search, reports, plots and regressions;
over one model (``--model``) or several with a popularity (``--models``, :mod:`loadtest.mix`); or WebSocket streams
of frames (``--streams``, :mod:`loadtest.stream_command`).

Heavy imports (httpx, numpy, matplotlib) wait until the command runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loadtest.stream_command import add_stream_arguments
from service.core.arguments import add_option_flags, comma_floats, comma_ints, option_flags, size_pair
from service.core.tasks import TASKS, fields, task_named

if TYPE_CHECKING:
    from rich.console import Console

    from loadtest.answers import Reference
    from loadtest.inputs import Payload
    from loadtest.mix import ModelMix
    from loadtest.slo import SloSearch
    from loadtest.step import StepBounds, StepResult


def add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Load a server over HTTP and report throughput and latency per step. Closed loop: each virtual client sends, "
        "waits, sends again. Open loop: requests leave on a schedule whatever the answers do, and latency counts "
        "from each scheduled send (no coordinated omission). Streams (--streams): WebSocket streams of frames, each on "
        "its own schedule, every frame's fate accounted for (docs/streams.md)."
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    _add_model_arguments(p)
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
    _add_answer_arguments(p)
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
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson schedules and of the --models draw")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object instead of a table")
    add_stream_arguments(p)


def _add_answer_arguments(p: argparse.ArgumentParser) -> None:
    """Which route the image API's requests take, and the check of a detector's answers (:mod:`loadtest.answers`)."""
    p.add_argument(
        "--task",
        default="auto",
        choices=["auto", *TASKS],
        help="the image API's route: classify, detect, or auto (the model's, from its v2 metadata)",
    )
    p.add_argument(
        "--reference",
        default=None,
        help="a detector's answers checked against this JSON file of the boxes known in each --images file "
        "({name: [{box: [x1, y1, x2, y2], label}]}, docs/loadtest.md); the share of matching answers is printed",
    )
    p.add_argument(
        "--min-match",
        type=float,
        default=None,
        help="with --reference: exit 1 when a step's share of matching answers is below this (None: never)",
    )
    p.add_argument(
        "--check-answers",
        type=int,
        default=2000,
        help="with --reference: the answers of at most this many measured requests a step are kept and checked",
    )
    p.add_argument("--processes", type=int, default=1, help="load-generating processes, each with its own loop")
    add_option_flags(
        p.add_argument_group(
            "the task's options",
            "sent with every request where the model's task takes them (as the image API's query, v2 or gRPC "
            "parameters); left out, the lightest answer: top_k 1 for a classifier, the model's defaults otherwise",
        ),
        *(task.Options for task in TASKS.values()),
    )


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Which model or models each request is for (and, for several, how they are drawn)."""
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--model", help="model to classify with")
    which.add_argument(
        "--models",
        help="several models, comma-separated (a,b,c), each request's drawn by --popularity and reported per model "
        "with its cold starts and the hit rate; an item with * ? [ is a pattern matched against the server's "
        "repository index (needs --admin-token) and expands to the matching names, sorted",
    )
    p.add_argument(
        "--popularity",
        default="uniform",
        help="with --models: uniform, or zipf:S (P(rank k) ~ 1/k^S, ranked as listed, a pattern's names sorted)",
    )
    p.add_argument("--admin-token", default=None, help="the server's admin token, to read its repository index")
    p.add_argument(
        "--write-sequence",
        default=None,
        metavar="FILE",
        help="with --models: write every request's model, one name per line in the order sent (the preflight "
        "first, warm-up included, all steps), to replay a cache offline",
    )


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
    return f"{payload.path} answered {r.status_code}: {r.text[:300]}" if r.status_code != 200 else None


def run_loadtest(args: argparse.Namespace) -> int:
    if args.streams is not None:
        from loadtest.stream_command import run_streams_loadtest

        return run_streams_loadtest(args)
    from rich.console import Console

    from loadtest.report import compare, print_comparison, print_report
    from loadtest.step import StepBounds

    err = Console(stderr=True)
    url = args.url.rstrip("/")
    try:
        mix = _mix(args, url)
    except ValueError as exc:
        err.print(f"[red]not starting the load test:[/red] {exc}")
        return 2
    names = list(mix.names) if mix else [args.model]
    ready = _payloads(args, url, names, err)
    if ready is None:
        return 2
    bodies, grpc_target, task, reference = ready
    bounds = StepBounds(
        url=url, warmup_s=args.warmup, duration_s=args.duration, drain_s=args.drain, timeout_s=args.timeout,
        max_requests=args.max_requests, max_send_lag_ms=args.max_send_lag_ms, max_inflight=args.max_inflight,
        seed=args.seed, grpc_target=grpc_target, mix=mix, keep_sequence=bool(args.write_sequence),
        keep_answers=args.check_answers if reference is not None else 0,
    )  # fmt: skip
    mode = "open" if args.slo_p99_ms is not None else args.mode
    steps, slo = _run_steps(args, bodies, bounds, mode, err)
    mismatched = _check_answers(steps, reference, args.min_match) if reference is not None else []
    report: dict[str, Any] = {
        "url": url, "model": ",".join(names), "mode": mode, "protocol": args.protocol, "task": task,
        "images_per_request": args.images_per_request, "processes": args.processes,
        "warmup_s": args.warmup, "duration_s": args.duration, "steps": [s.summary() for s in steps],
        "slo": slo.summary() if slo else None, "reference": args.reference, "min_match": args.min_match,
    }  # fmt: skip
    if mix:
        report |= _mix_report(args, mix, steps, grpc_target)
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
    if mismatched:
        err.print(f"[red]answer check failed:[/red] {'; '.join(mismatched)}")
        return 1
    return 0


def _check_answers(steps: list[StepResult], reference: Reference, min_match: float | None) -> list[str]:
    """Each step's kept answers checked against ``reference`` (into ``step.check``); the steps whose share of
    matching answers is under ``min_match``, or that had no answer to check, described."""
    from loadtest.answers import check

    failed = []
    for s in steps:
        result = check(s.answers, reference)
        s.check, s.answers = result.summary(), []
        if min_match is not None and (result.images == 0 or result.share < min_match):
            failed.append(f"{s.spec.label}: {result.matching} of {result.images} answers matched the reference "
                          f"({100 * result.share:.1f}% < {100 * min_match:g}%)")  # fmt: skip
    return failed


def _task(url: str, model: str, protocol: str) -> str:
    """The model's task, from its v2 metadata (a detector's outputs are DETECTIONS and NUM_DETECTIONS); classify
    when it cannot be read (the preflight then says why)."""
    import httpx

    try:
        meta = httpx.get(f"{url}/v2/models/{model}", timeout=30).json()
        outputs = {o.get("name") for o in meta.get("outputs", [])}
    except (httpx.HTTPError, ValueError, AttributeError):
        return "classify"
    return next((name for name, task in TASKS.items() if set(task.output_names) == outputs), "classify")


def _mix(args: argparse.Namespace, url: str) -> ModelMix | None:
    """The models of ``--models`` (patterns expanded from the server's repository index) under ``--popularity``;
    None for ``--model``. Raises ValueError (naming the flags and why) when the flags or the index rule it out."""
    from loadtest.mix import expand, is_pattern, make_mix, repository_names, split_models

    if args.models is None:
        if args.popularity != "uniform" or args.write_sequence:
            raise ValueError("--popularity and --write-sequence go with --models (one model: --models NAME)")
        return None
    items = split_models(args.models)
    try:
        if not items:
            raise ValueError("give at least one model name or pattern")
        available = repository_names(url, args.admin_token) if any(is_pattern(i) for i in items) else None
        return make_mix(expand(items, available), args.popularity)
    except ValueError as exc:
        raise ValueError(f"--models {args.models!r} --popularity {args.popularity!r}: {exc}") from exc


def _mix_report(args: argparse.Namespace, mix: ModelMix, steps: list[StepResult], grpc_target: str) -> dict[str, Any]:
    """The report's fields of a ``--models`` run: the draw, the sequence file, and per model over all its steps."""
    from loadtest.mix import merged, summary

    totals = merged([s.models for s in steps], len(mix.names))
    return {
        "popularity": mix.popularity, "seed": args.seed, "preflight": mix.names[0],
        "sent": sum(s.sent for s in steps), "sequence_file": args.write_sequence,
        "sequence_requests": 1 + sum(s.sent for s in steps) if args.write_sequence else None,
    } | summary(mix, totals, cold_observed=not grpc_target)  # fmt: skip


def _payloads(
    args: argparse.Namespace, url: str, names: list[str], err: Console
) -> tuple[list[list[Payload]], str, str, Reference | None] | None:
    """The request bodies of each of ``names``, the gRPC target ("" over HTTP), the task and the reference (None
    without ``--reference``), once the first model's first body has been answered (the others are not tried: with
    on-demand loading that would load them before the load); None (and why, on ``err``) when the flags, the
    images or the server rule the load test out."""
    from loadtest.answers import load_reference
    from loadtest.inputs import LIGHTEST, model_payloads, named_images
    from service.core.samples import photo_like_jpegs

    if args.processes < 1 or args.images_per_request < 1 or min(args.duration, args.timeout) <= 0:
        err.print("--processes and --images-per-request must be >= 1; --duration and --timeout > 0")
        return None
    if args.reference and (not args.images or args.protocol != "image" or args.check_answers < 1):
        err.print("--reference needs --images (the files it names), --protocol image and --check-answers >= 1")
        return None
    try:
        files, images = named_images(args.images) if args.images else (None, photo_like_jpegs(32, args.image_size))
        reference = load_reference(args.reference) if args.reference else None
    except (OSError, ValueError) as exc:
        err.print(f"--images or --reference: {exc}")
        return None
    task = _task(url, names[0], args.protocol) if args.task == "auto" else args.task
    if reference is not None and task_named(task).gate != "boxes":
        err.print(f"--reference checks a detector's answers; {names[0]} is served as a {task} model")
        return None
    given = option_flags(args, *(t.Options for t in TASKS.values()))
    taken = {f.name for f in fields(task_named(task).Options)}
    if set(given) - taken:
        err.print(f"{', '.join('--' + n.replace('_', '-') for n in sorted(set(given) - taken))}: not an option of "
                  f"a {task} model ({names[0]}), which takes {', '.join(sorted(taken)) or 'none'}")  # fmt: skip
        return None
    bodies = model_payloads(names, images, protocol=args.protocol, per_request=args.images_per_request, task=task,
                            names=files, options={**LIGHTEST, **given})  # fmt: skip
    grpc_target = args.grpc_url if args.protocol == "grpc" else ""
    first = bodies[0][0]
    problem = _preflight_grpc(grpc_target, first, 60) if grpc_target else _preflight(url, first)
    if problem:
        err.print(f"[red]not starting the load test:[/red] {problem}")
        return None
    return bodies, grpc_target, task, reference


def _run_steps(
    args: argparse.Namespace, bodies: list[list[Payload]], bounds: StepBounds, mode: str, err: Console
) -> tuple[list[StepResult], SloSearch | None]:
    """The steps the flags ask for (the p99-target search's, with ``--slo-p99-ms``), with progress bars; with
    ``--write-sequence``, each step's requests appended to the file as it ends (the preflight's first)."""
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
    names = bounds.mix.names if bounds.mix else (args.model,)
    sequence = Path(args.write_sequence) if args.write_sequence else None
    if sequence is not None:
        sequence.parent.mkdir(parents=True, exist_ok=True)
        sequence.write_text(names[0] + "\n")  # the preflight's request
    with WorkerPool(args.processes, bodies) as pool, progress if progress is not None else contextlib.nullcontext():

        def step(spec: StepSpec) -> StepResult:
            result = run_step(pool, spec, bounds, names[0], progress)
            if sequence is not None:
                with sequence.open("a") as f:
                    f.writelines(names[m] + "\n" for m in result.sequence)
                result.sequence = []  # written: not kept for the whole run
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
    return steps, slo


def _write_files(
    args: argparse.Namespace, report: dict[str, Any], steps: list[StepResult], mode: str, err: Console
) -> None:
    """results.json, steps.csv and the plots into ``--out``."""
    from loadtest.plots import draw_all
    from loadtest.report import write_files

    folder = Path(args.out)
    files = write_files(report, folder)
    title = f"{args.models or args.model}: {mode} loop, {args.protocol} protocol"
    files += draw_all(sorted(steps, key=lambda s: (s.spec.concurrency, s.spec.rate)), folder, title,
                      args.slo_p99_ms)  # fmt: skip
    err.print("wrote " + ", ".join(str(f) for f in files))
