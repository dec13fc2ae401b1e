"""Served throughput, batching and server CPU time per request against the engine's in-process limit, in one run on
one machine: ``visionserve bench``'s pipeline figure (decode + run in one process, no HTTP, at batch 1 and 8) and the
runtime alone at batch 1, then the same model served (service/launcher.py) under the load tester's closed loop at
each ``--concurrency``: images/s and their share of the pipeline figure, p50 and p99, the server's mean batch size
(from its batch statistics) and its process tree's CPU time per answered request, both over the whole step.

    visionserve bench frontends --repository REPO --model resnet18 --duration-s 10 --warmup-s 2

docs/performance.md, "One engine, several front ends", holds the figures and the target (served >= 0.95 of the
pipeline). The split's cost against the single-process server it replaced, and ``--workers 1`` against ``2``, are
settled there; ``visionserve bench ab`` measures any such pair of configurations again.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadtest.inputs import payloads
from loadtest.pool import WorkerPool
from loadtest.step import StepSpec
from service import launcher
from service.bench.ab import measure
from service.bench.kit import Flag, bounds, header, in_process, write_json
from service.core.arguments import comma_ints, size_pair
from service.core.samples import photo_like_jpegs

FLAGS: list[Flag] = [
    ("--repository", "model_repository", "model repository"),
    ("--model", "resnet18", "model to measure"),
    ("--concurrency", (8, 1), "closed-loop clients, one step each", comma_ints),
    ("--duration-s", 10.0, "measured seconds per step"),
    ("--warmup-s", 2.0, "warm-up seconds per step"),
    ("--bench-seconds", 5.0, "bench: seconds per figure"),
    ("--workers", None, "front ends (default: the server's choice)", int),
    ("--image-size", (500, 375), "generated JPEGs' size, served and benched alike", size_pair),
    ("--json", None, "write every figure to this file (default: print only)"),
]


def main(args: argparse.Namespace) -> int:
    if not (Path(args.repository) / args.model).is_dir():
        print(f"--repository {args.repository} holds no model {args.model}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="vs-frontends-bench-"))
    jpegs = photo_like_jpegs(32, args.image_size)
    for i, data in enumerate(jpegs):
        (scratch / f"image-{i:02d}.jpg").write_bytes(data)
    results = header(machine=f"{os.cpu_count()} cores", model=args.model)
    limit = results["in_process"] = in_process(args, scratch, "engine,pipeline", "1,8")
    pipeline = limit["pipeline_images_per_s"]
    print(
        f"{args.model} in-process: pipeline {pipeline:.1f} images/s; runtime alone at batch 1 "
        f"{limit['engine_images_per_s']['1']:.1f} images/s"
    )
    served: dict[str, Any] = results.setdefault("served", {})
    with (
        launcher.start(args.repository, workers=args.workers, log=scratch / "server.log") as server,
        WorkerPool(1, payloads(args.model, jpegs)) as pool,
    ):
        where = bounds(server.url, args.warmup_s, args.duration_s)
        for concurrency in args.concurrency:
            spec = StepSpec("closed", concurrency=concurrency)
            row = served[str(concurrency)] = measure(pool, spec, where, args.model, server.process.pid)
            row["of_pipeline"] = row["images_per_s"] / pipeline
            print(
                f"{args.model} c={concurrency}: {row['images_per_s']:.1f} images/s = {row['of_pipeline']:.3f} of the "
                f"pipeline; {row['server_cpu_ms_per_request']:.2f} server CPU ms/request, mean batch "
                f"{row['mean_batch_size'] or math.nan:.2f}, p50 {row['p50_ms']:.1f} ms, p99 {row['p99_ms']:.1f} ms, "
                f"errors {sum(row['errors'].values())}"
            )
    if args.json:
        write_json(args.json, results)
    return 0
