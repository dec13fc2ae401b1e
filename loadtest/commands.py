"""``visionserve loadtest`` (closed loop for now). Heavy imports wait until the command runs."""

from __future__ import annotations

import argparse
import json

from service.cli import comma_ints


def add_loadtest_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Load a server over HTTP with closed-loop clients and report throughput and latency per step."
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server address")
    p.add_argument("--model", required=True, help="model to classify with")
    p.add_argument("--mode", default="closed", choices=["closed"], help="closed: each client sends, waits, sends again")
    p.add_argument("--concurrency", type=comma_ints, default=(1, 4, 16), help="clients per step, comma-separated")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per step")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds per step before measuring")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="most requests per step")
    p.add_argument("--images", default=None, help="folder of images, cycled; default: generated 500x375 JPEGs")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_loadtest(args: argparse.Namespace) -> int:
    import asyncio

    from loadtest.closed import closed_loop, generated_jpegs, read_images

    images = read_images(args.images) if args.images else generated_jpegs()
    steps = []
    for concurrency in args.concurrency:
        step = asyncio.run(
            closed_loop(args.url, args.model, images, concurrency=concurrency, duration_s=args.duration,
                        warmup_s=args.warmup, max_requests=args.max_requests)
        )  # fmt: skip
        steps.append(step.summary())
        if not args.json:
            s = steps[-1]
            lat = s["latency_ms"]
            print(
                f"concurrency {concurrency:>4}: {s['requests_per_s']:8.1f} req/s  {s['images_per_s']:8.1f} images/s  "
                f"p50 {lat['p50']:7.1f} ms  p99 {lat['p99']:7.1f} ms  errors {s['errors'] or 0}",
                flush=True,
            )
    if args.json:
        print(json.dumps({"url": args.url, "model": args.model, "mode": args.mode, "steps": steps}))
    return 0
