"""``visionserve classify``: every image below some paths, through a server (``--url``) or in this process, to a
CSV or JSON Lines file, with progress, retries, ``--resume`` and a summary. Exits 1 when any image failed."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from service.client.client import DEFAULT_MAX_IMAGES_PER_REQUEST
from service.client.errors import ClientError
from service.client.images import discover
from service.client.output import Output
from service.client.retry import RetryPolicy
from service.core.answers import ImageResult
from service.core.arguments import integer_in, number_in

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

# The flags' ranges: argparse refuses anything else as a usage error naming the flag (exit status 2). The top-k
# range is the server's (image API ``top_k``); the others bound what one run may hold at once or wait for.
MAX_VERSION = 2**63 - 1
MAX_TOP_K = 1000
MAX_CONCURRENCY = 1024
MAX_IMAGES_PER_REQUEST = 4096
MAX_ATTEMPTS = 1000
MAX_SECONDS = 86400  # a day

ClassifyChunk = Callable[[list[bytes], list[str]], Awaitable[list[ImageResult]]]


def add_classify_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Classify image files and folders (recursively; image files are told by their content) into a CSV or JSON "
        "Lines file: through a server with --url, or in this process from --repository without it. Exits 1 when "
        "any image failed."
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files and folders")
    p.add_argument("--url", default=None, help="the server, e.g. http://127.0.0.1:8000; none: classify in-process")
    p.add_argument("--model", required=True, help="model name")
    p.add_argument("--version", type=integer_in(1, MAX_VERSION), default=None,
                   help="model version; default: the highest")  # fmt: skip
    p.add_argument("--top-k", type=integer_in(1, MAX_TOP_K), default=5, help=f"classes per image, 1 to {MAX_TOP_K}")
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


class Tally(msgspec.Struct, kw_only=True):
    """What a run did, for the summary."""

    ok: int = 0
    failed: int = 0
    reasons: dict[str, int] = msgspec.field(default_factory=dict)
    latencies_s: list[float] = msgspec.field(default_factory=list)
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0


def reason_of(error: str) -> str:
    """The kind of a failure, for counting: an image's message up to its detail, e.g. "not a recognised image"."""
    return error.split(":", 1)[0].strip()[:80] or "unknown"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (q in 0..100)."""
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


async def classify_files(
    files: Sequence[Path],
    classify_chunk: ClassifyChunk,
    *,
    chunk_size: int,
    concurrency: int,
    output: Output,
    tally: Tally,
    advance: Callable[[int], None],
) -> None:
    """Classify ``files`` in chunks, ``concurrency`` chunks at a time, writing each result as it comes."""
    chunks = [list(files[i : i + chunk_size]) for i in range(0, len(files), chunk_size)]
    queue: asyncio.Queue[list[Path]] = asyncio.Queue()
    for chunk in chunks:
        queue.put_nowait(chunk)

    def record(path: Path, result: ImageResult, reason: str | None = None) -> None:
        output.write(str(path), result)
        if result.ok:
            tally.ok += 1
        else:
            tally.failed += 1
            key = reason or reason_of(result.error or "")
            tally.reasons[key] = tally.reasons.get(key, 0) + 1

    async def worker() -> None:
        while not queue.empty():
            chunk = queue.get_nowait()
            datas, readable = await asyncio.to_thread(_read_all, chunk)
            for path, data in zip(chunk, datas, strict=True):
                if isinstance(data, str):
                    record(path, ImageResult(error=data), "unreadable file")
            if readable:
                started = time.perf_counter()
                try:
                    good = [d for d in datas if isinstance(d, bytes)]
                    results = await classify_chunk(good, [p.name for p in readable])
                except ClientError as exc:
                    if exc.status == 404:
                        raise  # an unknown model or version: every request would fail the same way
                    reason = "no answer (connection)" if exc.status is None else f"HTTP {exc.status}"
                    results = [ImageResult(error=str(exc)) for _ in readable]
                    for path, result in zip(readable, results, strict=True):
                        record(path, result, reason)
                else:
                    tally.latencies_s.append(time.perf_counter() - started)
                    for path, result in zip(readable, results, strict=True):
                        record(path, result)
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


def _read_all(paths: list[Path]) -> tuple[list[bytes | str], list[Path]]:
    """Each file's bytes, or why it could not be read; and the paths that could."""
    out: list[bytes | str] = []
    readable: list[Path] = []
    for path in paths:
        try:
            out.append(path.read_bytes())
            readable.append(path)
        except OSError as exc:
            out.append(f"cannot read {path}: {exc.strerror or exc}")
    return out, readable


