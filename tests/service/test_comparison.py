"""The rollout comparison's numbers (service/engine/comparison.py): Wilson's interval, agreement, score shifts, the
latency ratio at matched batch sizes, and the verdicts the decision rules give."""

from __future__ import annotations

import numpy as np
import pytest

from service.core.comparison import Comparison, verdict, wilson
from service.core.config import RolloutConfig

LABELS = [str(i) for i in range(10)]


def logits(top: list[int]) -> np.ndarray:
    rows = np.zeros((len(top), 10), dtype=np.float32)
    rows[np.arange(len(top)), top] = 5.0
    return rows


def test_wilson_interval_matches_known_values() -> None:
    low, high = wilson(98, 100, 0.95)
    assert low == pytest.approx(0.9300, abs=1e-3) and high == pytest.approx(0.9945, abs=1e-3)
    assert wilson(0, 0, 0.95) == (0.0, 1.0)
    low, high = wilson(50, 50, 0.95)
    assert high == 1.0 and low == pytest.approx(0.9287, abs=1e-3)


def test_agreement_overlap_shifts_and_classes() -> None:
    c = Comparison(LABELS)
    c.record(logits([1, 2, 3, 4]), logits([1, 2, 3, 5]), 0.001, 0.001)
    s = c.summary()
    assert (s["samples"], s["agreed"], s["agreement"]) == (4, 3, 0.75)
    assert 0 < s["topk_overlap"] < 1
    assert sum(s["score_shift"]["counts"]) == 4 and s["score_shift"]["mean"] < 0
    assert s["classes"][0] == {"index": 4, "label": "4", "samples": 1, "agreed": 0, "agreement": 0.0,
                               "moved_to": {"5": 1}}  # fmt: skip


def test_latency_ratio_compares_batches_of_the_same_size() -> None:
    c = Comparison(LABELS)
    # The primary computes batches of 8 (1 ms an image) and of 1 (2 ms); the candidate only batches of 1, at 2 ms:
    # the same speed, though its mean per image is twice the primary's overall.
    c.record(logits([1] * 8), logits([1] * 8), 0.001, 0.002, (8, 1))
    c.record(logits([1]), logits([1]), 0.002, 0.002, (1, 1))
    assert c.latency_ratio == pytest.approx(1.0)


def test_verdicts_promote_wait_and_abort() -> None:
    policy = RolloutConfig(candidate=2, min_samples=100, abort_min_samples=20)
    same = Comparison(LABELS)
    for _ in range(50):
        same.record(logits([3]), logits([3]), 0.001, 0.001)
        same.attempts += 1
    assert verdict(same, policy)[0] == "wait"  # too few samples
    for _ in range(450):
        same.record(logits([3]), logits([3]), 0.001, 0.001)
        same.attempts += 1
    assert verdict(same, policy)[0] == "promote"
    moved = Comparison(LABELS)
    for _ in range(20):
        moved.record(logits([3]), logits([4]), 0.001, 0.001)
        moved.attempts += 1
    decision, why = verdict(moved, policy)
    assert decision == "abort" and "below min_agreement" in why
    failing = Comparison(LABELS)
    failing.attempts = 20
    failing.record_error("boom", 20)
    decision, why = verdict(failing, policy)
    assert decision == "abort" and "boom" in why
