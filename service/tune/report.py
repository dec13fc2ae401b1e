"""``tune``'s report: one JSON document, the same as Markdown and as a console table, and a plot of the verified
candidates (p99 against the offered rate, with the target line). The plot carries the winner and its numbers in
its PNG metadata (``Description``), so the three files can be checked against one another."""

from __future__ import annotations

import datetime
import json
import math
import platform
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from service.core.batchcost import KNEE_SLACK, CostModel
from service.core.cpu import cpu_name
from service.tune import model as prediction_model
from service.tune.tuner import TuneRun
from service.tune.verify import Verified


def _clean(value: Any) -> Any:
    """JSON has no NaN or infinity: they become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def _ratio(a: Verified | None, b: Verified | None) -> float | None:
    return a.best_rate / b.best_rate if a and b and a.best_rate and b.best_rate else None


def build(run: TuneRun, written: dict[str, Any] | None = None) -> dict[str, Any]:
    """The whole run as one JSON-ready dict."""
    o = run.options
    winner = run.winner
    current, default = run.find(run.current), run.find(run.default)
    best_seen = None if winner else run.best_seen()
    if winner:
        message = (
            f"{winner.candidate.label}: {winner.best_rate:g} req/s at p99 {winner.best_p99_ms:.1f} ms "
            f"(target {o.slo_p99_ms:g} ms); serve it with --workers {winner.candidate.workers}"
        )
    elif best_seen:
        message = (
            f"no configuration met p99 <= {o.slo_p99_ms:g} ms at any rate tried: the best p99 seen was "
            f"{best_seen['p99_ms']:.1f} ms, at {best_seen['rate']:g} req/s ({best_seen['label']})"
        )
    else:
        message = "nothing was verified: no measured answer"
    if run.interrupted:
        message = "interrupted; so far: " + message
    report: dict[str, Any] = {
        "model": o.model, "repository": o.repository, "slo_p99_ms": o.slo_p99_ms, "budget_s": o.budget_s,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": run.measured.cores if run.measured else None,
                    "python": platform.python_version()},
        "device": run.measured.device if run.measured else None,
        "outcome": "met" if winner else "unmet", "interrupted": run.interrupted, "message": message,
        "winner": winner.to_dict() if winner else None,
        "serve_workers": winner.candidate.workers if winner else None,
        "current": current.to_dict() if current else None, "default": default.to_dict() if default else None,
        "ratio_to_default": _ratio(winner, default), "ratio_to_current": _ratio(winner, current),
        "best_seen": best_seen,
        "verified": [v.to_dict() for v in run.verified],
        "prediction_errors": {v.candidate.label: v.prediction_error for v in run.verified},
        "skipped": run.skipped,
        "predicted": [{"label": r.candidate.label, "candidate": r.candidate.to_dict(), **r.prediction.to_dict()}
                      for r in run.ranked[:25]],
        "predicted_count": len(run.ranked),
        "measurements": run.measured.to_dict() if run.measured else None,
        "prediction_model": {"frontend_ms": prediction_model.FRONTEND_MS, "client_ms": prediction_model.CLIENT_MS,
                             "transport_ms": prediction_model.TRANSPORT_MS,
                             "engine_share": prediction_model.ENGINE_SHARE, "calibration": run.calibration},
        "step_plan": vars(run.plan) if run.plan else None,
        "phases_s": run.phases_s, "wall_s": run.elapsed(),
        "config": written,
    }  # fmt: skip
    return _clean(report)


def _f(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}{suffix}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.0f}%"


def _knee(images_per_s: dict[str, float]) -> str:
    seconds = {int(b): int(b) / v for b, v in images_per_s.items() if v > 0}
    knee = CostModel(seconds).knee(max(seconds)) if seconds else None
    return str(knee) if knee is not None else "-"


def _step(step: dict[str, Any]) -> str:
    """A verified step: its rate and p99, whether it missed, and ", mean batch B (knee K)" as far as reported."""
    text = f"{step['rate']:g}/s p99 {_f(step['p99_ms'])} ms{'' if step['met'] else ' (missed)'}"
    mean, knee = step.get("mean_batch"), step.get("knee")
    if mean is None or mean != mean:
        return text
    return text + f", mean batch {mean:.1f}" + (f" (knee {knee})" if knee else "")


def verified_rows(report: dict[str, Any]) -> list[list[str]]:
    """One row per verified candidate: label, role, predicted, measured, p99 there, error, wall time."""
    winner, current, default = ((report[k] or {}).get("label") for k in ("winner", "current", "default"))
    roles = {current: "current", default: "default"} if current != default else {current: "current = default"}
    rows = []
    for v in report["verified"]:
        said = ["winner" if v["label"] == winner else "", roles.get(v["label"], "")]
        role = ", ".join(r for r in [*said, "calibrates the rest" if v.get("calibrates") else ""] if r)
        measured = _f(v["measured_rate"]) if v["measured_rate"] else ("failed: " + v["error"] if v["error"] else "none")
        rows.append([v["label"], role, _f(v["predicted_rate"]), measured, _f(v["measured_p99_ms"]),
                     _pct(v["prediction_error"]), _f(v["wall_s"], 0, " s")])  # fmt: skip
    return rows


def _table(header: list[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """A Markdown table's lines."""
    line = "| {} |".format
    return [line(" | ".join(header)), "|" + "---|" * len(header), *(line(" | ".join(row)) for row in rows)]


