"""``visionserve classify`` and ``visionserve detect``: every image below some paths, through a server (``--url``)
or in this process, to a CSV or JSON Lines file, with progress, retries, ``--resume`` and a summary. Exits 1 when
any image failed.

The two commands are one run (:func:`run_files`, :func:`_run`); a :class:`Job` is all they differ in: the rows
(:mod:`service.client.output`'s tables), the route and the words of the summary. Without ``--url`` the
client talks to a server in this process (:func:`in_process`: the engine link's in-process side, bound to
127.0.0.1), so a folder takes the server's request path either way.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic

from service.client.client import DEFAULT_MAX_IMAGES_PER_REQUEST
from service.client.errors import ClientError
from service.client.images import discover
from service.client.kinds import CLASSIFY, DETECT, SEGMENT, DetectedImage, Kind, R, SegmentedImage
from service.client.output import ClassifyTable, CocoResults, DetectTable, Output, SegmentTable, Table, overlay
from service.client.retry import RetryPolicy
from service.client.summary import Tally, print_summary, progress_bar, reason_of
from service.core.arguments import add_option_flags, integer_in, number_in, option_flags
from service.core.errors import ConfigError
from service.core.tasks import ClassifyOptions, DetectOptions, SegmentOptions

if TYPE_CHECKING:
    from rich.console import Console

    from service.client.client import AsyncClient

# The flags' ranges: argparse refuses anything else as a usage error naming the flag (exit status 2). The top-k
# range is the server's (image API ``top_k``); the others bound what one run may hold at once or wait for.
MAX_VERSION = 2**63 - 1
MAX_CONCURRENCY = 1024
MAX_IMAGES_PER_REQUEST = 4096
MAX_ATTEMPTS = 1000
MAX_SECONDS = 86400  # a day


def add_classify_arguments(p: argparse.ArgumentParser) -> None:
    _add_arguments(p, "classify", "Classify")
    add_option_flags(p, CLASSIFY.task.Options)


def add_segment_arguments(p: argparse.ArgumentParser) -> None:
    _add_arguments(p, "segment", "Find and outline the objects in")
    p.epilog = (
        "--out F.json: COCO's results JSON (what COCO.loadRes reads: masks as compressed RLE, boxes x, y, w, h), "
        "written at the end; .jsonl: one line per image with its instances and masks; CSV: a row per instance "
        "(a detection's columns and its area)."
    )
    p.add_argument(
        "--annotations",
        default=None,
        metavar="FILE",
        help="with --out F.json: a COCO annotations file whose image ids (by file name) and category ids (by "
        "name) the results take; default: an image's id is its file's stem where a number, else its place",
    )
    p.add_argument("--overlays", default=None, metavar="DIR", help="also write each image with its masks drawn")
    add_option_flags(p, SEGMENT.task.Options)


def add_detect_arguments(p: argparse.ArgumentParser) -> None:
    _add_arguments(p, "detect", "Find the objects in")
    p.epilog = (
        "CSV: one row per box (path, model, version, width, height, label, index, score, the box's columns, "
        "error), one row with an empty label and box for an image with none; JSON Lines: one line per image."
    )
    add_option_flags(p, DETECT.task.Options)


def _add_arguments(p: argparse.ArgumentParser, command: str, verb: str) -> None:
    """The flags both commands take."""
    p.description = (
        f"{verb} image files and folders (recursively; image files are told by their content), written to a CSV or "
        "JSON Lines file: through a server with --url, or in this process from --repository without it. Exits 1 "
        "when any image failed."
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files and folders")
    p.add_argument("--url", default=None, help=f"the server, e.g. http://127.0.0.1:8000; none: {command} in-process")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--version", type=integer_in(1, MAX_VERSION), default=None,
                   help="model version; default: the highest")  # fmt: skip
    p.add_argument(
        "--concurrency",
        type=integer_in(1, MAX_CONCURRENCY),
        default=8,
        help=f"requests in flight at once (with --url), 1 to {MAX_CONCURRENCY}",
    )
    p.add_argument(
        "--images-per-request",
        type=integer_in(1, MAX_IMAGES_PER_REQUEST),
        default=DEFAULT_MAX_IMAGES_PER_REQUEST,
        help=f"images sent in one request, 1 to {MAX_IMAGES_PER_REQUEST} (lowered at once to a server's smaller "
        "--max-images)",
    )
    p.add_argument("--out", default=None, help="output file, .csv or .jsonl; default: CSV on stdout")
    p.add_argument("--resume", action="store_true", help="skip the images --out already holds results for; append")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument(
        "--timeout",
        type=number_in(0, MAX_SECONDS, above=True),
        default=60.0,
        help=f"seconds to wait for one answer (with --url), more than 0 and at most {MAX_SECONDS}",
    )
    p.add_argument(
        "--max-attempts",
        type=integer_in(1, MAX_ATTEMPTS),
        default=6,
        help=f"tries per request on 503/429 or a dropped connection, 1 to {MAX_ATTEMPTS}",
    )
    p.add_argument(
        "--max-retry-s",
        type=number_in(0, MAX_SECONDS),
        default=120.0,
        help=f"time limit for one request's retries, 0 to {MAX_SECONDS}",
    )
    p.add_argument("--repository", default="model_repository", help="model repository (without --url)")
    p.add_argument("--device", default="auto", help="device without --url: auto (config.toml's), cpu, cuda, cuda:N")


@dataclass(frozen=True)
class Job(Generic[R]):
    """What one command is to the shared run: its route (``kind``: the task, the result type) with the options the
    flags give (the server checks them), the summary's verb and its rows."""

    kind: Kind[R]
    options: dict[str, Any]
    done: str  # "classified 12 images in ..."
    table: Table[R]


