"""The highest open-loop rate whose p99 meets a target with no errors: double until a step fails, then bisect.

The answer comes with the two steps that bound it (the best that passed, the lowest that failed), so a reader can
see how sharp the edge is. A failing step that was client-limited is run once more before it counts; if it fails
client-limited again, the bound is flagged, since then the generator, not the server, may have set it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loadtest.step import StepResult


@dataclass
class SloSearch:
    target_p99_ms: float
    steps: list[StepResult] = field(default_factory=list)
    passed: StepResult | None = None  # the highest rate that met the target
    failed: StepResult | None = None  # the lowest rate that did not

    def meets(self, step: StepResult) -> bool:
        return step.error_count == 0 and step.requests > 0 and step.latency_ms(99) <= self.target_p99_ms

    @property
    def best_rate(self) -> float | None:
        return self.passed.spec.rate if self.passed else None

    def summary(self) -> dict[str, Any]:
        return {
            "target_p99_ms": self.target_p99_ms,
            "best_rate": self.best_rate,
            "passed": self.passed.summary() if self.passed else None,
            "failed": self.failed.summary() if self.failed else None,
            "client_limited": bool(self.failed and self.failed.client_limited),
            "tried": [(s.spec.rate, self.meets(s), s.latency_ms(99), s.error_count) for s in self.steps],
        }


def search(
    run: Callable[[float], StepResult],
    target_p99_ms: float,
    *,
    start_rate: float = 10.0,
    max_rate: float = 100_000.0,
    max_steps: int = 12,
    precision: float = 0.05,
) -> SloSearch:
    """``run(rate)`` runs one open-loop step. Stops when the bracket is within ``precision`` or after ``max_steps``."""
    result = SloSearch(target_p99_ms)

    def attempt(rate: float) -> bool:
        for _ in range(2):
            step = run(rate)
            result.steps.append(step)
            ok = result.meets(step)
            # A failure where the generator fell behind (a stalled client process on a shared machine) says nothing
            # about the server, so the rate is tried once more before it may bound the answer.
            if ok or not step.client_limited or len(result.steps) >= max_steps:
                break
        if ok and (result.passed is None or rate > result.passed.spec.rate):
            result.passed = step
        if not ok and (result.failed is None or rate < result.failed.spec.rate):
            result.failed = step
        return ok

    rate = start_rate
    while len(result.steps) < max_steps and attempt(rate):
        if rate >= max_rate:
            return result
        rate = min(max_rate, rate * 2)
    while len(result.steps) < max_steps and result.failed is not None:
        low = result.passed.spec.rate if result.passed else 0.0
        high = result.failed.spec.rate
        if ((high - low) / low <= precision) if low else (high <= start_rate * precision):
            break
        attempt(round((low + high) / 2, 1) if high - low > 2 else (low + high) / 2)
    return result
