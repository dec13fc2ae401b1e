"""``visionserve loadtest --streams N``: the streams mode's command (README, "Load testing"; :mod:`loadtest.streams`
runs it, :mod:`loadtest.stream_report` reports it), with the server's own counts read from ``/metrics`` around it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from loadtest.streams import StreamPlan, StreamRun

STREAM_OUTCOMES = "visionserve_stream_frames_total|"  # {outcome}: the server's count of each frame's fate


def add_stream_arguments(p: argparse.ArgumentParser) -> None:
    """The streams mode's flags (the run's length, grace, images and output are the load tester's own)."""
    p.add_argument("--streams", type=int, default=None, help="streams mode: open this many WebSocket streams "
                   "(/v1/models/M/stream, docs/streams.md) sending frames on a schedule for --warmup + --duration "
                   "seconds, and report each one's answered rate, answer age, drops and the accounting of every "
                   "frame; --drain is the grace for answers owed (default: off, requests over HTTP)")  # fmt: skip
    p.add_argument("--fps", type=float, default=10.0, help="with --streams: frames per second per stream")
    p.add_argument("--max-age-ms", type=float, default=500.0, help="with --streams: each stream's max_age_ms (a "
                   "frame older than this is dropped by the server)")  # fmt: skip
    p.add_argument("--stream-fps-first", type=float, default=None, help="with --streams: the first stream's frames "
                   "per second, for fairness runs (default: --fps)")  # fmt: skip


def _usage_error(args: argparse.Namespace) -> str | None:
    clashes = [flag for flag, given in (
        ("--models", args.models is not None), ("--slo-p99-ms", args.slo_p99_ms is not None),
        ("--compare", args.compare is not None), ("--write-sequence", bool(args.write_sequence)),
        ("--protocol", args.protocol != "image"), ("--images-per-request", args.images_per_request != 1),
        ("--processes", args.processes != 1),
    ) if given]  # fmt: skip
    if clashes:
        return f"--streams runs one model's streams from one process: drop {', '.join(clashes)}"
    if args.streams < 1 or args.fps <= 0 or (args.stream_fps_first is not None and args.stream_fps_first <= 0):
        return f"--streams must be >= 1, --fps and --stream-fps-first > 0; got {args.streams}, {args.fps:g}, " \
               f"{args.stream_fps_first}"  # fmt: skip
    if not 0 < args.max_age_ms <= 60_000:
        return f"--max-age-ms must be in (0, 60000] (the server's bound), got {args.max_age_ms:g}"
    return None


def run_streams_loadtest(args: argparse.Namespace) -> int:
    from rich.console import Console

    from loadtest.stream_report import print_report, summarise, write_files
    from loadtest.streams import StreamPlan, preflight
    from service.core.samples import image_files, photo_like_jpegs

    err = Console(stderr=True)
    problem = _usage_error(args)
    if problem is None:
        try:
            plan = StreamPlan(
                url=args.url.rstrip("/"), model=args.model, streams=args.streams, fps=args.fps,
                max_age_ms=args.max_age_ms, fps_first=args.stream_fps_first, duration_s=args.duration,
                warmup_s=args.warmup, drain_s=args.drain, connect_timeout_s=args.timeout,
            )  # fmt: skip
            images = image_files(args.images) if args.images else photo_like_jpegs(32, args.image_size)
        except (OSError, ValueError) as exc:
            problem = str(exc)
        else:
            problem = preflight(plan, images[0])
    if problem:
        err.print(f"[red]not starting the load test:[/red] {problem}")
        return 2
    run, server = measure(plan, images, None if args.no_progress else err)
    report = summarise(run, server, args.max_send_lag_ms)
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report, Console(width=None if sys.stdout.isatty() else 170))
    if args.out:
        from loadtest.plots import streams_over_time

        folder = Path(args.out)
        files = write_files(report, folder)
        title = f"{plan.model}: {plan.streams} streams at {plan.total_fps:.4g} frames/s, max age {plan.max_age_ms:g} ms"
        files.append(streams_over_time(report, folder / "streams_over_time.png", title))
        err.print("wrote " + ", ".join(str(f) for f in files))
    return 0 if report["accounting"]["ok"] else 1


def measure(plan: StreamPlan, images: list[bytes], progress: Console | None = None) -> tuple[StreamRun, Any]:
    """Run ``plan``, with a progress bar on ``progress`` when given, and read the server's ``/metrics`` before and
    after: its per-stage means (per-batch compute among them) and its own count of the frames' fates (None from a
    server without metrics)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from loadtest.scrape import scrape, server_split
    from loadtest.streams import run_streams

    before = scrape(plan.url, plan.model)
    bar = None if progress is None else Progress(
        TextColumn("{task.description:>18}"), BarColumn(), TextColumn("{task.fields[sent]} sent, "
        "{task.fields[answers]} answers"), TimeRemainingColumn(), console=progress, transient=False,
    )  # fmt: skip
    if bar is None:
        run = run_streams(plan, images)
    else:
        task = bar.add_task(f"{plan.streams} streams", total=plan.end_s, sent=0, answers=0)

        def tick(elapsed_s: float, sent: int, answers: int) -> None:
            bar.update(task, completed=min(plan.end_s, elapsed_s), sent=sent, answers=answers)

        with bar:
            run = run_streams(plan, images, tick)
    after = scrape(plan.url, plan.model)
    server = server_split(before, after)
    if server is not None and before is not None and after is not None:
        server["stream_frames"] = {k.removeprefix(STREAM_OUTCOMES): int(v - before.get(k, 0.0))
                                   for k, v in after.items() if k.startswith(STREAM_OUTCOMES)}  # fmt: skip
    return run, server
