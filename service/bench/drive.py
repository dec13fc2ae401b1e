"""The load tester's engine (``loadtest``'s worker processes, steps, histograms and report fields) against a plain
HTTP route that takes one image as a ``multipart/form-data`` file: how ``make gpu-speed`` loads LitServe, which parses
a raw body as JSON. Prints one JSON object (``--json``) shaped as loadtest's: ``{"steps": [...]}``, plus ``sent``.
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Sequence
from typing import Any

from loadtest.inputs import Payload, media_type
from loadtest.pool import WorkerPool
from loadtest.step import StepBounds, StepSpec, run_step


def form_payload(path: str, field: str, data: bytes) -> Payload:
    """One image as the file ``field`` of a multipart form, as a browser or ``requests`` sends it."""
    boundary = uuid.uuid4().hex
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="{field}"; filename="image.jpg"\r\n'
            f"Content-Type: {media_type(data)}\r\n\r\n")  # fmt: skip
    body = head.encode() + data + f"\r\n--{boundary}--\r\n".encode()
    return Payload(path, {"content-type": f"multipart/form-data; boundary={boundary}"}, body, 1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("drive", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--url", required=True, help="server address")
    p.add_argument("--path", default="/predict", help="the route posted to (default: /predict)")
    p.add_argument("--field", default="image", help="the form field holding the image (default: image)")
    p.add_argument("--mode", choices=("closed", "open"), default="closed", help="closed or open loop (default: closed)")
    p.add_argument("--concurrency", default="1", help="closed loop: clients per step, comma-separated (default: 1)")
    p.add_argument("--rate", default="", help="open loop: requests/s per step, comma-separated (default: none)")
    p.add_argument("--duration", type=float, default=4.0, help="measured seconds per step (default: 4)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds per step before measuring (default: 1)")
    p.add_argument("--drain", type=float, default=10.0, help="seconds to wait for answers owed (default: 10)")
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout in seconds (default: 30)")
    p.add_argument("--processes", type=int, default=1, help="load-generating processes (default: 1)")
    p.add_argument("--image-size", default="500x375", help="generated JPEGs: WIDTHxHEIGHT (default: 500x375)")
    p.add_argument("--json", action="store_true", help="print one JSON object (default: off, a line per step)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from service.core.samples import photo_like_jpegs

    args = build_parser().parse_args(argv)
    url, (width, _, height) = args.url.rstrip("/"), args.image_size.partition("x")
    bodies = [form_payload(args.path, args.field, j) for j in photo_like_jpegs(32, (int(width), int(height)))]
    bounds = StepBounds(url=url, warmup_s=args.warmup, duration_s=args.duration, drain_s=args.drain,
                        timeout_s=args.timeout, max_requests=1_000_000, scrape=False)  # fmt: skip
    if args.mode == "closed":
        specs = [StepSpec("closed", concurrency=int(c)) for c in args.concurrency.split(",")]
    else:
        specs = [StepSpec("open", rate=float(r), arrival="poisson") for r in args.rate.split(",") if r]
    steps: list[dict[str, Any]] = []
    sent = 0
    with WorkerPool(args.processes, bodies) as pool:
        for spec in specs:
            result = run_step(pool, spec, bounds, "-")
            sent += result.sent
            steps.append({k: v for k, v in result.summary().items() if k != "histogram"})
            if not args.json:
                print(f"{spec.label}: {result.images_per_s:.1f} images/s, p99 {result.latency_ms(99):.1f} ms")
    if args.json:
        print(json.dumps({"url": url, "path": args.path, "mode": args.mode, "steps": steps, "sent": sent}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
