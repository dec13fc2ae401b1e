"""What recording metrics costs per request, in-process: the calls one classify request makes (its outcome and
stage durations, and its share of one batch record at batch size 1, the worst case), timed over many rounds.
The folds into histograms that the records trigger every ``FOLD_EVERY`` records are included.

    .venv/bin/python scripts/metrics_cost.py
"""

from __future__ import annotations

import time

from service.core.metrics import NOT_OBSERVED, STAGES, BatchRecord, Metrics
from service.frontend.state import Timing
from service.transport.messages import Stamps


def main(rounds: int = 200_000) -> None:
    metrics = Metrics()
    observe_batch = metrics.batch_observer("digits", 1)
    # The recorder a served model version makes once, at load (service/frontend/state.py).
    requests = metrics.request_recorder("digits", 1, "cpu")
    record = BatchRecord(size=1, queue_s=[0.001], compute_s=0.002, device="cpu", failed=0)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for k in range(rounds):
            requests.record("success", 0.01 + k * 1e-9, 0.004, 0.002, 0.0003)
            observe_batch(record)
        best = min(best, (time.perf_counter() - started) / rounds)
    # The same with the stage histograms: the stages worked out from a request's stamps and recorded with it.
    timing = Timing(arrived=1.0, read=1.0001, decode_start=1.0002, decode_end=1.002, sent=1.0022,
                    engine=Stamps(1.0023, 1.0023, 1.0025, 1.004), answered=1.0042)  # fmt: skip
    staged = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for k in range(rounds):
            requests.record("success", 0.01 + k * 1e-9, 0.004, 0.002, 0.0003, timing.stages(1.0045 + k * 1e-9))
            observe_batch(record)
        staged = min(staged, (time.perf_counter() - started) / rounds)
    requests.record("bad_input", 0.001, 0.0005, NOT_OBSERVED, NOT_OBSERVED)
    metrics.render()  # the first render imports torch to ask for GPUs: not what each scrape costs
    started = time.perf_counter()
    text = metrics.render()
    render_ms = 1000 * (time.perf_counter() - started)
    print(f"metrics recording per request (batch size 1, best of 5 x {rounds}): {best * 1e6:.2f} us")
    print(f"  with the {len(STAGES)} stages worked out and recorded too: {staged * 1e6:.2f} us "
          f"(+{(staged - best) * 1e6:.2f} us)")  # fmt: skip
    print(f"one render of /metrics: {render_ms:.2f} ms, {len(text)} bytes")


if __name__ == "__main__":
    main()
