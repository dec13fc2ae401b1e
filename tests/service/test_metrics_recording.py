"""The metrics' hot-path recording: raw records folded in bulk must give exactly what prometheus-client's own
per-call histograms and counters give, and nothing recorded may be lost to a fold running at the same time."""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.parser import text_string_to_metric_families

from service.core.metrics import DURATION_BUCKETS, FOLD_EVERY, NOT_OBSERVED, OUTCOMES, BatchRecord, Metrics

IDENTITY = ("model", "version", "device", "protocol")


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in IDENTITY))
            out[(s.name, labels)] = s.value
    return out


def test_folded_histograms_equal_prometheus_clients_own() -> None:
    rng = np.random.default_rng(0)
    values = np.concatenate([
        rng.lognormal(np.log(0.02), 1.5, 5000),  # the whole range, past the last bound too
        np.array(DURATION_BUCKETS),  # exactly on every bound: le means "less than or equal"
        np.array([0.0, 1e-9, 100.0]),
    ])  # fmt: skip
    reference = Histogram("ref", "ref", buckets=DURATION_BUCKETS, registry=CollectorRegistry())
    metrics = Metrics()
    recorder = metrics.request_recorder("m", 1, "cpu")
    for v in values:
        reference.observe(float(v))
        recorder.record("success", float(v), NOT_OBSERVED, NOT_OBSERVED, NOT_OBSERVED)
    ours = samples(metrics)
    theirs = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in reference.collect() for s in m.samples}
    for (name, labels), value in theirs.items():
        if name.endswith("_created"):
            continue
        mine = ours[(name.replace("ref", "visionserve_request_duration_seconds"), labels)]
        if name.endswith("_sum"):  # summed in another order: equal to rounding
            assert abs(mine - value) < 1e-9 * max(1.0, value), (name, mine, value)
        else:
            assert mine == value, (name, labels, mine, value)
    # Stages never reached are not observed at all.
    assert ours[("visionserve_queue_duration_seconds_count", ())] == 0
    assert ours[("visionserve_requests_total", (("outcome", "success"),))] == len(values)


def test_outcomes_batches_and_what_a_scrape_sees_are_exact() -> None:
    metrics = Metrics()
    recorder = metrics.request_recorder("m", 1, "cpu")
    observe = metrics.batch_observer("m", 1)
    expected = dict.fromkeys(OUTCOMES, 0)
    sizes = []
    for k in range(3 * FOLD_EVERY + 7):  # several folds on the way, and a remainder only the scrape folds
        outcome = OUTCOMES[k % len(OUTCOMES)]
        expected[outcome] += 1
        recorder.record(outcome, 0.01, 0.002 if k % 2 else NOT_OBSERVED, 0.001, 0.0001)
        size = 1 + k % 32
        sizes.append(size)
        observe(BatchRecord(size=size, queue_s=[0.0] * size, compute_s=0.003, device="cpu", failed=0))
    got = samples(metrics)
    for outcome, n in expected.items():
        assert got[("visionserve_requests_total", (("outcome", outcome),))] == n
    assert got[("visionserve_preprocess_duration_seconds_count", ())] == (3 * FOLD_EVERY + 7) // 2
    assert got[("visionserve_batches_total", ())] == len(sizes)
    assert got[("visionserve_images_total", ())] == sum(sizes)
    assert got[("visionserve_batch_size_sum", ())] == sum(sizes)
    assert got[("visionserve_batch_size_bucket", (("le", "1.0"),))] == sizes.count(1)
    assert got[("visionserve_compute_duration_seconds_count", ())] == len(sizes)


def test_records_from_many_threads_during_scrapes_are_all_counted() -> None:
    metrics = Metrics()
    recorder = metrics.request_recorder("m", 1, "cpu")
    per_thread, threads = 20_000, 4
    stop = threading.Event()

    def scrape_all_along() -> None:
        while not stop.is_set():
            metrics.render()

    def record() -> None:
        for _ in range(per_thread):
            recorder.record("success", 0.01, NOT_OBSERVED, NOT_OBSERVED, NOT_OBSERVED)

    scraper = threading.Thread(target=scrape_all_along)
    scraper.start()
    workers = [threading.Thread(target=record) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    stop.set()
    scraper.join(60)
    got = samples(metrics)
    assert got[("visionserve_requests_total", (("outcome", "success"),))] == per_thread * threads
    assert got[("visionserve_request_duration_seconds_count", ())] == per_thread * threads