def _runtime_row(r: dict[str, Any]) -> list[str]:
    sizes = ", ".join(f"{b}: {v:.0f}" for b, v in r["images_per_s"].items())
    return [f"{r['backend']}/{r['precision']}", str(r["threads"] or "default"), sizes, _knee(r["images_per_s"])]


HEADER = ["candidate", "role", "predicted req/s", "measured req/s", "p99 there (ms)", "prediction error", "time"]


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# visionserve tune: {report['model']}, p99 <= {report['slo_p99_ms']:g} ms", "",
             f"**{report['message']}**", "",
             f"{report['date']}; {report['machine']['cpu']}, {report['machine']['cores']} cores, device "
             f"{report['device']}; budget {report['budget_s']:g} s, used {report['wall_s']:.0f} s "
             f"(" + ", ".join(f"{k} {v:.0f} s" for k, v in report["phases_s"].items()) + ")."]  # fmt: skip
    if report["winner"]:
        lines += ["", f"Against export's default: {_f(report['ratio_to_default'], 2, 'x')}; against the current "
                      f"config: {_f(report['ratio_to_current'], 2, 'x')}."]  # fmt: skip
    lines += ["", "## Verified on a real server (open-loop p99 search)", "", *_table(HEADER, verified_rows(report))]
    cal = report["prediction_model"]["calibration"]
    if cal:
        lines += ["", f"The first candidate's measurement calibrated the prediction of the rest: "
                      f"{cal['frontend_ms']:.2f} ms of server CPU per request (assumed {cal['frontend_ms_before']:g}"
                      " before); its own error is the uncalibrated model's, the others' are out of sample"]  # fmt: skip
    for v in report["verified"]:
        lines += ["", f"Steps of `{v['label']}`: " + "; ".join(map(_step, v["steps"]))]
    if report["skipped"]:
        lines += ["", "Not verified: " + "; ".join(report["skipped"])]
    figures = ("rate", "p50_ms", "p99_ms", "mean_batch")
    predicted = [[p["label"], *(_f(p[k]) for k in figures)] for p in report["predicted"]]
    lines += ["", f"## Predicted (best {len(report['predicted'])} of {report['predicted_count']})", ""]
    lines += _table(["candidate", "predicted req/s", "p50 there (ms)", "p99 there (ms)", "mean batch"], predicted)
    m = report["measurements"]
    if m:
        decode = f"Decode + preprocess: {m['decode_ms']:.2f} ms per image ({m['images']}), one core."
        lines += ["", "## Measured in-process", "", decode, ""]
        lines += _table(["runtime", "threads", "images/s per batch size", "knee"], map(_runtime_row, m["runtimes"]))
        lines += ["", f"knee: the batch the adaptive policy stops at from a backlog, the smallest whose cost per image "
                      f"is within {KNEE_SLACK:.0%} of the cheapest size's (the same computation on the same figures "
                      "as the server's, and as `loadtest`'s batch costs)"]  # fmt: skip
    if report["config"]:
        c = report["config"]
        lines += ["", f"Wrote {c['path']}" + (f" (previous file kept as {c['backup']})" if c.get("backup") else "")]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    from loadtest.plots import pyplot, save

    fig, ax = pyplot().subplots(figsize=(9, 5.5))
    winner = (report["winner"] or {}).get("label")
    for v in report["verified"]:
        steps = sorted((s for s in v["steps"] if s["p99_ms"] is not None), key=lambda s: s["rate"])
        if not steps:
            continue
        best = v["label"] == winner
        ax.plot([s["rate"] for s in steps], [s["p99_ms"] for s in steps], marker="o", lw=2.5 if best else 1,
                label=("winner: " if best else "") + v["label"] + (f" ({v['measured_rate']:g}/s)"
                                                                    if v["measured_rate"] else ""))  # fmt: skip
    ax.axhline(report["slo_p99_ms"], color="red", ls="--", label=f"target p99 {report['slo_p99_ms']:g} ms")
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (requests/s, Poisson)")
    ax.set_ylabel("p99 latency (ms)")
    ax.legend(fontsize=7)
    description = json.dumps({"winner": winner, "measured_rate": (report["winner"] or {}).get("measured_rate"),
                              "outcome": report["outcome"]})  # fmt: skip
    title = f"{report['model']}: measured candidates, p99 against rate"
    save(fig, ax, title, path, metadata={"Description": description})


def write(report: dict[str, Any], folder: Path) -> list[Path]:
    """tune.json, tune.md and tune.png in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / "tune.json", folder / "tune.md", folder / "tune.png"]
    paths[0].write_text(json.dumps(report, indent=1) + "\n")
    paths[1].write_text(markdown(report))
    plot(report, paths[2])
    return paths
