"""The dynamic batcher: Triton's semantics, per model, over one or more runtime instances.

- A batch forms when an instance is free: queued images are taken in priority order (lower number first), FIFO
  within a level, while the batch stays within ``max_batch_size``. It is dispatched at once when a preferred size
  (or the maximum) is reached; otherwise when the oldest queued image has waited ``max_queue_delay_ms``.
- ``policy = "adaptive"`` (config ``batch_policy``) changes one thing: with an instance free, the batch waits for
  the next image only while the measured batch costs and arrival rate say waiting costs the queued images less than
  it saves the next one (:meth:`Batcher._dispatch_now`), and never past ``max_queue_delay_ms``.
- A request with more images than ``max_batch_size`` is split across batches and reassembled in order.
- The queue is bounded; a request that does not fit is refused at once (:class:`OverloadedError`).
- Every awaiting caller is resolved exactly once: its results, a deadline error, a rejection, or cancellation.
  Images of a request whose deadline passed or whose caller went away are dropped before compute.
- A failed batch is retried image by image, so one poison input fails alone. A device failure (CUDA out of
  memory) splits the batch in halves first; an instance that keeps failing is taken out of service and the
  ``on_device_lost`` hook may give replacements (the CPU fallback).
- A batch unanswered for ``stuck_after_s`` means its instance is wedged (a forward cannot be interrupted): the
  batch's images fail with :class:`InstanceStuckError`, the instance is abandoned, and ``on_instance_stuck`` gives
  its replacement; queued images wait for it (their deadlines still hold). ``unhealthy_after_failed_batches``
  batches in a row that fail every image make the model report itself unhealthy until a batch succeeds.

It is event driven: the dispatcher sleeps on an event until the queue holds enough images or the oldest image's
delay runs out (never a polling loop). It imports no HTTP code; a runtime's future is awaited, never blocked on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future

import msgspec
import numpy as np

from service.core.errors import (
    DeadlineExceededError,
    DeviceFailure,
    InstanceStuckError,
    OutOfMemoryError,
    OverloadedError,
    RuntimeFailure,
    VisionServeError,
)
from service.core.metrics import BatchRecord
from service.core.status import InferResult
from service.runtime.base import RuntimeLike

log = logging.getLogger(__name__)

DEFAULT_PRIORITY = 0
_SMOOTHING = 0.2  # weight of the newest sample in the adaptive policy's moving averages


class BatcherConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The batching settings of one model (a subset of its ``config.toml``)."""

    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    policy: str = "delay"  # "delay" (Triton's) or "adaptive": see Batcher._dispatch_now
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    default_timeout_ms: float = 0.0
    device_failures_before_removal: int = 3
    stuck_after_s: float = 0.0  # 0: a batch may take as long as it takes
    replace_timeout_s: float = 120.0  # the least time a stuck instance's replacement gets to load and warm up
    unhealthy_after_failed_batches: int = 3


class InferRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What crosses from the HTTP layer into the batcher: plain data, serialisable (see ``service.transport.wire``).

    ``images`` is uint8 ``[N, C, H, W]``; ``timeout_ms`` is relative (0 or None: the model's default);
    ``priority``: lower is served first, 0 is the default level.
    """

    request_id: str
    model: str
    images: np.ndarray
    version: int | None = None
    priority: int = DEFAULT_PRIORITY
    timeout_ms: float | None = None


Observer = Callable[[BatchRecord], None]
DeviceLost = Callable[[RuntimeLike, Exception], Awaitable[list[RuntimeLike]]]
StateChanged = Callable[[], None]


class _Pending:
    """One request in flight."""

    __slots__ = ("batch", "batch_sizes", "compute_s", "done", "errors", "future", "instance", "logits", "queue_s",
                 "received", "remaining", "timer")  # fmt: skip

    def __init__(self, future: asyncio.Future[InferResult], n: int, num_classes: int, received: float) -> None:
        self.future = future
        self.received = received  # time.monotonic() stamps: queued, an instance free, the batch dispatched
        self.instance = received
        self.batch = received
        self.logits = np.zeros((n, num_classes), dtype=np.float32)
        self.errors: list[VisionServeError | None] = [None] * n
        self.remaining = n
        self.done = False
        self.queue_s = 0.0
        self.compute_s = 0.0
        self.batch_sizes: list[int] = []
        self.timer: asyncio.TimerHandle | None = None

    def abandon_if_cancelled(self, future: asyncio.Future[InferResult]) -> None:
        """The caller went away: its queued images are dropped before compute."""
        if future.cancelled():
            self.done = True
            if self.timer is not None:
                self.timer.cancel()

    def finish(self, error: VisionServeError | None = None) -> None:
        """Resolve the caller exactly once (later calls do nothing)."""
        if self.done:
            return
        self.done = True
        if self.timer is not None:
            self.timer.cancel()
        if self.future.done():  # the caller went away
            return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(
                InferResult(self.logits, self.errors, self.queue_s, self.compute_s, self.batch_sizes,
                            self.received, self.instance, self.batch, time.monotonic())
            )  # fmt: skip


class _Item:
    __slots__ = ("delivered", "enqueued", "image", "index", "pending")

    def __init__(self, pending: _Pending, index: int, image: np.ndarray, enqueued: float) -> None:
        self.pending = pending
        self.index = index
        self.image = image
        self.enqueued = enqueued
        self.delivered = False


class Batcher:
    """Dynamic batching over ``instances`` (runtime instances of one model, possibly on several devices)."""

    def __init__(
        self,
        instances: Sequence[RuntimeLike],
        config: BatcherConfig | None = None,
        *,
        name: str = "model",
        observer: Observer | None = None,
        on_device_lost: DeviceLost | None = None,
        on_instance_stuck: DeviceLost | None = None,
        on_state_change: StateChanged | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a batcher needs at least one runtime instance")
        self.config = config or BatcherConfig()
        self.name = name
        self.spec = instances[0].spec
        self.observer = observer
        self.on_device_lost = on_device_lost
        self.on_instance_stuck = on_instance_stuck
        self.on_state_change = on_state_change
        self._instances: list[RuntimeLike] = list(instances)
        self._queues: dict[int, deque[_Item]] = {}
        self._count = 0
        self._delay_s = self.config.max_queue_delay_ms / 1000.0
        preferred = sorted(p for p in self.config.preferred_batch_sizes if p <= self.config.max_batch_size)
        self._preferred = preferred
        self._threshold = preferred[0] if preferred else self.config.max_batch_size
        self._closing = False
        self._inflight = 0
        self._failures: dict[int, int] = {}
        self._started = False
        self._stuck_after_s = self.config.stuck_after_s
        self.replacing = 0  # stuck instances whose replacements are loading
        self.stuck_total = 0
        self.failed_streak = 0  # batches in a row that failed every image
        self.last_failure: str | None = None
        self.batches = 0
        self.images = 0
        self.size_counts: dict[int, int] = {}
        self.size_compute_ns: dict[int, int] = {}
        self._adaptive = self.config.policy == "adaptive"
        self._costs: dict[int, float] = {}  # batch size -> recent seconds a batch takes (a moving average)
        self._gap_s: float | None = None  # recent seconds between requests (a moving average)
        self._last_arrival: float | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._free: asyncio.Queue[RuntimeLike] = asyncio.Queue()
        for instance in self._instances:
            self._free.put_nowait(instance)
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher = loop.create_task(self._dispatch(), name=f"batcher-{self.name}")
        self._started = True

    @property
    def queue_depth(self) -> int:
        return self._count

    @property
    def inflight_batches(self) -> int:
        return self._inflight

    @property
    def instances(self) -> list[RuntimeLike]:
        return list(self._instances)

    @property
    def healthy(self) -> bool:
        """False while the last ``unhealthy_after_failed_batches`` batches (or more) failed every image."""
        return self.failed_streak < self.config.unhealthy_after_failed_batches

    def _changed(self) -> None:
        if self.on_state_change is not None:
            try:
                self.on_state_change()
            except Exception:
                log.exception("%s: state-change hook failed", self.name)

    async def close(self, timeout_s: float = 30.0, *, close_runtimes: bool = True) -> None:
        """Stop intake, drain what is queued within ``timeout_s``, fail the rest, close the runtimes."""
        self._closing = True
        if self._started:
            self._wakeup.set()
            deadline = time.monotonic() + timeout_s
            while (self._count or self._inflight) and time.monotonic() < deadline:
                self._idle.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
            self._fail_queued(OverloadedError(f"model {self.name} shut down before this request was computed"))
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
            for task in list(self._tasks):
                task.cancel()
        if not close_runtimes:
            return
        for instance in self._instances:
            try:
                instance.close()
            except Exception:  # closing must go on for the others
                log.exception("closing a runtime instance of %s failed", self.name)

    # ---- intake ---------------------------------------------------------------------------------------------
    async def submit(self, request: InferRequest) -> InferResult:
        """Queue the request's images and wait for all of them; resolves exactly once."""
        return await self.enqueue(request)

    def enqueue(self, request: InferRequest) -> asyncio.Future[InferResult]:
        """Queue the request's images; the future resolves exactly once (cancelling it drops the request's images
        that are still queued). Raises at once when the request is refused. Call on the batcher's event loop."""
        if not self._started:
            self._start()
        if self._closing:
            raise OverloadedError(f"model {self.name} is shutting down")
        if not self._instances and not self.replacing:
            raise DeviceFailure(f"model {self.name} has no working device left")
        images = request.images
        n = int(images.shape[0])
        if self._count + n > self.config.max_queue_size:
            raise OverloadedError(
                f"model {self.name}: queue full ({self._count} of {self.config.max_queue_size} images queued)"
            )
        future: asyncio.Future[InferResult] = self._loop.create_future()
        now = time.monotonic()
        pending = _Pending(future, n, self.spec.num_classes, now)
        timeout_ms = request.timeout_ms or self.config.default_timeout_ms
        if timeout_ms and timeout_ms > 0:
            pending.timer = self._loop.call_later(
                timeout_ms / 1000.0,
                pending.finish,
                DeadlineExceededError(f"deadline of {timeout_ms:g} ms passed before the answer was ready"),
            )
        future.add_done_callback(pending.abandon_if_cancelled)
        queue = self._queues.get(request.priority)
        if queue is None:
            queue = self._queues[request.priority] = deque()
            self._queues = dict(sorted(self._queues.items()))
        before = self._count
        queue.extend(_Item(pending, i, images[i], now) for i in range(n))
        self._count += n
        if self._adaptive:
            if self._last_arrival is not None:
                gap = now - self._last_arrival
                self._gap_s = gap if self._gap_s is None else self._gap_s + _SMOOTHING * (gap - self._gap_s)
            self._last_arrival = now
            self._wakeup.set()  # every arrival may change whether the batch should wait
        elif before == 0 or self._count >= self._threshold:
            self._wakeup.set()
        return future

    # ---- forming batches ------------------------------------------------------------------------------------
    def _oldest(self) -> float:
        return min(q[0].enqueued for q in self._queues.values() if q)

    def _take(self, limit: int) -> list[_Item]:
        batch: list[_Item] = []
        for queue in self._queues.values():
            while queue and len(batch) < limit:
                item = queue.popleft()
                self._count -= 1
                if item.pending.done:  # deadline passed, rejected, or the caller went away
                    continue
                batch.append(item)
            if len(batch) >= limit:
                break
        return batch

    def _batch_limit(self) -> int:
        if self._count >= self.config.max_batch_size:
            return self.config.max_batch_size
        fitting = [p for p in self._preferred if p <= self._count]
        return fitting[-1] if fitting else self.config.max_batch_size

    async def _next_batch(self) -> list[_Item] | None:
        while True:
            if self._count == 0:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            full = self._count >= self.config.max_batch_size or (self._preferred and self._count >= self._threshold)
            wait_s = self._oldest() + self._delay_s - time.monotonic()
            if full or wait_s <= 0 or self._closing or (self._adaptive and self._dispatch_now(self._count)):
                batch = self._take(self._batch_limit())
                if batch:
                    return batch
                continue
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait_s)

    def _cost(self, n: int) -> float | None:
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

    def _dispatch_now(self, n: int) -> bool:
        """The adaptive policy, with an instance free and ``n`` images queued: dispatch now, or wait for the next?

        One step ahead, in total latency (BentoML's adaptive batching and Clipper weigh the same trade): waiting a
        gap ``g`` for one more image costs each queued image ``g + T(n+1) - T(n)`` and gives the newcomer
        ``T(n+1)``; dispatching now gives the newcomer what is left of ``T(n)`` when it arrives, then ``T(1)``.
        Where a batch costs about the same per image (a CPU), waiting never pays and this dispatches at once;
        where a batch costs little more than one image (a GPU) and images come fast, it waits. With no figures
        yet it dispatches; ``max_queue_delay_ms`` still bounds every wait."""
        gap = self._gap_s
        t_n, t_next, t_one = self._cost(n), self._cost(n + 1), self._cost(1)
        if gap is None or t_n is None or t_next is None or t_one is None:
            return True
        wait = n * (gap + t_next - t_n) + t_next
        now = max(0.0, t_n - gap) + t_one
        return now <= wait

    async def _dispatch(self) -> None:
        while True:
            instance = await self._free.get()
            free_since = time.monotonic()  # the stages tell waiting for an instance from waiting for a batch
            batch = await self._next_batch()
            if batch is None:  # closing and empty: wait in case a failed device's images are requeued
                self._free.put_nowait(instance)
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._inflight += 1
            task = self._loop.create_task(self._execute(instance, batch, free_since))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- running batches ------------------------------------------------------------------------------------
    async def _run(self, instance: RuntimeLike, items: list[_Item]) -> np.ndarray:
        # The runtime stacks the images into its own reused buffer on its worker thread: the copy (about 0.6 ms
        # for 32 images at 224x224) then overlaps the event loop's work instead of adding to it.
        running = instance.submit([item.image for item in items])
        if not self._stuck_after_s:
            return await asyncio.wrap_future(running)
        # One timer per batch, cancelled when the answer comes (asyncio.wait cost several times more per batch).
        loop = self._loop
        waiter: asyncio.Future[np.ndarray] = loop.create_future()
        timer = loop.call_later(self._stuck_after_s, self._declare_stuck, waiter, instance)
        running.add_done_callback(lambda done: loop.call_soon_threadsafe(_settle, waiter, done, timer))
        return await waiter

    def _declare_stuck(self, waiter: asyncio.Future[np.ndarray], instance: RuntimeLike) -> None:
        if not waiter.done():
            waiter.set_exception(
                InstanceStuckError(
                    f"model {self.name}: the runtime instance on {instance.device} gave no answer in "
                    f"{self._stuck_after_s:g} s (instance_stuck_after_s); it was abandoned and replaced"
                )
            )

    async def _execute(self, instance: RuntimeLike, items: list[_Item], free_since: float) -> None:
        started = time.monotonic()
        for item in items:
            item.pending.instance = free_since
            item.pending.batch = started
        healthy = True
        failed = 0
        try:
            try:
                logits = await self._run(instance, items)
                self._failures.pop(id(instance), None)
                compute_s = time.monotonic() - started
                for row, item in enumerate(items):
                    self._deliver(item, logits[row], None, compute_s, len(items), started)
            except Exception as exc:
                healthy, failed = await self._recover(instance, items, exc, started, items)
            compute_s = time.monotonic() - started
            self._track_health(failed == len(items))
            self.batches += 1
            self.images += len(items)
            self.size_counts[len(items)] = self.size_counts.get(len(items), 0) + 1
            self.size_compute_ns[len(items)] = self.size_compute_ns.get(len(items), 0) + int(compute_s * 1e9)
            if failed == 0:
                seen = self._costs.get(len(items))
                self._costs[len(items)] = compute_s if seen is None else seen + _SMOOTHING * (compute_s - seen)
            if self.observer is not None:
                self.observer(BatchRecord(len(items), [started - i.enqueued for i in items], compute_s,
                                          instance.device, failed))  # fmt: skip
        except asyncio.CancelledError:  # close() ran out of time while this batch was computing
            for item in items:
                item.pending.finish(OverloadedError(f"model {self.name} shut down while this request was computing"))
            raise
        except Exception as exc:  # a bug of ours must still resolve every caller
            log.exception("batch of %s failed unexpectedly", self.name)
            for item in items:
                item.pending.finish(RuntimeFailure(f"internal error while computing: {exc}"))
        finally:
            self._inflight -= 1
            if healthy:
                self._free.put_nowait(instance)
            if self._count == 0 and self._inflight == 0:
                self._idle.set()

    def _deliver(
        self,
        item: _Item,
        logits: np.ndarray | None,
        error: VisionServeError | None,
        compute_s: float,
        batch_size: int,
        started: float,
    ) -> None:
        item.delivered = True
        pending = item.pending
        if pending.done:
            return
        if error is None and logits is not None:
            pending.logits[item.index] = logits
        else:
            pending.errors[item.index] = error
        pending.queue_s = max(pending.queue_s, started - item.enqueued)
        pending.compute_s = max(pending.compute_s, compute_s)
        pending.batch_sizes.append(batch_size)
        pending.remaining -= 1
        if pending.remaining == 0:
            pending.finish()

    async def _recover(
        self, instance: RuntimeLike, items: list[_Item], exc: Exception, started: float, batch: list[_Item]
    ) -> tuple[bool, int]:
        """``items`` (part of ``batch``) failed: split on device failures, retry image by image, and take a device
        that keeps failing out of service (its undelivered images are requeued). Returns (healthy, images failed).
        """
        error = exc if isinstance(exc, VisionServeError) else RuntimeFailure(f"{type(exc).__name__}: {exc}")
        self.last_failure = str(error)
        if isinstance(error, InstanceStuckError):
            live = [item for item in batch if not item.delivered and not item.pending.done]
            now = time.monotonic()
            for item in live:
                self._deliver(item, None, error, now - started, len(batch), started)
            await self._replace_stuck(instance, error)
            return False, len(batch)  # the whole batch failed (items whose deadline passed first included)
        if isinstance(error, DeviceFailure):
            # Out of memory on a batch that can still be halved is the batch's size, not the device: only the
            # other device failures, and out of memory on a single image, count toward taking it out of service.
            if not (isinstance(error, OutOfMemoryError) and len(items) > 1):
                key = id(instance)
                self._failures[key] = self._failures.get(key, 0) + 1
                if self._failures[key] >= self.config.device_failures_before_removal:
                    await self._remove(instance, error, batch)
                    return False, 0
            if len(items) > 1:  # out of memory: halves are smaller; each half recovers on its own
                half = len(items) // 2
                failed = 0
                for part in (items[:half], items[half:]):
                    ok, n = await self._attempt(instance, part, started, batch)
                    failed += n
                    if not ok:
                        return False, failed
                return True, failed
        if len(items) == 1:
            self._deliver(items[0], None, error, time.monotonic() - started, 1, started)
            return True, 1
        failed = 0
        for item in items:  # one poison image fails alone
            ok, n = await self._attempt(instance, [item], started, batch)
            failed += n
            if not ok:
                return False, failed
        return True, failed

    async def _attempt(
        self, instance: RuntimeLike, items: list[_Item], started: float, batch: list[_Item]
    ) -> tuple[bool, int]:
        try:
            logits = await self._run(instance, items)
        except Exception as exc:
            return await self._recover(instance, items, exc, started, batch)
        self._failures.pop(id(instance), None)
        for row, item in enumerate(items):
            self._deliver(item, logits[row], None, time.monotonic() - started, len(items), started)
        return True, 0

    def _track_health(self, all_failed: bool) -> None:
        was = self.healthy
        self.failed_streak = self.failed_streak + 1 if all_failed else 0
        if self.healthy != was:
            if was:
                log.error("%s: %d batches in a row failed every image: reporting unhealthy (last: %s)",
                          self.name, self.failed_streak, self.last_failure)  # fmt: skip
            else:
                log.warning("%s: a batch succeeded: healthy again", self.name)
            self._changed()

    async def _replace_stuck(self, instance: RuntimeLike, error: InstanceStuckError) -> None:
        """Abandon a wedged instance and start its replacement; queued images wait for it (their deadlines
        hold), new ones are still accepted meanwhile, and the state says the model is not ready."""
        log.error("%s: %s", self.name, error)
        self.stuck_total += 1
        if instance in self._instances:
            self._instances.remove(instance)
        self.replacing += 1
        self._changed()
        try:
            instance.abandon()
        except Exception:
            log.exception("abandoning a stuck instance of %s", self.name)
        replacements: list[RuntimeLike] = []
        bound_s = max(self.config.replace_timeout_s, 2 * self._stuck_after_s)
        try:
            if self.on_instance_stuck is not None:
                replacements = await asyncio.wait_for(self.on_instance_stuck(instance, error), bound_s)
        except TimeoutError:  # the device itself may be wedged: the model fails rather than wait for ever
            log.error("%s: no replacement for a stuck instance within %.0f s", self.name, bound_s)
        except Exception:
            log.exception("%s: the replacement of a stuck instance could not start", self.name)
        finally:
            self.replacing -= 1
        for replacement in replacements:
            self._instances.append(replacement)
            self._free.put_nowait(replacement)
        if replacements:
            log.warning("%s: a replacement instance on %s is serving", self.name, replacements[0].device)
        elif not self._instances and not self.replacing:
            self._fail_queued(DeviceFailure(f"model {self.name} has no working instance left: {error}"))
        self._wakeup.set()
        self._changed()

    async def _remove(self, instance: RuntimeLike, error: Exception, items: list[_Item]) -> None:
        """Take ``instance`` out of service; requeue its images first in line (nothing accepted is dropped)."""
        log.error("%s: taking instance on %s out of service: %s", self.name, instance.device, error)
        if instance in self._instances:
            self._instances.remove(instance)
        replacements: list[RuntimeLike] = []
        if self.on_device_lost is not None:
            try:
                replacements = await self.on_device_lost(instance, error)
            except Exception:
                log.exception("%s: the fallback could not start", self.name)
        for replacement in replacements:
            self._instances.append(replacement)
            self._free.put_nowait(replacement)
        try:
            instance.close()
        except Exception:
            log.exception("closing a failed instance of %s", self.name)
        live = [item for item in items if not item.delivered and not item.pending.done]
        if self._instances:
            front = self._queues.setdefault(min(self._queues, default=DEFAULT_PRIORITY), deque())
            front.extendleft(reversed(live))
            self._count += len(live)
            self._wakeup.set()
            return
        failure = DeviceFailure(f"model {self.name} has no working device left: {error}")
        for item in live:
            item.pending.finish(failure)
        self._fail_queued(failure)

    def _fail_queued(self, error: VisionServeError) -> None:
        for queue in self._queues.values():
            while queue:
                queue.popleft().pending.finish(error)
        self._count = 0


def _settle(waiter: asyncio.Future[np.ndarray], done: Future[np.ndarray], timer: asyncio.TimerHandle) -> None:
    """A runtime's answer, on the loop: into ``waiter`` unless the instance was declared stuck meanwhile."""
    timer.cancel()
    if done.cancelled():
        if not waiter.done():
            waiter.cancel()
        return
    error = done.exception()
    if waiter.done():  # declared stuck; the late answer is dropped
        return
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(done.result())
