"""A streams run's figures (:mod:`loadtest.streams`): per stream and over all, per second, and the accounting of
every frame; the table at the end, results.json and streams.csv. The figures cover the frames *scheduled* inside the
measured window, each in the second it was due in; the accounting covers every frame, warm-up included
(``answered + superseded + expired + errors + lost = sent``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtest.report import ms, new_table, write_results
from loadtest.step import client_limits
from loadtest.streams import STAGES, STATUSES, FrameRecord, StreamRun
from service.core.percentile import percentile


def _q(values: Sequence[float], q: float) -> float:
    return percentile([v for v in values if not math.isnan(v)], q)


def _mean(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def tally(frames: Sequence[FrameRecord], seconds: float) -> dict[str, Any]:
    """The fates and timings of ``frames`` over ``seconds``: rates, fractions, age (the server's) and latency (the
    client's, from each frame's scheduled send) of the answered ones, drops by reason, send lag."""
    answered = [f for f in frames if f.status == "result"]
    fates = Counter(f.status for f in frames)
    expired = {stage: sum(f.status == "expired" and f.stage == stage for f in frames) for stage in STAGES}
    expired["other"] = fates["expired"] - sum(expired.values())
    ages = [f.age_ms for f in answered]
    latencies = [f.latency_ms for f in answered]
    sent = len(frames)
    return {
        "sent": sent, "answered": len(answered), "superseded": fates["superseded"], "expired": fates["expired"],
        "expired_by_stage": expired, "errors": fates["error"], "lost": fates["lost"],
        "sent_per_s": sent / seconds if seconds else math.nan,
        "answered_per_s": len(answered) / seconds if seconds else math.nan,
        "answered_fraction": len(answered) / sent if sent else math.nan,
        "age_ms": {"p50": _q(ages, 0.5), "p99": _q(ages, 0.99), "max": max(ages, default=math.nan)},
        "latency_ms": {"p50": _q(latencies, 0.5), "p99": _q(latencies, 0.99), "max": max(latencies, default=math.nan)},
        "compute_ms": {"mean": _mean([f.compute_ms for f in answered]), "p50": _q([f.compute_ms for f in answered],
                                                                                   0.5)},
        "send_lag_ms": {"p99": _q([f.send_lag_ms for f in frames], 0.99),
                        "max": max((f.send_lag_ms for f in frames), default=math.nan)},
    }  # fmt: skip


def in_window(frames: Sequence[FrameRecord], start_s: float, end_s: float) -> list[FrameRecord]:
    """The frames due in ``[start_s, end_s)`` (seconds from the run's start)."""
    return [f for f in frames if start_s <= f.due_s < end_s]


def all_frames(run: StreamRun) -> list[FrameRecord]:
    return [f for s in run.streams for f in s.frames]


def timeline(run: StreamRun) -> list[dict[str, Any]]:
    """Per second of the measured window, by due time: frames by fate, answered age p50/p99, client latency p99,
    and each stream's answered count."""
    plan = run.plan
    seconds: list[list[FrameRecord]] = [[] for _ in range(math.ceil(plan.duration_s))]
    for f in in_window(all_frames(run), plan.warmup_s, plan.end_s):
        seconds[min(len(seconds) - 1, int(f.due_s - plan.warmup_s))].append(f)
    rows: list[dict[str, Any]] = []
    for k, frames in enumerate(seconds):
        answered = [f for f in frames if f.status == "result"]
        by_stream = Counter(f.stream for f in answered)
        row: dict[str, Any] = {"t_s": k, "span_s": min(1.0, plan.duration_s - k)}
        row |= {status: sum(f.status == status for f in frames) for status in STATUSES}
        row |= {"age_p50_ms": _q([f.age_ms for f in answered], 0.5), "age_p99_ms": _q([f.age_ms for f in answered],
                0.99), "latency_p99_ms": _q([f.latency_ms for f in answered], 0.99),
                "answered_by_stream": [by_stream[s] for s in range(len(run.streams))]}  # fmt: skip
        rows.append(row)
    return rows


def accounting(run: StreamRun) -> dict[str, Any]:
    """Every frame of the run, warm-up included: each got exactly one answer, or says why not."""
    frames = all_frames(run)
    counts = Counter(f.status for f in frames)
    sent = len(frames)
    unexpected = sum(s.unexpected for s in run.streams)
    late = sum(s.late for s in run.streams)
    unsent = sum(s.scheduled - len(s.frames) for s in run.streams)
    failures = [f"stream {s.index}: {s.failure}" for s in run.streams if s.failure]
    return {
        "sent": sent, "answered": counts["result"], "superseded": counts["superseded"], "expired": counts["expired"],
        "errors": counts["error"], "lost": counts["lost"], "late": late, "unexpected": unexpected, "unsent": unsent,
        "adds_up": counts["result"] + counts["superseded"] + counts["expired"] + counts["error"] == sent,
        "failures": failures,
        "ok": counts["lost"] == 0 and unexpected == 0 and unsent == 0 and not failures,
    }  # fmt: skip


def summarise(run: StreamRun, server: dict[str, Any] | None = None, max_send_lag_ms: float = 10.0) -> dict[str, Any]:
    """The streams run's report (results.json); ``max_send_lag_ms``: a send lag p99 above it flags the run as
    client-limited."""
    plan = run.plan
    window = (plan.warmup_s, plan.end_s)
    per_stream = []
    for s in run.streams:
        row = {"stream": s.index, "fps": s.fps} | tally(in_window(s.frames, *window), plan.duration_s)
        row |= {"unexpected": s.unexpected, "late": s.late, "close_code": s.close_code, "failure": s.failure}
        per_stream.append(row)
    total = tally(in_window(all_frames(run), *window), plan.duration_s)
    limited = client_limits(total["send_lag_ms"]["p99"], max_send_lag_ms, run.client_cpu, "the load process")
    return {
        "url": plan.url, "model": plan.model, "mode": "streams", "protocol": "websocket", "streams": plan.streams,
        "fps": plan.fps, "fps_first": plan.fps_first, "total_fps": plan.total_fps, "max_age_ms": plan.max_age_ms,
        "warmup_s": plan.warmup_s, "duration_s": plan.duration_s, "drain_s": plan.drain_s,
        "client_cpu": run.client_cpu, "per_stream": per_stream, "client_limited": limited, "total": total,
        "accounting": accounting(run), "timeline": timeline(run), "server": server,
    }  # fmt: skip


def _row(name: str, fps: float, t: dict[str, Any]) -> list[str]:
    by = t["expired_by_stage"]
    expired = f"{t['expired']} ({by['wait']}/{by['decode']}/{by['queue']})" if t["expired"] else "0"
    fraction = t["answered_fraction"]
    return [name, f"{fps:g}", str(t["sent"]), f"{t['answered_per_s']:.1f}",
            "-" if math.isnan(fraction) else f"{100 * fraction:.1f}%", ms(t["age_ms"]["p50"]), ms(t["age_ms"]["p99"]),
            ms(t["latency_ms"]["p50"]), ms(t["latency_ms"]["p99"]), str(t["superseded"]), expired, str(t["errors"]),
            str(t["lost"])]  # fmt: skip


def print_report(report: dict[str, Any], console: Console) -> None:
    title = (f"{report['model']} at {report['url']}: {report['streams']} streams, {report['total_fps']:g} frames/s, "
             f"max age {report['max_age_ms']:g} ms, {report['duration_s']:g} s")  # fmt: skip
    columns = ("stream", "fps", "sent", "answered/s", "answered", "age p50", "age p99", "latency p50", "latency p99",
               "superseded", "expired (w/d/q)", "errors", "lost")  # fmt: skip
    caption = ("age: the server's, from reading the frame to answering it; latency: the client's, from the frame's "
               "scheduled send; ms. expired by stage: wait/decode/queue")  # fmt: skip
    rows = [_row(str(s["stream"]), s["fps"], s) for s in report["per_stream"]]
    t = new_table(title, columns, ("stream",), caption, rows)
    t.add_row(*_row("all", report["total_fps"], report["total"]), style="bold")
    console.print(t)
    a = report["accounting"]
    verdict = "every frame got exactly one answer" if a["ok"] else "NOT every frame got exactly one answer"
    console.print(f"[bold]{verdict}[/bold]: {a['sent']} sent (warm-up included) = {a['answered']} answered + "
                  f"{a['superseded']} superseded + {a['expired']} expired + {a['errors']} errors + {a['lost']} lost; "
                  f"{a['unexpected']} unexpected, {a['late']} late, {a['unsent']} not sent")  # fmt: skip
    for failure in a["failures"]:
        console.print(f"  {failure}")
    lag = report["total"]["send_lag_ms"]["p99"]
    limited = "; ".join(report["client_limited"])
    console.print(f"client: {100 * report['client_cpu']:.0f}% of a core, send lag p99 {ms(lag)} ms"
                  + (f": LIMITED ({limited})" if limited else ""))  # fmt: skip


CSV_COLUMNS = ("stream", "fps", "sent", "answered", "superseded", "expired", *(f"expired_{s}" for s in STAGES),
               "errors", "lost", "answered_per_s", "answered_fraction", "age_p50_ms", "age_p99_ms", "latency_p50_ms",
               "latency_p99_ms", "compute_mean_ms", "send_lag_p99_ms")  # fmt: skip


def _csv_row(name: str | int, fps: float, t: dict[str, Any]) -> dict[str, Any]:
    counts = ("sent", "answered", "superseded", "expired", "errors", "lost", "answered_per_s", "answered_fraction")
    row = {"stream": name, "fps": fps} | {k: t[k] for k in counts}
    row |= {f"expired_{s}": t["expired_by_stage"][s] for s in STAGES}
    row |= {"age_p50_ms": t["age_ms"]["p50"], "age_p99_ms": t["age_ms"]["p99"], "latency_p50_ms":
            t["latency_ms"]["p50"], "latency_p99_ms": t["latency_ms"]["p99"], "compute_mean_ms":
            t["compute_ms"]["mean"], "send_lag_p99_ms": t["send_lag_ms"]["p99"]}  # fmt: skip
    return row


def write_files(report: dict[str, Any], out: Path) -> list[Path]:
    """results.json and streams.csv (a row per stream, then ``all``) into ``out``."""
    rows = [_csv_row(s["stream"], s["fps"], s) for s in report["per_stream"]]
    rows.append(_csv_row("all", report["total_fps"], report["total"]))
    return write_results(report, out, {"streams.csv": (CSV_COLUMNS, rows)})
