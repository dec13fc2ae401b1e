"""Reading what the GPU check's commands print: pytest's JUnit file, train's last line, a loadtest step."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any


def junit_counts(junit: Path) -> dict[str, int]:
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
    if junit.is_file():
        suite = re.search(r"<testsuite [^>]*>", junit.read_text())
        attrs = dict(re.findall(r'(\w+)="([^"]*)"', suite.group(0))) if suite else {}
        total = int(attrs.get("tests", 0))
        counts.update({k: int(attrs.get(a, 0)) for k, a in (("failed", "failures"), ("errors", "errors"),
                                                            ("skipped", "skipped"))})  # fmt: skip
        counts["passed"] = total - counts["failed"] - counts["errors"] - counts["skipped"]
    return counts


def bench_matrix() -> list[tuple[str, str, bool]]:
    return [
        (b, p, g)
        for b in ("torchscript", "aoti", "onnxruntime")
        for p in ("fp32", "fp16", "bf16")
        for g in (True, False)
    ]


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-2] if len(lines) >= 2 and lines[-1].startswith("checkpoint written") else (lines[-1] if lines else "")


def step_summary(step: dict[str, Any]) -> dict[str, Any]:
    """One loadtest step without its histogram: clients or rate, throughput, errors, latency percentiles."""
    keep = ("step", "concurrency", "rate", "requests", "errors", "requests_per_s", "images_per_s", "latency_ms",
            "client_limited", "client_cpu")  # fmt: skip
    return {k: step[k] for k in keep if k in step}
