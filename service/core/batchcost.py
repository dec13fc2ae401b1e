"""What a batch of each size costs, as a batch policy learns it while serving (:class:`CostModel`), and the knee of
those costs: the smallest batch whose cost per image is within :data:`KNEE_SLACK` of the cheapest size's. Pure
numbers, in the core so that the engine's adaptive policy, ``tune``'s prediction and ``loadtest``'s report compute
the knee the same way."""

from __future__ import annotations

import math
from collections.abc import Mapping

SMOOTHING = 0.2  # weight of the newest sample in the cost model's moving averages
KNEE_SLACK = 0.05  # a batch size is big enough once its cost per image is within this of the cheapest size's


class CostModel:
    """The adaptive policy's figures: recent seconds a batch takes by size, and recent seconds between requests.

    Both are moving averages (the newest sample weighs :data:`SMOOTHING`); ``costs`` and ``gap_s`` seed them.
    """

    def __init__(
        self, costs: Mapping[int, float] | None = None, gap_s: float | None = None, *, smoothing: float = SMOOTHING
    ) -> None:
        self._costs: dict[int, float] = dict(costs or {})
        self.gap_s = gap_s  # None until two requests have arrived (or seeded)
        self._smoothing = smoothing
        self._last_arrival: float | None = None
        self._knees: dict[tuple[int, float], int | None] = {}  # (limit, slack) -> knee, until the costs change

    @property
    def costs(self) -> dict[int, float]:
        """Batch size -> recent seconds a batch of that size takes (a copy)."""
        return dict(self._costs)

    def observe_arrival(self, t: float) -> None:
        """A request arrived at ``t`` (seconds, any monotonic clock): updates :attr:`gap_s` from the second on."""
        if self._last_arrival is not None:
            gap = t - self._last_arrival
            self.gap_s = gap if self.gap_s is None else self.gap_s + self._smoothing * (gap - self.gap_s)
        self._last_arrival = t

    def observe_batch(self, size: int, seconds: float) -> None:
        """A batch of ``size`` images took ``seconds``."""
        seen = self._costs.get(size)
        self._costs[size] = seconds if seen is None else seen + self._smoothing * (seconds - seen)
        self._knees.clear()

    def knee(self, limit: int, slack: float = KNEE_SLACK) -> int | None:
        """The smallest batch size up to ``limit`` whose cost per image (:meth:`cost`) is within ``slack`` of the
        cheapest size's. Past it a bigger batch buys at most ``slack`` more throughput and makes each of its images
        wait for all of it. None until two sizes have been measured: one size alone says nothing of how the cost
        grows (read as per image, it would keep every batch at that size, and never learn otherwise)."""
        if len(self._costs) < 2:
            return None
        if (limit, slack) not in self._knees:  # asked twice a batch (wait and size): computed once
            # measured costs are positive; a figure that is not (stale statistics, a clock step) says nothing
            per_image = [(n, c / n) for n in range(1, limit + 1) if (c := self.cost(n)) and math.isfinite(c) and c > 0]
            cheapest = min((p for _, p in per_image), default=None)
            knee = None if cheapest is None else next(n for n, p in per_image if p <= cheapest * (1 + slack))
            self._knees[limit, slack] = knee
        return self._knees[limit, slack]

    def cost(self, n: int) -> float | None:
        """Seconds a batch of ``n`` takes, from the recent batches: measured, or on the line through the nearest
        measured sizes (through the origin when only one size has been seen); None before any batch."""
        costs = self._costs
        if n in costs:
            return costs[n]
        if not costs:
            return None
        sizes = sorted(costs)
        if len(sizes) == 1:
            return costs[sizes[0]] * n / sizes[0]
        below = [k for k in sizes if k < n]
        above = [k for k in sizes if k > n]
        a, b = (below[-1], above[0]) if below and above else ((sizes[-2], sizes[-1]) if below else (sizes[0], sizes[1]))
        return max(0.0, costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a))
