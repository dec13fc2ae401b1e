"""PNG plots of a load test: latency percentiles against throughput across steps, latency over time, and the
latency distribution (a percentile spectrum, as HdrHistogram draws it, so the tail is not squeezed into a corner);
a streams run's frames, ages and shares second by second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from loadtest.step import PERCENTILES, StepResult


def pyplot():  # type: ignore[no-untyped-def]
    """matplotlib.pyplot, drawing to files only (no display on a server)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _log_ms_axis(ax) -> None:  # type: ignore[no-untyped-def]
    """A log-scale latency axis labelled with plain numbers (5, 10, 20 ms), not powers of ten."""
    import math

    from matplotlib.ticker import FuncFormatter

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))

    def minor(v: float, _: object) -> str:  # 2 and 5 of each decade only, so the labels do not collide
        lead = round(v / 10 ** math.floor(math.log10(v)), 6)
        return f"{v:g}" if lead in (2, 5) else ""

    ax.yaxis.set_minor_formatter(FuncFormatter(minor))
    ax.set_ylabel("latency (ms, log scale)")


def save(fig, ax, title: str, path: Path, **options: Any) -> Path:  # type: ignore[no-untyped-def]
    """What every plot ends with: the title, a grid, the file (``options`` for ``savefig``), and the figure's memory
    given back."""
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, **options)
    pyplot().close(fig)
    return path


def latency_vs_throughput(steps: list[StepResult], path: Path, title: str, slo_ms: float | None = None) -> Path:
    fig, ax = pyplot().subplots(figsize=(8, 5))
    x = [s.requests_per_s for s in steps]  # in the order the load grew: a throughput falling back shows as such
    for q in PERCENTILES:
        ax.plot(x, [s.latency_ms(q) for s in steps], marker="o", label=f"p{q:g}")
    for s in steps:
        note = s.spec.label + (" (client-limited)" if s.client_limited else "")
        ax.annotate(note, (s.requests_per_s, s.latency_ms(99)), textcoords="offset points", xytext=(4, 6), fontsize=7)
    if slo_ms is not None:
        ax.axhline(slo_ms, color="red", linestyle="--", linewidth=1, label=f"p99 target {slo_ms:g} ms")
    _log_ms_axis(ax)
    ax.set_xlabel("throughput (requests/s)")
    ax.legend()
    return save(fig, ax, title, path)


def latency_over_time(steps: list[StepResult], path: Path, title: str) -> Path:
    """Every measured request (dots, by send time) and the p99 of each second, the steps laid end to end."""
    fig, ax = pyplot().subplots(figsize=(10, 4.5))
    offset = 0.0
    for s in steps:
        if s.timeline:
            t = np.array([r[0] for r in s.timeline]) + offset
            lat = np.array([r[1] for r in s.timeline]) * 1000
            ok = np.array([r[2] for r in s.timeline])
            ax.scatter(t[ok], lat[ok], s=2, alpha=0.3)
            if (~ok).any():
                ax.scatter(t[~ok], lat[~ok], s=6, marker="x", color="red")
            seconds = np.floor(t - offset).astype(int)
            marks = [(offset + k + 0.5, np.percentile(lat[seconds == k], 99)) for k in np.unique(seconds)]
            ax.plot(*zip(*marks, strict=True), color="black", linewidth=1)
        ax.axvline(offset, color="grey", linewidth=0.5)
        ax.text(offset, 1.0, " " + s.spec.label, transform=ax.get_xaxis_transform(), fontsize=7, va="top")
        offset += s.duration_s
    _log_ms_axis(ax)
    ax.set_xlabel("time (s, measured windows end to end); line: p99 per second; x: errors")
    return save(fig, ax, title, path)


def latency_distribution(steps: list[StepResult], path: Path, title: str) -> Path:
    fig, ax = pyplot().subplots(figsize=(8, 5))
    from matplotlib.ticker import NullLocator

    for s in steps:
        if not s.latency.count:
            continue
        values, counts = s.latency.points()
        q = np.cumsum(counts) / s.latency.count
        q = np.minimum(q, 1 - 0.5 / s.latency.count)  # the last point on a finite axis
        ax.step(1 / (1 - q), values * 1000, where="post", label=s.spec.label)
    ticks = [0.0, 0.5, 0.9, 0.99, 0.999, 0.9999]
    ax.set_xscale("log")
    ax.set_xticks([1 / (1 - t) for t in ticks], [f"{100 * t:g}%" for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    _log_ms_axis(ax)
    ax.set_xlabel("percentile")
    ax.legend(fontsize=8)
    return save(fig, ax, title, path)


def draw_all(steps: list[StepResult], out: Path, title: str, slo_ms: float | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    return [
        latency_vs_throughput(steps, out / "latency_vs_throughput.png", title, slo_ms),
        latency_over_time(steps, out / "latency_over_time.png", title),
        latency_distribution(steps, out / "latency_distribution.png", title),
    ]


def streams_over_time(report: dict[str, Any], path: Path, title: str) -> Path:
    """A streams run (:mod:`loadtest.stream_report`) second by second, by the frames' due time: the frames sent by
    fate, stacked (answered at the bottom, the drops above it); the answered frames' age p50 and p99 (the server's)
    with the client's latency p99; and each stream's answered rate (a fast stream should get no more than its share).
    """
    rows = report["timeline"]
    t = np.array([r["t_s"] for r in rows], dtype=float)
    span = np.array([r["span_s"] for r in rows], dtype=float)
    fig, (frames, ages, shares) = pyplot().subplots(3, 1, figsize=(10, 9), sharex=True)
    bottom = np.zeros(len(rows))
    fates = (("result", "answered", "tab:green"), ("superseded", "superseded", "tab:orange"),
             ("expired", "expired", "tab:red"), ("error", "error", "tab:purple"),
             ("lost", "lost", "black"))  # fmt: skip
    for key, label, color in fates:
        per_s = np.array([r[key] for r in rows], dtype=float) / span
        if key == "result" or per_s.any():
            frames.bar(t + 0.5, per_s, width=0.9, bottom=bottom, color=color, label=label)
            bottom += per_s
    frames.set_ylabel("frames/s by fate")
    frames.legend(fontsize=8, loc="lower right")
    for key, label, style in (("age_p50_ms", "age p50", "-"), ("age_p99_ms", "age p99", "-"),
                              ("latency_p99_ms", "client latency p99", "--")):  # fmt: skip
        values = np.array([r[key] for r in rows], dtype=float)
        if np.isfinite(values).any():
            ages.plot(t + 0.5, values, style, marker=".", label=label)
    ages.set_ylim(bottom=0)
    ages.set_ylabel("answered frames (ms)")
    ages.legend(fontsize=8)
    ages.grid(True, which="both", alpha=0.3)
    by_stream = np.array([r["answered_by_stream"] for r in rows], dtype=float) / span[:, None]
    for k in range(by_stream.shape[1] if by_stream.ndim == 2 else 0):
        fps = report["per_stream"][k]["fps"]
        shares.plot(t + 0.5, by_stream[:, k], linewidth=1.6 if k == 0 else 0.8, label=f"stream {k} ({fps:g} fps)")
    shares.set_ylabel("answered/s per stream")
    shares.set_xlabel("time (s, measured window; each frame counted in the second it was due)")
    if report["streams"] <= 12:
        shares.legend(fontsize=7, ncol=3)
    shares.grid(True, alpha=0.3)
    return save(fig, frames, title, path)
