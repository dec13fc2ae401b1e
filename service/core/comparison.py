"""A candidate version's answers beside the primary's, on the same inputs: the evidence a rollout decides on.

Pure numbers (numpy in, a dict out; no event loop): :meth:`Comparison.record` takes both versions' logits for the
same images, :meth:`Comparison.summary` gives what ``GET /v2/models/{m}/rollout`` shows (docs/rollouts.md), and
:func:`verdict` reads a summary against a :class:`~service.core.config.RolloutConfig`.

Top-1 agreement is a binomial proportion; its interval is Wilson's score interval, which stays inside [0, 1] and
behaves at the proportions a rollout lives at (0.99 and above), where the normal approximation does not.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import NormalDist
from typing import Any

import numpy as np

from service.core.scores import softmax
from service.core.status import InferResult

TOPK = 5
# Buckets of the candidate's probability for the primary's top-1 class minus the primary's own.
SHIFT_EDGES = (-1.0, -0.5, -0.2, -0.1, -0.05, -0.02, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
LATENCY_WINDOW = 2048  # recent per-image compute times kept per version, for p50 and p99


def wilson(agreed: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson's score interval of ``agreed / n`` at ``confidence`` (two-sided); (0, 1) with no samples."""
    if n <= 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(0.5 + confidence / 2.0)
    p = agreed / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _quantiles(values: deque[float]) -> dict[str, float | None]:
    # list(): one step under the GIL, though a scrape reads on its own thread while the loop appends
    a = np.asarray(list(values), dtype=np.float64) * 1000.0
    if not a.size:
        return {"mean": None, "p50": None, "p99": None}
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99))}


class Comparison:
    """Running counts of a candidate against the primary. ``labels`` name the primary's classes."""

    measure = "top-1 agreement"  # what an image's agreement is (a detector's: service/core/tasks/box_comparison.py)

    def __init__(self, labels: list[str], *, confidence: float = 0.95) -> None:
        self.labels = labels
        self.confidence = confidence
        self.samples = 0
        self.agreed = 0
        self.overlap_sum = 0.0
        self.shift_counts = [0] * (len(SHIFT_EDGES) - 1)
        self.shift_sum = 0.0
        self.attempts = 0  # candidate computations asked for (answered, failed or shed after queueing)
        self.errors = 0
        self.last_error: str | None = None
        self.shed = 0
        self.per_class: dict[int, list[int]] = {}  # primary top-1 -> [samples, agreed]
        self.moved: dict[tuple[int, int], int] = {}  # (primary top-1, candidate top-1) -> count, where they differ
        self.primary_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self.candidate_s: deque[float] = deque(maxlen=LATENCY_WINDOW)
        # (version, batch size) -> [seconds per image summed, images]: the latency ratio compares like with like
        # (a shadow computes alone, in small batches, beside a primary's larger ones).
        self._by_size: dict[tuple[str, int], list[float]] = {}

    def rows(self, result: InferResult, ok: list[int]) -> np.ndarray:
        """What :meth:`record` compares of one version's answer, rows ``ok`` only: a classifier's logits."""
        return result.logits[ok]

    def record(
        self,
        primary: np.ndarray,
        candidate: np.ndarray,
        primary_s: float,
        candidate_s: float,
        sizes: tuple[int, int] = (1, 1),
    ) -> None:
        """Both versions' logits ``[N, C]`` for the same N images, with each one's compute seconds per image and
        the sizes of the batches that computed them. Rows of images either version failed are left out by the
        caller."""
        n = int(primary.shape[0])
        if n == 0:
            return
        p_top = primary.argmax(axis=1)
        c_top = candidate.argmax(axis=1)
        same = p_top == c_top
        self.samples += n
        self.agreed += int(same.sum())
        k = min(TOPK, primary.shape[1], candidate.shape[1])
        p_k = np.argsort(-primary, axis=1)[:, :k]
        c_k = np.argsort(-candidate, axis=1)[:, :k]
        self.overlap_sum += sum(len(set(p) & set(c)) / k for p, c in zip(p_k.tolist(), c_k.tolist(), strict=True))
        classes = min(primary.shape[1], candidate.shape[1])
        rows = np.arange(n)
        keep = p_top < classes
        shift = np.zeros(n)
        shift[keep] = softmax(candidate)[rows[keep], p_top[keep]] - softmax(primary)[rows[keep], p_top[keep]]
        self.shift_sum += float(shift.sum())
        for bucket in np.clip(np.searchsorted(SHIFT_EDGES, shift, side="right") - 1, 0, len(self.shift_counts) - 1):
            self.shift_counts[int(bucket)] += 1
        for p, c in zip(p_top.tolist(), c_top.tolist(), strict=True):
            counts = self.per_class.setdefault(p, [0, 0])
            counts[0] += 1
            if p == c:
                counts[1] += 1
            else:
                self.moved[(p, c)] = self.moved.get((p, c), 0) + 1
        self.record_times(n, primary_s, candidate_s, sizes)

    def record_times(self, n: int, primary_s: float, candidate_s: float, sizes: tuple[int, int]) -> None:
        """Each version's compute seconds per image for ``n`` compared images, by batch size."""
        self.primary_s.extend([primary_s] * n)
        self.candidate_s.extend([candidate_s] * n)
        for version, size, seconds in (("p", sizes[0], primary_s), ("c", sizes[1], candidate_s)):
            into = self._by_size.setdefault((version, size), [0.0, 0])
            into[0] += seconds * n
            into[1] += n

    def record_error(self, message: str, images: int = 1) -> None:
        """The candidate failed ``images`` images (its own error, not the primary's)."""
        self.errors += images
        self.last_error = message

    def record_shed(self, images: int = 1) -> None:
        """Sampled images whose candidate work was not done, so live work would not wait for it."""
        self.shed += images

    @property
    def error_rate(self) -> float:
        return self.errors / self.attempts if self.attempts else 0.0

    @property
    def latency_ratio(self) -> float | None:
        """The candidate's compute per image over the primary's, on the compared images, at the batch sizes both
        computed (overall where they share none)."""
        by_size = dict(self._by_size)
        ratios = [
            (n, (total / n) / (by_size[("p", size)][0] / by_size[("p", size)][1]))
            for (version, size), (total, n) in by_size.items()
            if version == "c" and ("p", size) in by_size and by_size[("p", size)][0] > 0
        ]
        if ratios:  # per batch size both versions computed, weighted by the candidate's images at each
            return sum(n * r for n, r in ratios) / sum(n for n, _ in ratios)
        primary, candidate = (sum(t for (v, _), (t, _) in by_size.items() if v == version) for version in "pc")
        return candidate / primary if primary > 0 else None

    def interval(self) -> tuple[float, float]:
        return wilson(self.agreed, self.samples, self.confidence)

    def summary(self) -> dict[str, Any]:
        """The comparison as docs/rollouts.md shows it."""
        low, high = self.interval()
        classes: list[dict[str, Any]] = []
        moved_all = sorted(list(self.moved.items()), key=lambda x: -x[1])  # list(): one step under the GIL
        for index, (n, agreed) in list(self.per_class.items()):
            moved = {self._label(c): k for (p, c), k in moved_all if p == index}
            classes.append({"index": index, "label": self._label(index), "samples": n, "agreed": agreed,
                            "agreement": agreed / n, "moved_to": moved})  # fmt: skip
        classes.sort(key=lambda c: (c["agreement"], -c["samples"]))
        return {
            "measure": self.measure,
            "samples": self.samples,
            "agreed": self.agreed,
            "agreement": self.agreed / self.samples if self.samples else None,
            "agreement_low": low,
            "agreement_high": high,
            "confidence": self.confidence,
            "topk": TOPK,
            "topk_overlap": self.overlap_sum / self.samples if self.samples else None,
            "score_shift": {
                "edges": list(SHIFT_EDGES),
                "counts": list(self.shift_counts),
                "mean": self.shift_sum / self.samples if self.samples else None,
            },
            "primary_ms": _quantiles(self.primary_s),
            "candidate_ms": _quantiles(self.candidate_s),
            "latency_ratio": self.latency_ratio,
            "attempts": self.attempts,
            "errors": self.errors,
            "error_rate": self.error_rate,
            "last_error": self.last_error,
            "shed": self.shed,
            "classes": classes,
        }

    def _label(self, index: int) -> str:
        return self.labels[index] if 0 <= index < len(self.labels) else str(index)


