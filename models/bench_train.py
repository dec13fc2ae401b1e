"""Benchmark of the embedded default: ``visionserve train`` with its defaults (smallcnn on digits).

Runs the real command as a whole process several times (different seeds) and prints, per run and as medians,
the validation accuracy and the wall time (process start to exit, and the training loop alone), then one JSON
line. Targets: accuracy >= 97%, wall time <= 60 s on a 2-core CPU.

    python -m models.bench_train --runs 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3, help="runs, with seeds 0..runs-1 (default: 3)")
    p.add_argument("--min-accuracy", type=float, default=0.97, help="target accuracy (default: 0.97)")
    p.add_argument("--max-seconds", type=float, default=60.0, help="target wall time (default: 60)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from models.checkpoint import load_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.runs):
            out = Path(tmp) / f"digits-{seed}.pt"
            cmd = [
                sys.executable,
                "-m",
                "service.cli",
                "train",
                "--no-progress",
                "--seed",
                str(seed),
                "--out",
                str(out),
            ]
            started = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - started
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                return 1
            record = load_checkpoint(out).record
            assert record is not None and record.val_accuracy is not None
            rows.append(
                {"seed": seed, "val_accuracy": record.val_accuracy, "wall_s": wall, "train_s": record.duration_s}
            )
            print(
                f"seed {seed}: val accuracy {record.val_accuracy:.2%}  wall {wall:.1f} s  "
                f"(training loop {record.duration_s:.1f} s)",
                flush=True,
            )
    summary = {
        "benchmark": "train-default",
        "command": "visionserve train (defaults: smallcnn, digits, 15 epochs)",
        "runs": len(rows),
        "val_accuracy_median": statistics.median(r["val_accuracy"] for r in rows),
        "val_accuracy_min": min(r["val_accuracy"] for r in rows),
        "wall_s_median": statistics.median(r["wall_s"] for r in rows),
        "wall_s_max": max(r["wall_s"] for r in rows),
        "train_loop_s_median": statistics.median(r["train_s"] for r in rows),
    }
    ok = summary["val_accuracy_min"] >= args.min_accuracy and summary["wall_s_max"] <= args.max_seconds
    print(
        f"median: val accuracy {summary['val_accuracy_median']:.2%} (min {summary['val_accuracy_min']:.2%}, "
        f"target >= {args.min_accuracy:.0%}), wall {summary['wall_s_median']:.1f} s "
        f"(max {summary['wall_s_max']:.1f} s, target <= {args.max_seconds:.0f} s): {'met' if ok else 'NOT met'}"
    )
    print(json.dumps(summary))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
