"""The runtime instances behind one batcher: which are free, running a batch on one, and what a failure costs it
(README, "The engine" and "Reliability"): a failing batch is retried image by image, out of memory halves it
first, a device that keeps failing goes out of service (``on_device_lost`` may give replacements), a batch
unanswered for ``stuck_after_s`` has its instance abandoned and replaced (``on_instance_stuck``), and batches that
fail every image make the model unhealthy.

The pool knows images and rows, not requests: it tells the batcher which rows got an answer through a callback,
and leaves requeueing or failing the queue to it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future

import msgspec
import numpy as np

from service.core.errors import DeviceFailure, InstanceStuckError, OutOfMemoryError, RuntimeFailure, VisionServeError
from service.runtime.base import Outputs, RuntimeLike

log = logging.getLogger(__name__)

DeviceLost = Callable[[RuntimeLike, Exception], Awaitable[list[RuntimeLike]]]
StateChanged = Callable[[], None]
# rows of the batch answered: their outputs by name (one row each) or the error they all failed with
Deliver = Callable[[list[int], Outputs | None, VisionServeError | None], None]


class PoolConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The instance settings of one model (from its ``BatcherConfig``)."""

    device_failures_before_removal: int = 3
    stuck_after_s: float = 0.0  # 0: a batch may take as long as it takes
    replace_timeout_s: float = 120.0  # the least time a stuck instance's replacement gets to load and warm up
    unhealthy_after_failed_batches: int = 3


class Outcome(msgspec.Struct, kw_only=True):
    """How a batch went for its instance: rows failed, and whether the instance was lost (then not free again)."""

    failed: int = 0
    removed: DeviceFailure | None = None  # taken out of service; the batch's unanswered rows are the batcher's
    stuck: InstanceStuckError | None = None  # wedged; the batcher fails the batch, then calls replace_stuck

    @property
    def healthy(self) -> bool:
        return self.removed is None and self.stuck is None