def verdict(comparison: Comparison, policy: Any) -> tuple[str, str]:
    """("promote" | "abort" | "wait", why) for the evidence so far under ``policy`` (a RolloutConfig)."""
    n = comparison.samples
    low, high = comparison.interval()
    errors_past = comparison.attempts >= policy.abort_min_samples
    if errors_past and comparison.error_rate > policy.max_error_rate:
        return "abort", (
            f"the candidate failed {comparison.errors} of {comparison.attempts} images "
            f"({comparison.error_rate:.1%}, over max_error_rate {policy.max_error_rate:g}); "
            f"last error: {comparison.last_error}"
        )
    if n >= policy.abort_min_samples and high < policy.min_agreement:
        return "abort", (
            f"{comparison.measure} {comparison.agreed}/{n} = {comparison.agreed / n:.2%}, interval [{low:.4f}, "
            f"{high:.4f}] at {policy.confidence:g} lies below min_agreement {policy.min_agreement:g}"
        )
    if n < policy.min_samples:
        return "wait", f"{n} of {policy.min_samples} samples compared"
    if low < policy.min_agreement:
        return "wait", (
            f"agreement interval [{low:.4f}, {high:.4f}] still holds min_agreement {policy.min_agreement:g}: "
            "more samples needed"
        )
    ratio = comparison.latency_ratio
    if ratio is not None and ratio > policy.max_latency_ratio:
        return "wait", (
            f"the candidate computes {ratio:.2f}x the primary's time per image (max {policy.max_latency_ratio:g})"
        )
    if comparison.error_rate > policy.max_error_rate:
        return "wait", f"candidate error rate {comparison.error_rate:.2%} over {policy.max_error_rate:g}"
    return "promote", (
        f"{comparison.measure} {comparison.agreed}/{n} = {comparison.agreed / n:.2%}, interval [{low:.4f}, {high:.4f}] "
        f"above min_agreement {policy.min_agreement:g}; latency ratio "
        f"{'n/a' if ratio is None else f'{ratio:.2f}'}; {comparison.errors} errors"
    )