def _progress(total: int, enabled: bool, console: Console) -> Progress:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        Task,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class RateColumn(ProgressColumn):
        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.1f} images/s" if speed else "- images/s", style="progress.data.speed")

    return Progress(
        TextColumn("classify"),
        BarColumn(),
        MofNCompleteColumn(),
        RateColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def print_summary(tally: Tally, *, skipped: int, passed_over: int, out: str | None, console: Console) -> None:
    total = tally.ok + tally.failed
    rate = total / tally.seconds if tally.seconds > 0 else 0.0
    line = f"classified {total} images in {tally.seconds:.1f} s ({rate:,.1f} images/s): {tally.ok} ok, "
    line += f"{tally.failed} failed"
    if skipped:
        line += f"; {skipped} skipped (already in {out})"
    if passed_over:
        line += f"; {passed_over} files passed over (not images)"
    console.print(line, highlight=False)
    if tally.reasons:
        console.print("failures by reason:", highlight=False)
        for reason, count in Counter(tally.reasons).most_common():
            console.print(f"  {count:>6}  {reason}", highlight=False, markup=False)
    if tally.latencies_s:
        p50, p90, p99 = (percentile(tally.latencies_s, q) * 1000 for q in (50, 90, 99))
        console.print(
            f"requests: {tally.requests} ({tally.retries} retries); latency per request p50 {p50:.1f} ms, "
            f"p90 {p90:.1f} ms, p99 {p99:.1f} ms",
            highlight=False,
        )


def run_classify(args: argparse.Namespace) -> int:
    from rich.console import Console

    err = Console(stderr=True, soft_wrap=True)  # a summary line stays one line in a log
    files, passed_over = discover(args.paths)
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        err.print(f"no such file or folder: {', '.join(missing)}", highlight=False)
        return 2
    if not files:
        err.print(f"no image files under {', '.join(args.paths)}", highlight=False)
        return 2
    output = Output(args.out, top_k=args.top_k, resume=args.resume, overwrite=args.overwrite)
    todo = [f for f in files if str(f) not in output.done]
    tally = Tally()
    interrupted = False
    try:
        if todo:
            asyncio.run(_run(args, todo, output, tally, err))
    except KeyboardInterrupt:
        interrupted = True  # what was done is in the file (rows are flushed per request): --resume goes on
    finally:
        output.close()
    print_summary(tally, skipped=len(files) - len(todo), passed_over=passed_over, out=args.out, console=err)
    if interrupted:
        raise KeyboardInterrupt
    return 1 if tally.failed else 0


async def _run(args: argparse.Namespace, todo: list[Path], output: Output, tally: Tally, err: Console) -> None:
    progress = _progress(len(todo), not args.no_progress, err)
    task = progress.add_task("classify", total=len(todo))

    def advance(n: int) -> None:
        progress.advance(task, n)

    if args.url:
        from service.client.client import AsyncClient

        policy = RetryPolicy(max_attempts=args.max_attempts, max_total_s=args.max_retry_s)
        client = AsyncClient(
            args.url,
            model=args.model,
            version=args.version,
            timeout_s=args.timeout,
            retry=policy,
            max_images_per_request=args.images_per_request,
            max_concurrency=args.concurrency,  # sizes its connection pool; each call here is one request
        )

        async def remote(datas: list[bytes], _names: list[str]) -> list[ImageResult]:
            return await client.classify(datas, top_k=args.top_k)

        try:
            with progress:
                await classify_files(todo, remote, chunk_size=args.images_per_request, concurrency=args.concurrency,
                                     output=output, tally=tally, advance=advance)  # fmt: skip
        finally:
            tally.requests, tally.retries = client.requests_sent, client.retries
            await client.aclose()
    else:
        from service.client.local import LocalClassifier

        if not args.no_progress:
            err.print(f"loading {args.model} from {args.repository} ...", highlight=False)
        local = LocalClassifier(args.repository, args.model, version=args.version, device=args.device)

        async def in_process(datas: list[bytes], names: list[str]) -> list[ImageResult]:
            return await asyncio.to_thread(local.classify, datas, top_k=args.top_k, names=names)

        try:
            with progress:
                # Two chunks at once: one decodes in the pool while the other runs on the device.
                await classify_files(todo, in_process, chunk_size=local.max_batch_size, concurrency=2, output=output,
                                     tally=tally, advance=advance)  # fmt: skip
        finally:
            tally.requests = len(tally.latencies_s)
            local.close()
