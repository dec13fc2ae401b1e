"""The GPU speed report for people: the targets of issue 47 judged, then one section per step with every number."""

from __future__ import annotations

import json
from typing import Any

from gpucheck.report import section_head, title

SECTIONS = ("environment", "install", "export", "bench", "litserve", "serve", "detector")


def verdicts(sections: dict[str, Any], slo_p99_ms: float) -> dict[str, Any]:
    """Each target against what was measured (None where its figures are missing)."""
    serve, lit = sections.get("serve") or {}, (sections.get("litserve") or {}).get("best") or {}
    best, ratio = serve.get("best_images_per_s"), serve.get("to_pipeline_cpu_decode")
    p99 = (serve.get("open_at_70") or {}).get("latency_ms", {}).get("p99")
    out: dict[str, Any] = {
        "served_images_per_s >= 5000": None if best is None else best >= 5000,
        "served / pipeline (CPU decode) >= 0.9": None if ratio is None else ratio >= 0.9,
        f"p99 at 70% <= {slo_p99_ms:g} ms": None if p99 is None else p99 <= slo_p99_ms,
    }
    if best is not None and lit.get("best_images_per_s"):
        out["served >= 3x LitServe's best"] = best >= 3 * lit["best_images_per_s"]
        ours = (serve.get("at_litserve_70") or {}).get("latency_ms", {}).get("p99")
        theirs = (lit.get("open_at_70") or {}).get("latency_ms", {}).get("p99")
        out["p99 below LitServe's at its 70% load"] = None if ours is None or theirs is None else ours < theirs
    return out


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The headline figures and the targets, a line each, for the end of the run."""
    sections, lines = report["sections"], []
    bench = sections.get("bench") or {}
    if bench.get("engine_images_per_s"):
        rates = ", ".join(f"{b}: {r:.0f}" for b, r in bench["engine_images_per_s"].items())
        lines.append(f"runtime alone, images/s by batch: {rates}")
    for key, label in (("pipeline_images_per_s", "CPU decoders"), ("pipeline_gpu_decode_images_per_s", "nvJPEG")):
        if key in bench:
            lines.append(f"pipeline from JPEG bytes with {label}: {bench[key]:.0f} images/s")
    for name, body in (("LitServe", (sections.get("litserve") or {}).get("best")), ("served", sections.get("serve"))):
        if body and body.get("open_at_70"):
            p99 = body["open_at_70"]["latency_ms"]["p99"]
            workers = f" ({body['workers']} workers)" if "workers" in body else ""
            lines.append(f"{name}{workers}: best {body['best_images_per_s']:.0f} images/s at "
                         f"c={body['best_concurrency']}, p99 {p99:.1f} ms at 70% of it")  # fmt: skip
    lines += [f"target {k}: {'not measured' if v is None else ('met' if v else 'MISSED')}"
              for k, v in (report.get("verdicts") or {}).items()]  # fmt: skip
    return lines


def _row(label: str, step: dict[str, Any]) -> str:
    lat = step.get("latency_ms") or {}
    batch = (step.get("server") or {}).get("mean_batch_size")
    cells = [label, f"{step.get('images_per_s', 0):.1f}", f"{lat.get('p50', float('nan')):.2f}",
             f"{lat.get('p99', float('nan')):.2f}", str(step.get("server_cores_busy", "-")),
             str(step.get("server_cpu_ms_per_image", "-")), "-" if batch is None else f"{batch:.2f}",
             str(sum((step.get("errors") or {}).values()))]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


HEAD = ["| load | images/s | p50 ms | p99 ms | server cores busy | server CPU ms/image | mean batch | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip


def _sweep(body: dict[str, Any]) -> list[str]:
    lines = list(HEAD)
    lines += [_row(f"c={s.get('concurrency')}", s) for s in body.get("closed", [])]
    for key, label in (("open_at_70", "open, 70% of best"), ("at_litserve_70", "open, LitServe's 70%")):
        if body.get(key):
            lines.append(_row(f"{label} ({body[key].get('rate', 0):.0f}/s)", body[key]))
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    """Verdicts first, then one section per step: its time, its error or why it was skipped, its numbers."""
    lines = [*title(report), "## targets", ""]
    for name, ok in (report.get("verdicts") or {}).items():
        lines.append(f"- {name}: {'not measured' if ok is None else ('met' if ok else 'MISSED')}")
    lines.append("")
    for name in SECTIONS:
        lines += section_head(report, name)
        body = report["sections"].get(name)
        if body is None:
            continue
        if name == "serve":
            lines += _sweep(body)
        elif name == "litserve":
            for run in body.get("runs", []):
                lines += [f"{run['workers']} workers: {run.get('error') or run.get('skipped') or ''}", ""]
                lines += _sweep(run) if "closed" in run else []
        lines += ["```json", json.dumps(body, indent=2, default=str), "```", ""]
    other = {k: v for k, v in report["errors"].items() if k not in SECTIONS}
    if other:
        lines += ["## other errors", "", *[f"- {k}: {v}" for k, v in other.items()], ""]
    return "\n".join(lines)
