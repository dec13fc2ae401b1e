"""The load test's results: the table at the end, the JSON and CSV files, and the comparison with a baseline."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Container, Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from loadtest.answers import line as answers_line
from loadtest.answers import percent
from loadtest.step import PERCENTILES
from service.core.batchcost import KNEE_SLACK
from service.core.metrics import STAGES

CsvTable = tuple[Sequence[str], Iterable[dict[str, Any]]]  # a CSV file's columns and rows


def ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1f}"


def _errors(errors: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(errors.items())) or "0"


def new_table(
    title: str, columns: Iterable[str], left: Container[str], caption: str | None = None, rows: Iterable[list[str]] = ()
) -> Table:
    """A table of ``columns``, those in ``left`` justified left, the rest right, and its first ``rows``."""
    t = Table(title=title, caption=caption)
    for name in columns:
        t.add_column(name, justify="left" if name in left else "right")
    for row in rows:
        t.add_row(*row)
    return t


def table(steps: list[dict[str, Any]], title: str) -> Table:
    columns = ("step", "req/s", "img/s", *(f"p{q:g}" for q in PERCENTILES), "max", "errors", "server q/pre/comp",
               "batch", "client")  # fmt: skip
    caption = "latencies in ms; server q/pre/comp: mean queue, preprocess and per-batch compute ms from /metrics"
    t = new_table(title, columns, ("step", "errors", "client"), caption)
    for s in steps:
        lat, srv = s["latency_ms"], s["server"]
        split = "/".join(ms(srv["mean_ms"][k]) for k in ("queue", "preprocess", "compute")) if srv else "-"
        client = "LIMITED: " + "; ".join(s["client_limited"]) if s["client_limited"] else "ok"
        if s["send_lag_ms"] and not s["client_limited"]:
            client += f" (lag p99 {ms(s['send_lag_ms']['p99'])} ms)"
        t.add_row(
            s["step"], f"{s['requests_per_s']:.1f}", f"{s['images_per_s']:.1f}",
            *(ms(lat[f"p{q:g}"]) for q in PERCENTILES), ms(lat["max"]), _errors(s["errors"]), split,
            ms(srv["mean_batch_size"]) if srv else "-", client,
        )  # fmt: skip
    return t


def cost_table(steps: list[dict[str, Any]]) -> Table | None:
    """What each batch size cost per image at each step (the model's statistics), and the knee the adaptive policy
    stops a batch at on those costs: the batching trade-off for this model. None when no step has the figures."""
    rows = [(s["step"], (s["server"] or {}).get("batch_costs") or {}) for s in steps]
    if not any(c.get("sizes") for _, c in rows):
        return None
    caption = (
        f"knee: the smallest batch whose cost per image is within {KNEE_SLACK:.0%} of the cheapest size's "
        "(the adaptive policy's)"
    )
    sizes_column = "size: ms per image (batches)"
    title = "batch costs: compute ms per image by batch size (batches)"
    t = new_table(title, ("step", "knee", sizes_column), ("step", sizes_column), caption)
    for step, c in rows:
        sizes = ", ".join(f"{n}: {v['ms_per_image']:.1f} ({v['batches']})" for n, v in c.get("sizes", {}).items())
        t.add_row(step, str(c.get("knee") or "-"), sizes or "-")
    return t


def stage_table(steps: list[dict[str, Any]]) -> Table | None:
    """Where the server's time went at each step (mean ms per stage, from its stage histograms): which stage grows
    as the load does. None when the server reports no stages."""
    names = list(dict.fromkeys(name for s in steps for name in (s["server"] or {}).get("stages", {})))
    if not names:
        return None
    caption = "stages run one after another and sum to the server's time per request (docs: Server-Timing)"
    columns = ("step", *(name.replace("_", " ") for name in names))
    t = new_table("server stages: mean ms (p99 ms) per answered request", columns, ("step",), caption)
    for s in steps:
        stages = (s["server"] or {}).get("stages", {})
        t.add_row(s["step"], *(f"{ms(stages[n]['mean_ms'])} ({ms(stages[n]['p99_ms'])})" if n in stages else "-"
                               for n in names))  # fmt: skip
    return t


def model_table(s: dict[str, Any], title: str) -> Table:
    """One row per model of a ``--models`` step (or of the run's totals): its share of the requests, answers,
    errors, latency, and cold starts with their durations; the hit rate in the title."""
    cold = "not observed (gRPC sends no Server-Timing)" if s["cold_starts"] is None else (
        f"hit rate {percent(s['hit_rate'])}: {s['cold_starts']} cold starts in {s['answered']} answers")  # fmt: skip
    columns = ("model", "weight", "share", "requests", "errors", "p50", "p99", "cold starts", "cold p50", "cold max",
               "hit rate")  # fmt: skip
    caption = ("share: of the measured requests; latencies in ms; cold: answers with Server-Timing cold_start "
               "(cold p50/max: its dur); hit rate: 1 - cold starts / answers")  # fmt: skip
    t = new_table(f"{title}: {cold}", columns, ("model", "errors"), caption)
    for name, m in s["models"].items():
        cold_ms = m["cold_start_ms"] or {}
        t.add_row(
            name, percent(m["weight"]), percent(m["share"]), str(m["requests"]), _errors(m["errors"]),
            ms(m["latency_ms"]["p50"]), ms(m["latency_ms"]["p99"]),
            "-" if m["cold_starts"] is None else str(m["cold_starts"]), ms(cold_ms.get("p50")),
            ms(cold_ms.get("max")), percent(m["hit_rate"]),
        )  # fmt: skip
    return t


def print_report(report: dict[str, Any], console: Console) -> None:
    title = f"{report['model']} at {report['url']} ({report['mode']} loop, {report['protocol']} protocol)"
    if "models" in report:
        title = f"{len(report['models'])} models, {report['popularity']} (seed {report['seed']}) at {report['url']} " \
                f"({report['mode']} loop, {report['protocol']} protocol)"  # fmt: skip
    console.print(table(report["steps"], title))
    for s in report["steps"]:
        if s.get("answers"):
            console.print(f"{s['step']}: {answers_line(s['answers'])}")
    for extra in (stage_table(report["steps"]), cost_table(report["steps"])):
        if extra is not None:
            console.print(extra)
    if "models" in report:
        for s in report["steps"]:
            console.print(model_table(s, f"per model at {s['step']}"))
        if len(report["steps"]) > 1:
            console.print(model_table(report, "per model, all steps"))
        if report.get("sequence_file"):
            console.print(f"{report['sequence_requests']} requests' models written to {report['sequence_file']} "
                          f"(the first: the preflight's, to {report['preflight']})")  # fmt: skip
    slo = report.get("slo")
    if slo:
        if slo["best_rate"] is None:
            console.print(f"[bold]No rate tried met p99 <= {slo['target_p99_ms']:g} ms with no errors.[/bold]")
        else:
            console.print(f"[bold]Highest rate meeting p99 <= {slo['target_p99_ms']:g} ms: {slo['best_rate']:g} req/s"
                          f"[/bold] (p99 {ms(slo['passed']['latency_ms']['p99'])} ms)")  # fmt: skip
        if not slo["failed"]:
            console.print(
                f"  no rate tried failed within the {len(slo['tried'])} steps allowed: the edge lies higher "
                "(raise --slo-max-steps or start higher with --rate)"
            )
        else:
            f = slo["failed"]
            console.print(f"  bounded above by {f['rate']:g} req/s: p99 {ms(f['latency_ms']['p99'])} ms, "
                          f"errors {sum(f['errors'].values())}"
                          + (" (client-limited: the generator may have set this bound)" if slo["client_limited"]
                             else ""))  # fmt: skip


CSV_COLUMNS = ("step", "mode", "concurrency", "rate", "arrival", "duration_s", "requests", "images", "errors",
               "requests_per_s", "images_per_s", *(f"p{q:g}_ms" for q in PERCENTILES), "max_ms", "mean_ms",
               "send_lag_p99_ms", "client_cpu", "client_limited", "server_queue_ms", "server_preprocess_ms",
               "server_compute_ms", "server_request_p99_ms", "mean_batch_size", "batch_knee",
               *(f"stage_{name}_ms" for name in STAGES))  # fmt: skip


def csv_row(s: dict[str, Any]) -> dict[str, Any]:
    lat, srv = s["latency_ms"], s["server"] or {}
    row = {k: s[k] for k in ("step", "mode", "concurrency", "rate", "arrival", "duration_s", "requests", "images",
                             "requests_per_s", "images_per_s", "client_cpu")}  # fmt: skip
    row |= {f"p{q:g}_ms": lat[f"p{q:g}"] for q in PERCENTILES} | {"max_ms": lat["max"], "mean_ms": lat["mean"]}
    row["errors"] = sum(s["errors"].values())
    row["send_lag_p99_ms"] = s["send_lag_ms"]["p99"] if s["send_lag_ms"] else ""
    row["client_limited"] = "; ".join(s["client_limited"])
    means = srv.get("mean_ms", {})
    row |= {f"server_{k}_ms": means.get(k, "") for k in ("queue", "preprocess", "compute")}
    row["server_request_p99_ms"] = srv.get("request_p99_ms", "")
    row["mean_batch_size"] = srv.get("mean_batch_size", "")
    row["batch_knee"] = (srv.get("batch_costs") or {}).get("knee") or ""
    stages = srv.get("stages", {})
    row |= {f"stage_{name}_ms": stages[name]["mean_ms"] if name in stages else "" for name in STAGES}
    return row


MODEL_CSV_COLUMNS = ("step", "model", "weight", "share", "measured", "requests", "answered", "errors", "p50_ms",
                     "p99_ms", "cold_starts", "cold_start_p50_ms", "cold_start_max_ms", "hit_rate")  # fmt: skip


def model_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    """models.csv's rows of one ``--models`` step."""
    return [{
        "step": s["step"], "model": name, "weight": m["weight"], "share": m["share"], "measured": m["measured"],
        "requests": m["requests"], "answered": m["answered"], "errors": sum(m["errors"].values()),
        "p50_ms": m["latency_ms"]["p50"], "p99_ms": m["latency_ms"]["p99"],
        "cold_starts": "" if m["cold_starts"] is None else m["cold_starts"],
        "cold_start_p50_ms": (m["cold_start_ms"] or {}).get("p50", ""),
        "cold_start_max_ms": (m["cold_start_ms"] or {}).get("max", ""),
        "hit_rate": "" if m["hit_rate"] is None else m["hit_rate"],
    } for name, m in s["models"].items()]  # fmt: skip


def write_results(report: dict[str, Any], out: Path, tables: dict[str, CsvTable]) -> list[Path]:
    """results.json and, per file name in ``tables``, a CSV of those columns and rows, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    for name, (columns, rows) in tables.items():
        with (out / name).open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns)
            w.writeheader()
            w.writerows(rows)
    return [out / "results.json", *(out / name for name in tables)]


def write_files(report: dict[str, Any], out: Path) -> list[Path]:
    """results.json and steps.csv into ``out``; with ``--models``, models.csv too (a row per step and model)."""
    tables: dict[str, CsvTable] = {"steps.csv": (CSV_COLUMNS, [csv_row(s) for s in report["steps"]])}
    if "models" in report:
        tables["models.csv"] = (MODEL_CSV_COLUMNS, [row for s in report["steps"] for row in model_rows(s)])
    return write_results(report, out, tables)


def compare(report: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> tuple[list[dict[str, Any]], bool]:
    """Each step matched by its key: throughput and p99 changes; a regression is a throughput fall or a p99 rise
    beyond ``tolerance`` (a fraction), or a step that had no errors and now has some."""
    base = {s["key"]: s for s in baseline.get("steps", [])}
    rows = []
    for s in report["steps"]:
        b = base.get(s["key"])
        if b is None:
            continue
        tput = s["requests_per_s"] / b["requests_per_s"] if b["requests_per_s"] else math.nan
        p99 = s["latency_ms"]["p99"] / b["latency_ms"]["p99"] if b["latency_ms"]["p99"] else math.nan
        new_errors = sum(s["errors"].values()) > 0 and sum(b["errors"].values()) == 0
        bad = tput < 1 - tolerance or p99 > 1 + tolerance or new_errors or math.isnan(tput) or math.isnan(p99)
        rows.append({"step": s["step"], "throughput_ratio": tput, "p99_ratio": p99, "new_errors": new_errors,
                     "regression": bad})  # fmt: skip
    slo, base_slo = report.get("slo"), baseline.get("slo")
    if slo and base_slo and base_slo.get("best_rate"):
        ratio = (slo["best_rate"] or 0.0) / base_slo["best_rate"]
        rows.append({"step": f"rate at p99 <= {slo['target_p99_ms']:g} ms", "throughput_ratio": ratio,
                     "p99_ratio": math.nan, "new_errors": False, "regression": ratio < 1 - tolerance})  # fmt: skip
    return rows, any(r["regression"] for r in rows)


def _change(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{100 * (ratio - 1):+.1f}%"


def print_comparison(rows: list[dict[str, Any]], tolerance: float, console: Console) -> None:
    caption = None if rows else "no step of this run matches a step of the baseline"
    title = f"against the baseline (tolerance {100 * tolerance:g}%)"
    t = new_table(title, ("step", "throughput", "p99", "verdict"), ("step", "verdict"), caption)
    for r in rows:
        verdict = "REGRESSION" + (" (new errors)" if r["new_errors"] else "") if r["regression"] else "ok"
        t.add_row(r["step"], _change(r["throughput_ratio"]), _change(r["p99_ratio"]), verdict)
    console.print(t)
