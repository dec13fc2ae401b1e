"""When a batch goes, and how big it is: the batch policies, pure and synchronous (numbers in, a decision out: a test
drives one with plain numbers). ``"delay"`` is Triton's (:class:`DelayPolicy`); ``"adaptive"`` (:class:`AdaptivePolicy`,
README "The engine") judges both on the batch costs and arrival rate it observes: whether to wait for the next image
(:func:`dispatch_now`), and, with a backlog, a batch no bigger than the knee (:meth:`CostModel.knee`). Past the knee
a bigger batch buys almost no throughput and every image in it waits for the whole batch: on a CPU that was most of
the p99 near saturation (docs/performance.md, "Near saturation: where the time goes").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from service.core.batchcost import KNEE_SLACK, SMOOTHING, CostModel

# One in this many batches cut to the knee takes one image more: the size above the knee is measured again, so one
# slow batch there (a preempted forward) does not keep the knee low for ever (seen: one batch of 2 at 3.4x the cost
# per image held a CPU model's batches at 1, 10% of its capacity lost)
EXPLORE_EVERY = 16
__all__ = ["KNEE_SLACK", "SMOOTHING", "AdaptivePolicy", "BatchPolicy", "CostModel", "DelayPolicy", "make_policy"]


class BatchPolicy(Protocol):
    """What the batcher asks of a policy. Times are ``time.monotonic()`` seconds."""

    def observe_arrival(self, t: float) -> None:
        """A request arrived at ``t``."""

    def observe_batch(self, size: int, seconds: float) -> None:
        """A batch of ``size`` images computed in ``seconds`` with no image failing."""

    def wakes(self, before: int, after: int) -> bool:
        """Whether an arrival that took the queue from ``before`` to ``after`` images may change :meth:`wait_s`."""

    def wait_s(self, queued: int, oldest_wait_s: float) -> float:
        """With an instance free and ``queued`` images (the oldest queued ``oldest_wait_s`` ago): seconds to wait
        for more before dispatching; 0 means dispatch now."""

    def batch_size(self, queued: int) -> int:
        """How many of the ``queued`` images the batch dispatched now takes (at most)."""


def dispatch_now(n: int, gap: float, t_n: float, t_next: float, t_one: float) -> bool:
    """The adaptive test, with ``n`` images queued and an instance free: dispatch now, or wait for the next image?

    Any one unit of time: ``gap`` until the next image, ``t_n``, ``t_next`` and ``t_one`` what batches of ``n``,
    ``n + 1`` and 1 take. One step ahead, in total latency (BentoML's adaptive batching and Clipper weigh the same
    trade): waiting costs each queued image ``gap + t_next - t_n`` and gives the newcomer ``t_next``; dispatching
    now gives the newcomer what is left of ``t_n`` when it arrives, then ``t_one``. Where a batch costs about the
    same per image (a CPU), waiting never pays; where a batch costs little more than one image (a GPU) and images
    come fast, it does.
    """
    wait = n * (gap + t_next - t_n) + t_next
    now = max(0.0, t_n - gap) + t_one
    return now <= wait


@dataclass(kw_only=True, eq=False)
class DelayPolicy:
    """Triton's: dispatch when a preferred size (or the maximum) is queued, else once the oldest image has waited
    ``max_queue_delay_ms``; a batch takes the largest preferred size that fits, or up to the maximum."""

    max_batch_size: int
    max_queue_delay_ms: float
    preferred_batch_sizes: Sequence[int] = ()

    def __post_init__(self) -> None:
        self.delay_s = self.max_queue_delay_ms / 1000.0
        self.preferred = sorted(p for p in self.preferred_batch_sizes if p <= self.max_batch_size)
        self._threshold = self.preferred[0] if self.preferred else self.max_batch_size

    def observe_arrival(self, t: float) -> None:
        """Nothing to learn: the delay policy goes by counts and the clock."""

    def observe_batch(self, size: int, seconds: float) -> None:
        """Nothing to learn: the delay policy goes by counts and the clock."""

    def wakes(self, before: int, after: int) -> bool:
        """Only the first image (which starts the delay) and reaching a dispatching size change the decision."""
        return before == 0 or after >= self._threshold

    def full(self, queued: int) -> bool:
        """Whether ``queued`` images make a batch worth dispatching without waiting."""
        return queued >= self.max_batch_size or bool(self.preferred and queued >= self._threshold)

    def wait_s(self, queued: int, oldest_wait_s: float) -> float:
        """Seconds left of the oldest image's delay (0 once a dispatching size is queued)."""
        return 0.0 if self.full(queued) else max(0.0, self.delay_s - oldest_wait_s)

    def batch_size(self, queued: int) -> int:
        """The maximum when that many are queued, else the largest preferred size that fits, else the maximum."""
        if queued >= self.max_batch_size:
            return self.max_batch_size
        fitting = [p for p in self.preferred if p <= queued]
        return fitting[-1] if fitting else self.max_batch_size


