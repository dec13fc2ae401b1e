"""What a folder run shows: its progress bar, and the summary at its end (counts, failures by reason, latency)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import msgspec

from service.core.percentile import percentile

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


class Tally(msgspec.Struct, kw_only=True):
    """What a run did, for the summary."""

    ok: int = 0
    failed: int = 0
    boxes: int | None = None  # a detection run's detections (None: not a detection run)
    reasons: dict[str, int] = msgspec.field(default_factory=dict)
    latencies_s: list[float] = msgspec.field(default_factory=list)
    requests: int = 0
    retries: int = 0
    seconds: float = 0.0


def reason_of(error: str) -> str:
    """The kind of a failure, for counting: an image's message up to its detail, e.g. "not a recognised image"."""
    return error.split(":", 1)[0].strip()[:80] or "unknown"


def progress_bar(command: str, enabled: bool, console: Console) -> Progress:
    from rich import progress
    from rich.text import Text

    class RateColumn(progress.ProgressColumn):
        def render(self, task: progress.Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text(f"{speed:,.1f} images/s" if speed else "- images/s", style="progress.data.speed")

    return progress.Progress(
        progress.TextColumn(command),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        RateColumn(),
        progress.TimeElapsedColumn(),
        progress.TextColumn("ETA"),
        progress.TimeRemainingColumn(),
        console=console,
        disable=not enabled,
    )


def print_summary(
    tally: Tally, *, skipped: int, passed_over: int, out: str | None, console: Console, done: str = "classified"
) -> None:
    total = tally.ok + tally.failed
    rate = total / tally.seconds if tally.seconds > 0 else 0.0
    line = f"{done} {total} images in {tally.seconds:.1f} s ({rate:,.1f} images/s): {tally.ok} ok, "
    line += f"{tally.failed} failed"
    if tally.boxes is not None:
        line += f"; {tally.boxes} detections"
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
        p50, p90, p99 = (percentile(tally.latencies_s, q) * 1000 for q in (0.5, 0.9, 0.99))
        console.print(
            f"requests: {tally.requests} ({tally.retries} retries); latency per request p50 {p50:.1f} ms, "
            f"p90 {p90:.1f} ms, p99 {p99:.1f} ms",
            highlight=False,
        )
