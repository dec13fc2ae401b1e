"""Served throughput, batching and server CPU time per request against the engine's in-process limit, in one run on
one machine: ``visionserve bench``'s pipeline figure (decode + run in one process, no HTTP, at batch 1 and 8) and the
runtime alone at batch 1, then the same model served (service/launcher.py) under the load tester's closed loop at
each ``--concurrency``: images/s and their share of the pipeline figure, p50 and p99, the server's mean batch size
(from its /metrics) and its process tree's CPU time per answered request.

    .venv/bin/python scripts/frontends_bench.py --repository REPO --model resnet18 --duration-s 10 --warmup-s 2

docs/performance.md, "One engine, several front ends", holds the figures and the target (served >= 0.95 of the
pipeline). The split's cost against the single-process server it replaced, and ``--workers 1`` against ``2``, are
settled there; ``scripts/ab.py`` measures any such pair of configurations again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ab import measure

from loadtest.inputs import payloads
from loadtest.pool import WorkerPool
from loadtest.step import StepBounds, StepSpec
from service import launcher
from service.core.arguments import comma_ints, size_pair
from service.core.samples import photo_like_jpegs


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", default="model_repository", help="model repository (default: %(default)s)")
    p.add_argument("--model", default="resnet18", help="model to measure (default: %(default)s)")
    p.add_argument("--concurrency", type=comma_ints, default=(8, 1), help="closed-loop clients, one step each "
                   "(default: 8,1)")  # fmt: skip
    p.add_argument("--duration-s", type=float, default=10.0, help="measured seconds per step (default: %(default)s)")
    p.add_argument("--warmup-s", type=float, default=2.0, help="warm-up seconds per step (default: %(default)s)")
    p.add_argument("--bench-seconds", type=float, default=5.0, help="bench: seconds per figure (default: %(default)s)")
    p.add_argument("--workers", type=int, default=None, help="front ends (default: the server's choice)")
    p.add_argument("--image-size", type=size_pair, default=(500, 375), metavar="WxH", help="generated JPEGs' size, "
                   "served and benched alike (default: 500x375)")  # fmt: skip
    p.add_argument("--json", default=None, help="write every figure to this file (default: print only)")
    return p


def bench_pipeline(args: argparse.Namespace, images: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "service.cli", "bench", "--model", args.model, "--repository", args.repository,
           "--figures", "engine,pipeline", "--batch-sizes", "1,8", "--seconds", str(args.bench_seconds),
           "--images", str(images), "--json", "--no-progress"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not (Path(args.repository) / args.model).is_dir():
        print(f"--repository {args.repository} holds no model {args.model}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="vs-frontends-bench-"))
    jpegs = photo_like_jpegs(32, args.image_size)
    for i, data in enumerate(jpegs):
        (scratch / f"image-{i:02d}.jpg").write_bytes(data)
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "model": args.model}  # fmt: skip
    limit = results["in_process"] = bench_pipeline(args, scratch)
    pipeline = limit["pipeline_images_per_s"]
    print(f"{args.model} in-process: pipeline {pipeline:.1f} images/s; runtime alone at batch 1 "
          f"{limit['engine_images_per_s']['1']:.1f} images/s", flush=True)  # fmt: skip
    served: dict[str, Any] = results.setdefault("served", {})
    with (
        launcher.start(args.repository, workers=args.workers, log=scratch / "server.log") as server,
        WorkerPool(1, payloads(args.model, jpegs)) as pool,
    ):
        bounds = StepBounds(url=server.url, warmup_s=args.warmup_s, duration_s=args.duration_s, drain_s=10.0,
                            timeout_s=30.0, max_requests=10**8)  # fmt: skip
        for concurrency in args.concurrency:
            spec = StepSpec("closed", concurrency=concurrency)
            row = served[str(concurrency)] = measure(pool, spec, bounds, args.model, server.process.pid)
            row["of_pipeline"] = row["images_per_s"] / pipeline
            print(f"{args.model} c={concurrency}: {row['images_per_s']:.1f} images/s = {row['of_pipeline']:.3f} of the "
                  f"pipeline; {row['server_cpu_ms_per_request']:.2f} server CPU ms/request, mean batch "
                  f"{row['mean_batch_size'] or math.nan:.2f}, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, "
                  f"errors {sum(row['errors'].values())}", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