class InstancePool:
    """Runtime instances of one model: free ones wait in a queue; failures are counted per instance."""

    def __init__(
        self,
        instances: Sequence[RuntimeLike],
        config: PoolConfig,
        *,
        name: str,
        on_device_lost: DeviceLost | None = None,
        on_instance_stuck: DeviceLost | None = None,
        on_state_change: StateChanged | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.on_device_lost = on_device_lost
        self.on_instance_stuck = on_instance_stuck
        self.on_state_change = on_state_change
        self.instances: list[RuntimeLike] = list(instances)
        self._failures: dict[int, int] = {}
        self.replacing = 0  # stuck instances whose replacements are loading
        self.stuck_total = 0
        self.failed_streak = 0  # batches in a row that failed every image
        self.last_failure: str | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Put every instance in the free queue (on ``loop``, the batcher's)."""
        self._loop = loop
        self.free: asyncio.Queue[RuntimeLike] = asyncio.Queue()  # a batch takes one, and puts it back unless lost
        for instance in self.instances:
            self.free.put_nowait(instance)

    @property
    def serving(self) -> bool:
        """Whether any instance works or is being replaced."""
        return bool(self.instances) or self.replacing > 0

    @property
    def healthy(self) -> bool:
        """False while the last ``unhealthy_after_failed_batches`` batches (or more) failed every image."""
        return self.failed_streak < self.config.unhealthy_after_failed_batches

    def changed(self) -> None:
        """Tell ``on_state_change`` (a failing hook is logged, never raised into a batch)."""
        if self.on_state_change is not None:
            try:
                self.on_state_change()
            except Exception:
                log.exception("%s: state-change hook failed", self.name)

    def close(self) -> None:
        """Close every instance."""
        for instance in self.instances:
            try:
                instance.close()
            except Exception:  # closing must go on for the others
                log.exception("closing a runtime instance of %s failed", self.name)

    # ---- running a batch --------------------------------------------------------------------------------------
    async def compute(self, instance: RuntimeLike, images: list[np.ndarray], deliver: Deliver) -> Outcome:
        """Run ``images`` on ``instance`` and answer every row through ``deliver``, recovering from failures
        (halves on out of memory, then image by image), except when the instance is lost: see :class:`Outcome`."""
        outcome = Outcome()
        await self._attempt(instance, images, list(range(len(images))), deliver, outcome)
        return outcome

    async def run(self, instance: RuntimeLike, images: list[np.ndarray]) -> Outputs:
        """One forward on ``instance``; raises :class:`InstanceStuckError` after ``stuck_after_s``, if set."""
        # The runtime stacks the images into its own reused buffer on its worker thread: the copy (about 0.6 ms
        # for 32 images at 224x224) then overlaps the event loop's work instead of adding to it.
        running = instance.submit_outputs(images)
        if not self.config.stuck_after_s:
            return await asyncio.wrap_future(running)
        # One timer per batch, cancelled when the answer comes (asyncio.wait cost several times more per batch).
        loop = self._loop
        waiter: asyncio.Future[Outputs] = loop.create_future()
        timer = loop.call_later(self.config.stuck_after_s, self._declare_stuck, waiter, instance)
        running.add_done_callback(lambda done: loop.call_soon_threadsafe(_settle, waiter, done, timer))
        return await waiter

    def _declare_stuck(self, waiter: asyncio.Future[Outputs], instance: RuntimeLike) -> None:
        if not waiter.done():
            waiter.set_exception(
                InstanceStuckError(
                    f"model {self.name}: the runtime instance on {instance.device} gave no answer in "
                    f"{self.config.stuck_after_s:g} s (instance_stuck_after_s); it was abandoned and replaced"
                )
            )

    async def _attempt(
        self, instance: RuntimeLike, images: list[np.ndarray], rows: list[int], deliver: Deliver, outcome: Outcome
    ) -> bool:
        """Run ``rows`` of the batch; False once the instance is lost (the rest of the batch is not tried)."""
        try:
            outputs = await self.run(instance, [images[row] for row in rows])
        except Exception as exc:
            return await self._recover(instance, images, rows, exc, deliver, outcome)
        self._failures.pop(id(instance), None)
        deliver(rows, outputs, None)
        return True

    async def _recover(
        self,
        instance: RuntimeLike,
        images: list[np.ndarray],
        rows: list[int],
        exc: Exception,
        deliver: Deliver,
        outcome: Outcome,
    ) -> bool:
        """``rows`` failed with ``exc``: split on device failures, retry image by image, and take a device that
        keeps failing out of service."""
        error = exc if isinstance(exc, VisionServeError) else RuntimeFailure(f"{type(exc).__name__}: {exc}")
        self.last_failure = str(error)
        if isinstance(error, InstanceStuckError):
            outcome.stuck = error
            outcome.failed = len(images)  # the whole batch fails (rows whose deadline passed first included)
            return False
        if isinstance(error, DeviceFailure):
            # Out of memory on a batch that can still be halved is the batch's size, not the device: only the
            # other device failures, and out of memory on a single image, count toward taking it out of service.
            if not (isinstance(error, OutOfMemoryError) and len(rows) > 1):
                key = id(instance)
                self._failures[key] = self._failures.get(key, 0) + 1
                if self._failures[key] >= self.config.device_failures_before_removal:
                    await self.remove(instance, error)
                    outcome.removed = error  # its unanswered rows are requeued or failed by the batcher
                    return False
            if len(rows) > 1:  # out of memory: halves are smaller; each half recovers on its own
                half = len(rows) // 2
                for part in (rows[:half], rows[half:]):
                    if not await self._attempt(instance, images, part, deliver, outcome):
                        return False
                return True
        if len(rows) == 1:
            deliver(rows, None, error)
            outcome.failed += 1
            return True
        for row in rows:  # one poison image fails alone
            if not await self._attempt(instance, images, [row], deliver, outcome):
                return False
        return True

    def track_health(self, all_failed: bool) -> None:
        """Count a batch that failed every image (or reset the count); tell ``on_state_change`` of a change."""
        was = self.healthy
        self.failed_streak = self.failed_streak + 1 if all_failed else 0
        if self.healthy != was:
            if was:
                log.error("%s: %d batches in a row failed every image: reporting unhealthy (last: %s)",
                          self.name, self.failed_streak, self.last_failure)  # fmt: skip
            else:
                log.warning("%s: a batch succeeded: healthy again", self.name)
            self.changed()

    # ---- losing an instance -----------------------------------------------------------------------------------
    async def replace_stuck(self, instance: RuntimeLike, error: InstanceStuckError) -> None:
        """Abandon a wedged instance and start its replacement (bounded by ``replace_timeout_s``); meanwhile
        :attr:`replacing` counts it, so the model reports not ready but still accepts requests."""
        log.error("%s: %s", self.name, error)
        self.stuck_total += 1
        if instance in self.instances:
            self.instances.remove(instance)
        self.replacing += 1
        self.changed()
        try:
            instance.abandon()
        except Exception:
            log.exception("abandoning a stuck instance of %s", self.name)
        replacements: list[RuntimeLike] = []
        bound_s = max(self.config.replace_timeout_s, 2 * self.config.stuck_after_s)
        try:
            if self.on_instance_stuck is not None:
                replacements = await asyncio.wait_for(self.on_instance_stuck(instance, error), bound_s)
        except TimeoutError:  # the device itself may be wedged: the model fails rather than wait for ever
            log.error("%s: no replacement for a stuck instance within %.0f s", self.name, bound_s)
        except Exception:
            log.exception("%s: the replacement of a stuck instance could not start", self.name)
        finally:
            self.replacing -= 1
        self._add(replacements)
        if replacements:
            log.warning("%s: a replacement instance on %s is serving", self.name, replacements[0].device)

    async def remove(self, instance: RuntimeLike, error: Exception) -> None:
        """Take ``instance`` out of service, with what ``on_device_lost`` gives in its place, and close it."""
        log.error("%s: taking instance on %s out of service: %s", self.name, instance.device, error)
        if instance in self.instances:
            self.instances.remove(instance)
        replacements: list[RuntimeLike] = []
        if self.on_device_lost is not None:
            try:
                replacements = await self.on_device_lost(instance, error)
            except Exception:
                log.exception("%s: the fallback could not start", self.name)
        self._add(replacements)
        self.changed()  # out of service (the model degraded, maybe served by a fallback)
        try:
            instance.close()
        except Exception:
            log.exception("closing a failed instance of %s", self.name)

    def _add(self, replacements: list[RuntimeLike]) -> None:
        for replacement in replacements:
            self.instances.append(replacement)
            self.free.put_nowait(replacement)


def _settle(waiter: asyncio.Future[Outputs], done: Future[Outputs], timer: asyncio.TimerHandle) -> None:
    """A runtime's answer, on the loop: into ``waiter`` unless the instance was declared stuck meanwhile."""
    timer.cancel()
    if waiter.done():  # declared stuck; the late answer is dropped
        return
    if done.cancelled():
        waiter.cancel()
    elif (error := done.exception()) is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(done.result())
