"""The server's own view of a step (README, "Load testing"), from its ``/metrics`` at the window's start and end,
summed over several models when given: request p99 from the histogram's buckets (as Prometheus's
``histogram_quantile`` reads it). A server without ``/metrics`` gives no split, and the report says so. The model's
statistics (``/v2/models/{m}/stats``, Triton's, so Triton's read too) give each batch size's compute per image and
the knee of those costs as the adaptive batch policy computes it (``CostModel.knee``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from service.core.batchcost import CostModel

STAGES = ("request", "queue", "preprocess", "compute", "postprocess")
STAGE_FAMILY = "visionserve_stage_duration_seconds"  # {stage=...}: where each answered request's time went
Sample = dict[str, float]  # "<sample name>|<le>" -> value, summed over the model's versions and devices


def scrape(url: str, model: str | Sequence[str], timeout_s: float = 5.0) -> Sample | None:
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    return parse(r.text, model) | batch_stats(url, model, timeout_s) if r.status_code == 200 else None


def batch_stats(url: str, model: str | Sequence[str], timeout_s: float = 5.0) -> Sample:
    """``batch_count|<size>`` and ``batch_compute_ns|<size>`` from the statistics of ``model`` (summed over its
    versions, and over several models when given a sequence), in one read of every model's; empty where the server
    has none."""
    models = {model} if isinstance(model, str) else set(model)
    try:
        r = httpx.get(f"{url.rstrip('/')}/v2/models/stats", timeout=timeout_s)
        rows = r.json().get("model_stats", []) if r.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        return {}
    out: defaultdict[str, float] = defaultdict(float)
    for row in rows:
        if row.get("name") not in models:
            continue
        for b in row.get("batch_stats", []):
            infer = b.get("compute_infer", {})
            out[f"batch_count|{b['batch_size']}"] += float(infer.get("count", 0))
            out[f"batch_compute_ns|{b['batch_size']}"] += float(infer.get("ns", 0))
    return dict(out)


def batch_costs(delta: Sample) -> dict[str, Any]:
    """Per batch size seen in ``delta``: batches and compute ms per image; and the knee of those costs (None with
    fewer than two sizes seen)."""
    counts = {int(k.split("|")[1]): v for k, v in delta.items() if k.startswith("batch_count|") and v > 0}
    ns = {n: delta.get(f"batch_compute_ns|{n}", 0.0) for n in counts}
    # a count or time that went down (a restarted server, another replica behind a proxy) is no measurement
    seconds = {n: ns[n] / c / 1e9 for n, c in counts.items() if ns[n] > 0}
    counts = {n: counts[n] for n in seconds}
    sizes = {n: {"batches": int(counts[n]), "ms_per_image": 1000 * seconds[n] / n} for n in sorted(counts)}
    knee = CostModel(seconds).knee(max(counts)) if counts else None
    return {"sizes": sizes, "knee": knee}


def parse(text: str, model: str | Sequence[str]) -> Sample:
    """``model``'s samples (summed over several models when given a sequence of names)."""
    models = {model} if isinstance(model, str) else set(model)
    out: defaultdict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("visionserve_"):
            continue
        for s in family.samples:
            if s.labels.get("model") not in models:
                continue
            key = s.name
            if "stage" in s.labels:
                key += "|" + s.labels["stage"]
            if "le" in s.labels:
                key += "|" + s.labels["le"]
            elif "outcome" in s.labels:
                key += "|" + s.labels["outcome"]
            out[key] += s.value
    return dict(out)


def bucket_quantile(delta: Sample, name: str, q: float, label: str = "") -> float:
    """``q`` of histogram ``name`` (of one ``stage`` label value, when given) from its buckets."""
    prefix = f"{name}_bucket|" + (f"{label}|" if label else "")
    edges = ((k[len(prefix) :], v) for k, v in delta.items() if k.startswith(prefix))
    buckets = sorted(((float(le), v) for le, v in edges if "|" not in le), key=lambda b: b[0])
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            span = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / span if span else 1.0)
        lower_bound, lower_count = bound, count
    return math.nan


def server_split(before: Sample | None, after: Sample | None) -> dict[str, Any] | None:
    """Per-stage means (ms), request p99 (ms), mean batch size and counts between two scrapes."""
    if before is None or after is None:
        return None
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    batches = delta.get("visionserve_batch_size_count", 0.0)
    return {
        "stages": stage_split(delta),
        "requests": {k.split("|")[1]: int(v) for k, v in delta.items() if k.startswith("visionserve_requests_total|")},
        "images": int(delta.get("visionserve_images_total", 0.0)),
        "batches": int(batches),
        "mean_batch_size": delta.get("visionserve_batch_size_sum", 0.0) / batches if batches else math.nan,
        "mean_ms": {stage: _mean_ms(delta, f"visionserve_{stage}_duration_seconds") for stage in STAGES},
        "request_p99_ms": 1000 * bucket_quantile(delta, "visionserve_request_duration_seconds", 0.99),
        "batch_costs": batch_costs(delta),
    }


def stage_split(delta: Sample) -> dict[str, dict[str, float]]:
    """Per stage (the server's order): mean and p99 ms over the requests answered between the scrapes; empty for a
    server that does not report stages."""
    names = [k.split("|")[1] for k in delta if k.startswith(STAGE_FAMILY + "_count|")]
    p99_ms = {name: 1000 * bucket_quantile(delta, STAGE_FAMILY, 0.99, name) for name in names}
    return {name: {"mean_ms": _mean_ms(delta, STAGE_FAMILY, "|" + name), "p99_ms": p99_ms[name]} for name in names}


def _mean_ms(delta: Sample, name: str, label: str = "") -> float:
    """The mean of histogram ``name`` (``label``: ``|`` and one label's value), in ms."""
    n = delta.get(f"{name}_count{label}", 0.0)
    return 1000 * delta.get(f"{name}_sum{label}", 0.0) / n if n else math.nan
