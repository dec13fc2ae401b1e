"""What recording metrics costs per request, in-process: the calls one classify request makes (its outcome and
stage histograms, and its share of one batch record at batch size 1, the worst case), timed over many rounds.

    .venv/bin/python scripts/metrics_cost.py
"""

from __future__ import annotations

import time

from service.batching.batcher import BatchRecord
from service.metrics import Metrics


def main(rounds: int = 200_000) -> None:
    metrics = Metrics()
    labels = ("digits", "1", "cpu")
    observe_batch = metrics.batch_observer("digits", 1)
    # The children a served model version looks up once, at load (service/http/state.py).
    success = metrics.requests.labels(*labels, "success")
    request_h, preprocess_h = metrics.request_seconds.labels(*labels), metrics.preprocess_seconds.labels(*labels)
    queue_h, postprocess_h = metrics.queue_seconds.labels(*labels), metrics.postprocess_seconds.labels(*labels)
    record = BatchRecord(size=1, queue_s=[0.001], compute_s=0.002, device="cpu", failed=0)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(rounds):
            success.inc()
            request_h.observe(0.01)
            preprocess_h.observe(0.004)
            queue_h.observe(0.002)
            postprocess_h.observe(0.0003)
            observe_batch(record)
        best = min(best, (time.perf_counter() - started) / rounds)
    print(f"metrics recording per request (batch size 1, best of 5 x {rounds}): {best * 1e6:.1f} us")


if __name__ == "__main__":
    main()
