"""What one detection request may cost (issue 53; docs/detection.md, "What one request may cost"): the ``Detect``
task's postprocessing of a YOLO head's ``[N, 4 + C, A]`` output at ``score_threshold`` 0 and ``max_detections``
10,000, then msgspec's JSON of the detections as the routes encode them. Prints the times and the memory.

    python scripts/detect_cost.py --head grid      # disjoint boxes: nothing suppressed
    python scripts/detect_cost.py --head random    # random boxes and scores
    python scripts/detect_cost.py --head blank     # every box 0x0 at the origin, every score 0
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import tracemalloc
from collections.abc import Sequence
from types import SimpleNamespace

import msgspec
import numpy as np

from service.core.status import InferResult
from service.core.tasks import Detect, DetectOptions, Want


def head(kind: str, images: int, anchors: int, classes: int) -> np.ndarray:
    """A YOLO head's output of ``kind`` (grid, random, blank), seeded."""
    rng = np.random.default_rng(0)
    out = np.zeros((images, 4 + classes, anchors), np.float32)
    if kind == "random":
        out[:, 0:2] = rng.uniform(0, 640, (images, 2, anchors))
        out[:, 2:4] = rng.uniform(4, 64, (images, 2, anchors))
        out[:, 4:] = rng.uniform(0, 1, (images, classes, anchors))
    elif kind == "grid":
        side = int(np.ceil(np.sqrt(anchors)))
        i = np.arange(anchors)
        out[:, 0], out[:, 1], out[:, 2:4] = (i % side) * 7 + 3, (i // side) * 7 + 3, 5
        out[:, 4:] = rng.uniform(0, 1, (images, classes, anchors))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    kinds = ("grid", "random", "blank")
    p.add_argument("--head", choices=kinds, default="grid", help="the head's output; default: grid")
    p.add_argument("--images", type=int, default=64, help="images in the request; default: 64 (--max-images)")
    p.add_argument("--anchors", type=int, default=8400, help="anchors an image; default: 8400 (YOLO at 640)")
    p.add_argument("--classes", type=int, default=80, help="classes; default: 80")
    p.add_argument("--trace", action="store_true", help="also trace Python's allocations (slower); default: off")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = head(args.head, args.images, args.anchors, args.classes)
    spec = SimpleNamespace(labels=tuple(f"c{i}" for i in range(args.classes)), max_detections=100,
                           input=SimpleNamespace(width=640, height=640), output_layout="yolo")  # fmt: skip
    task = Detect(spec)
    want = Want(options=DetectOptions(score_threshold=0.0, max_detections=10_000))
    if args.trace:
        tracemalloc.start()
    started = time.perf_counter()
    post = task.postprocess(InferResult(outputs={"output0": out}, errors=[None] * args.images), want)
    posted = time.perf_counter()
    body = msgspec.json.encode(post.predictions)
    encoded = time.perf_counter()
    peak = f", traced peak {tracemalloc.get_traced_memory()[1] / 2**20:.0f} MiB" if args.trace else ""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    found = sum(post.detections or [])
    print(f"{args.head}: postprocess {(posted - started) * 1000:.0f} ms, JSON {(encoded - posted) * 1000:.0f} ms, "
          f"{found} detections, answer {len(body) / 1e6:.1f} MB, output {out.nbytes / 2**20:.0f} MiB"
          f"{peak}, max RSS {rss:.0f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
