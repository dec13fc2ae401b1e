"""The metrics of rollouts (docs/rollouts.md): for each model with a rollout, what is compared with what, how much
they agree (with the interval's bounds), the top-k overlap, the latency ratio, the configured and effective
fractions, the sampled requests compared, shed or failed, and the score shift as a histogram. Read at scrape time
from the documents ``GET /v2/models/{m}/rollout`` answers, so the two never disagree."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from service.core.metrics import ScrapeCollector, le_buckets

log = logging.getLogger(__name__)

# comparison's field behind each outcome of visionserve_rollout_samples_total
OUTCOMES = (("compared", "samples"), ("shed", "shed"), ("error", "errors"))
BOUNDS = (("estimate", "agreement"), ("low", "agreement_low"), ("high", "agreement_high"))


class RolloutCollector(ScrapeCollector):
    """``snapshot()`` gives one rollout document per model with a rollout (running, promoted or aborted), as
    ``GET /v2/models/{m}/rollout`` answers it. Every family is yielded on every scrape, with no samples when there
    is no rollout, so a dashboard's queries name metrics the server exports; a gauge whose value is null (no sample
    compared yet) is left out."""

    def __init__(self, snapshot: Callable[[], list[dict[str, Any]]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        documents = sorted((d for d in self.snapshot() if d.get("state", "none") != "none"), key=lambda d: d["model"])
        info = GaugeMetricFamily("visionserve_rollout_info", "A rollout: its mode, primary and candidate versions, "
                                 "and state (running, promoted, aborted)",
                                 labels=("model", "mode", "primary", "candidate", "state"))  # fmt: skip
        agreement = GaugeMetricFamily("visionserve_rollout_agreement", "Top-1 agreement of candidate and primary: "
                                      "the estimate and its interval's bounds (Wilson score)",
                                      labels=("model", "bound"))  # fmt: skip
        overlap = GaugeMetricFamily("visionserve_rollout_topk_overlap", "Mean overlap of the candidate's and the "
                                    "primary's top-k classes", labels=("model",))  # fmt: skip
        ratio = GaugeMetricFamily("visionserve_rollout_latency_ratio", "Candidate / primary compute per image",
                                  labels=("model",))  # fmt: skip
        fraction = GaugeMetricFamily("visionserve_rollout_fraction", "Fraction of the requests that name no version "
                                     "taking part in the rollout: configured and effective",
                                     labels=("model", "kind"))  # fmt: skip
        samples = CounterMetricFamily("visionserve_rollout_samples", "Sampled requests of a rollout by outcome: "
                                      "compared, shed (shadow work not done) or error (the candidate failed)",
                                      labels=("model", "outcome"))  # fmt: skip
        shift = Metric("visionserve_rollout_score_shift", "The candidate's probability of the primary's top-1 class "
                       "minus the primary's", "histogram")  # fmt: skip
        for doc in documents:
            model = str(doc["model"])
            comparison = doc.get("comparison") or {}
            labels = [model, str(doc.get("mode", "")), str(doc.get("primary", "")), str(doc.get("candidate", "")),
                      str(doc["state"])]  # fmt: skip
            info.add_metric(labels, 1)
            for bound, field in BOUNDS:
                _add(agreement, [model, bound], comparison.get(field))
            _add(overlap, [model], comparison.get("topk_overlap"))
            _add(ratio, [model], comparison.get("latency_ratio"))
            _add(fraction, [model, "configured"], doc.get("fraction"))
            _add(fraction, [model, "effective"], doc.get("effective_fraction"))
            for outcome, field in OUTCOMES:
                _add(samples, [model, outcome], comparison.get(field))
            _add_histogram(shift, model, comparison.get("score_shift"), comparison.get("samples"))
        yield from (info, agreement, overlap, ratio, fraction, samples, shift)


def _add(family: GaugeMetricFamily | CounterMetricFamily, labels: list[str], value: float | None) -> None:
    if value is not None:
        family.add_metric(labels, value)


def _add_histogram(family: Metric, model: str, shift: dict[str, Any] | None, samples: float | None) -> None:
    """Cumulative buckets, ``le`` each bucket's upper edge, then ``+Inf``; the sum is mean * samples.
    Written sample by sample: prometheus_client's HistogramMetricFamily drops the count and sum of a histogram
    whose first bucket is negative (OpenMetrics: its sum is no counter), and a shift is negative half the time."""
    if not shift or not shift.get("edges"):
        return
    edges, counts = shift["edges"], shift.get("counts") or []
    if len(counts) != len(edges) - 1:
        log.warning("rollout of %s: score_shift has %d edges and %d counts; not exported", model, len(edges),
                    len(counts))  # fmt: skip
        return
    for le, running in le_buckets([*counts, 0], tuple(edges[1:])):  # +Inf: every sample
        family.add_sample(family.name + "_bucket", {"model": model, "le": le}, running)
    family.add_sample(family.name + "_count", {"model": model}, running)
    family.add_sample(family.name + "_sum", {"model": model}, (shift.get("mean") or 0.0) * (samples or 0))
