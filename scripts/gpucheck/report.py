"""The GPU check's report for people: one section per step, every number, and what was skipped or failed and why."""

from __future__ import annotations

import json
from typing import Any

SECTIONS = ("environment", "install", "gpu_tests", "export", "bench", "decode", "serve_loadtest", "train")


def title(report: dict[str, Any]) -> list[str]:
    """The report's first lines: what ran, when, and for how long."""
    return [f"# visionserve {report['kind']}", "", f"Started {report['started_at']}, "
            f"{report['seconds_total']:.0f} s in all.", ""]  # fmt: skip


def section_head(report: dict[str, Any], name: str) -> list[str]:
    """A step's heading: its time, its error or why it was skipped."""
    lines = [f"## {name}", ""]
    if name in report.get("seconds", {}):
        lines += [f"{report['seconds'][name]:.0f} s", ""]
    if name in report["errors"]:
        lines += [f"ERROR: {report['errors'][name]}", ""]
    if name in report["skipped"]:
        lines += [f"skipped: {report['skipped'][name]}", ""]
    return lines


def markdown(report: dict[str, Any]) -> str:
    """The report for people: one section per step, every number, and what was skipped and why."""
    lines = title(report)
    sections = report["sections"]
    for name in SECTIONS:
        lines += section_head(report, name)
        body = sections.get(name)
        if name == "bench" and body and "batch_sizes" in body:
            sizes = [str(b) for b in body["batch_sizes"]]
            lines += ["| runtime | precision | CUDA graphs | " + " | ".join(f"batch {s}" for s in sizes) + " |",
                      "|---|---|---|" + "---:|" * len(sizes)]  # fmt: skip
            for run in body["runs"]:
                rates = run.get("engine_images_per_s", {})
                cells = [f"{rates[s]:.1f}" if s in rates else run.get("error", "-")[:40] for s in sizes]
                graphs = "on" if run["cuda_graphs"] else "off"
                lines.append(f"| {run['backend']} | {run['precision']} | {graphs} | " + " | ".join(cells) + " |")
            lines += ["", "engine images/s (the runtime alone on ready uint8 batches)", ""]
            for s in body["skipped"]:
                lines.append(f"- skipped {s['backend']} {s['precision']} graphs {s['cuda_graphs']}: {s['reason']}")
            lines.append("")
        elif body is not None:
            lines += ["```json", json.dumps(body, indent=2), "```", ""]
    other = {k: v for k, v in report["skipped"].items() if k not in SECTIONS}
    if other or report["errors"]:
        lines += ["## skipped and errors", ""]
        lines += [f"- skipped {k}: {v}" for k, v in other.items()]
        lines += [f"- error {k}: {v}" for k, v in report["errors"].items() if k not in SECTIONS]
        lines.append("")
    lines += [f"GPU tests failed: {report['gpu_tests_failed']}", ""]
    return "\n".join(lines)