async def run_files(
    files: Sequence[Path],
    job: Job[R],
    client: AsyncClient,
    *,
    chunk_size: int,
    concurrency: int,
    output: Output[R],
    tally: Tally,
    advance: Callable[[int], None],
) -> None:
    """Send ``files`` through ``client`` in chunks, ``concurrency`` chunks at a time, writing each result as it comes
    (an image that got no answer, its file unreadable or its request refused, as a result with its error)."""
    chunks = [list(files[i : i + chunk_size]) for i in range(0, len(files), chunk_size)]
    queue: asyncio.Queue[list[Path]] = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)

    def record(path: Path, result: R, reason: str | None = None) -> None:
        output.write(str(path), result)
        if result.ok:
            tally.ok += 1
            if isinstance(result, DetectedImage | SegmentedImage):
                found = result.detections if isinstance(result, DetectedImage) else result.instances
                tally.boxes = (tally.boxes or 0) + len(found or [])
        else:
            tally.failed += 1
            key = reason or reason_of(result.error or "")
            tally.reasons[key] = tally.reasons.get(key, 0) + 1

    async def worker() -> None:
        while not queue.empty():
            chunk = queue.get_nowait()
            datas = await asyncio.to_thread(list, map(_read, chunk))
            readable = {path: data for path, data in zip(chunk, datas, strict=True) if isinstance(data, bytes)}
            for path, data in zip(chunk, datas, strict=True):
                if isinstance(data, str):
                    record(path, job.kind.result(error=data), "unreadable file")
            if readable:
                started = time.perf_counter()
                reason = None
                try:
                    results = await client.ask(job.kind, list(readable.values()), job.options)
                except ClientError as exc:
                    if exc.status == 404:
                        raise  # an unknown model or version: every request would fail the same way
                    reason = "no answer (connection)" if exc.status is None else f"HTTP {exc.status}"
                    results = [job.kind.result(error=str(exc)) for _ in readable]
                else:
                    tally.latencies_s.append(time.perf_counter() - started)
                for path, result in zip(readable, results, strict=True):
                    record(path, result, reason)
            output.flush()
            advance(len(chunk))

    started = time.perf_counter()
    tasks = [asyncio.create_task(worker()) for _ in range(max(1, min(concurrency, len(chunks))))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tally.seconds += time.perf_counter() - started


def _read(path: Path) -> bytes | str:
    """The file's bytes, or why it could not be read."""
    try:
        return path.read_bytes()
    except OSError as exc:
        return f"cannot read {path}: {exc.strerror or exc}"


def run_classify(args: argparse.Namespace) -> int:
    return _run_command(args, CLASSIFY, "classified", ClassifyTable(args.top_k or ClassifyOptions().top_k))


def run_detect(args: argparse.Namespace) -> int:
    return _run_command(args, DETECT, "searched", DetectTable(args.box_format or DetectOptions().box_format))


def run_segment(args: argparse.Namespace) -> int:
    if (args.mask_format or "rle") != "rle" and Path(args.out or "").suffix.lower() == ".json":
        raise ConfigError("--out F.json is COCO's results JSON, whose masks are RLE: leave --mask-format out")
    return _run_command(args, SEGMENT, "segmented", SegmentTable(args.box_format or SegmentOptions().box_format))


def _run_command(args: argparse.Namespace, kind: Kind[Any], done: str, table: Table[Any]) -> int:
    from rich.console import Console

    job = Job(kind, option_flags(args, kind.task.Options), done, table)

    err = Console(stderr=True, soft_wrap=True)  # a summary line stays one line in a log
    files, passed_over = discover(args.paths)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        err.print(f"no such file or folder: {', '.join(missing)}", highlight=False)
        return 2
    if not files:
        err.print(f"no image files under {', '.join(args.paths)}", highlight=False)
        return 2
    overlays = Path(args.overlays) if getattr(args, "overlays", None) else None
    output: Output[Any] = Output(
        args.out, job.table, resume=args.resume, overwrite=args.overwrite,
        coco=CocoResults([str(f) for f in files], getattr(args, "annotations", None)),
        each=(lambda path, result: overlay(path, result, overlays)) if overlays else None,
    )  # fmt: skip
    todo = [f for f in files if str(f) not in output.done]
    tally = Tally(boxes=0 if job.table.counts_boxes else None)
    interrupted = False
    try:
        if todo:
            with in_process(args, job, err) as url:
                asyncio.run(_run(args, url, job, todo, output, tally, err))
    except KeyboardInterrupt:
        interrupted = True  # what was done is in the file (rows are flushed per request): --resume goes on
    finally:
        output.close()
    skipped = len(files) - len(todo)
    print_summary(tally, skipped=skipped, passed_over=passed_over, out=args.out, console=err, done=job.done)
    if interrupted:
        raise KeyboardInterrupt
    return 1 if tally.failed else 0


@contextmanager
def in_process(args: argparse.Namespace, job: Job[Any], err: Console) -> Iterator[str]:
    """The server to send to: ``--url``, or without it one in this process on 127.0.0.1 (the engine link's
    in-process side) serving ``--model`` alone from ``--repository`` on ``--device``, stopped at the end. A model
    of another task is refused first, naming the command that fits."""
    if args.url:
        yield args.url
        return
    from service.core.repository import ModelRepository
    from service.core.settings import ServerSettings
    from service.core.tasks import task_named
    from service.inprocess import InProcessServer

    entry = ModelRepository(Path(args.repository).resolve()).model(args.model, deep=False)
    served = task_named(entry.version(args.version).spec.task)
    if served is not job.kind.task:
        raise ConfigError(
            f"model {args.model!r} is a {served.name} model: visionserve {job.kind.action} does not fit it; run "
            f"visionserve {served.name} instead"
        )
    if not args.no_progress:
        err.print(f"loading {args.model} from {args.repository} ...", highlight=False)
    gpus = None if args.device in ("auto", "cuda") else [] if args.device == "cpu" else [args.device]
    with tempfile.TemporaryDirectory(prefix="visionserve-") as view:  # the repository, seen as this model alone
        (Path(view) / args.model).symlink_to(entry.path, target_is_directory=True)
        settings = ServerSettings(repository=view, port=0, grpc_port=0, metrics=False)
        with InProcessServer(settings, gpus=gpus) as server:
            yield server.url


async def _run(
    args: argparse.Namespace, url: str, job: Job[R], todo: list[Path], output: Output[R], tally: Tally, err: Console
) -> None:
    from service.client.client import AsyncClient

    progress = progress_bar(job.kind.action, not args.no_progress, err)
    task = progress.add_task(job.kind.action, total=len(todo))
    client = AsyncClient(
        url,
        model=args.model,
        version=args.version,
        timeout_s=args.timeout,
        retry=RetryPolicy(max_attempts=args.max_attempts, max_total_s=args.max_retry_s),
        max_images_per_request=args.images_per_request,
        max_concurrency=args.concurrency,  # sizes its connection pool; each call here is one request
    )
    try:
        with progress:
            await run_files(todo, job, client, chunk_size=args.images_per_request, concurrency=args.concurrency,
                            output=output, tally=tally, advance=partial(progress.advance, task))  # fmt: skip
    finally:
        tally.requests, tally.retries = client.requests_sent, client.retries
        await client.aclose()