@dataclass(kw_only=True, eq=False)
class AdaptivePolicy(DelayPolicy):
    """The delay policy, except that a batch stops waiting early when :func:`dispatch_now` says so, and takes at
    most the cost model's knee, judged on ``costs`` (learned from the batches and arrivals observed). With no
    figures yet it dispatches at once, as large a batch as the delay policy would."""

    costs: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._cut = 0  # batches cut to the knee so far

    def observe_arrival(self, t: float) -> None:
        """Learn the gap between requests."""
        self.costs.observe_arrival(t)

    def observe_batch(self, size: int, seconds: float) -> None:
        """Learn what a batch of ``size`` costs."""
        self.costs.observe_batch(size, seconds)

    def wakes(self, before: int, after: int) -> bool:
        """Every arrival may change whether the batch should wait."""
        return True

    def wait_s(self, queued: int, oldest_wait_s: float) -> float:
        """The delay policy's wait, cut to 0 when waiting for the next image does not pay, or when a batch at the
        knee is queued (a bigger one would buy almost nothing)."""
        wait = super().wait_s(queued, oldest_wait_s)
        if wait <= 0:
            return wait
        knee = self.costs.knee(self.max_batch_size)
        return 0.0 if (knee is not None and queued >= knee) or self.dispatch_now(queued) else wait

    def batch_size(self, queued: int) -> int:
        """The delay policy's batch, cut to the cost model's knee (:meth:`CostModel.knee`); one in
        :data:`EXPLORE_EVERY` of the batches cut takes one image more, to measure that size again."""
        size = super().batch_size(queued)
        knee = self.costs.knee(self.max_batch_size)
        if knee is None or min(size, queued) <= knee:
            return size
        self._cut += 1
        return knee + 1 if self._cut % EXPLORE_EVERY == 0 else knee

    def dispatch_now(self, queued: int) -> bool:
        """:func:`dispatch_now` on the cost model's figures; True while any figure is missing."""
        gap = self.costs.gap_s
        t_n, t_next, t_one = self.costs.cost(queued), self.costs.cost(queued + 1), self.costs.cost(1)
        if gap is None or t_n is None or t_next is None or t_one is None:
            return True
        return dispatch_now(queued, gap, t_n, t_next, t_one)


POLICIES: dict[str, type[DelayPolicy]] = {"delay": DelayPolicy, "adaptive": AdaptivePolicy}


def make_policy(
    name: str, *, max_batch_size: int, max_queue_delay_ms: float, preferred_batch_sizes: Sequence[int] = ()
) -> BatchPolicy:
    """The policy config ``batch_policy`` names: ``"delay"`` or ``"adaptive"``."""
    if name not in POLICIES:
        raise ValueError(f"batch policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return POLICIES[name](
        max_batch_size=max_batch_size,
        max_queue_delay_ms=max_queue_delay_ms,
        preferred_batch_sizes=preferred_batch_sizes,
    )
