"""The dynamic batcher of one model over one or more runtime instances, with Triton's semantics (README, "The
engine"): priority levels, FIFO within one, requests split across batches and reassembled, a bounded queue that
refuses at once, deadlines and cancellation. When a batch goes and how many images it takes is the batch policy's
call (``service.engine.policy``).

Every awaiting caller is resolved exactly once, and images of a request already resolved are dropped before
compute. Running a batch, retrying and replacing instances are the instance pool's (``service.engine.instances``);
when an instance is lost, its batch's unanswered images are requeued first in line or failed (stuck).
Event driven: the dispatcher sleeps on an event, never in a polling loop; a runtime's future is awaited, never
blocked on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from service.core.errors import DeadlineExceededError, DeviceFailure, OverloadedError, RuntimeFailure, VisionServeError
from service.core.metrics import BatchRecord
from service.core.status import InferResult
from service.engine.instances import DeviceLost, InstancePool, Outcome, PoolConfig, StateChanged
from service.engine.pending import DEFAULT_PRIORITY, ImageQueue, Pending, QueuedImage, Release, deliver
from service.engine.policy import BatchPolicy, make_policy
from service.runtime.base import Outputs, RuntimeLike

__all__ = ["Batcher", "BatcherConfig", "DeviceLost", "InferRequest", "InferResult", "Observer", "StateChanged"]

log = logging.getLogger(__name__)


class BatcherConfig(PoolConfig, frozen=True, kw_only=True):
    """The batching settings of one model (a subset of its ``config.toml``), the instance pool's among them."""

    max_batch_size: int = 32
    max_queue_delay_ms: float = 2.0
    policy: str = "delay"  # "delay" (Triton's) or "adaptive": see service.engine.policy
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024
    default_timeout_ms: float = 0.0

    def make_policy(self) -> BatchPolicy:
        """The batch policy these settings name."""
        return make_policy(self.policy, max_batch_size=self.max_batch_size,
                           max_queue_delay_ms=self.max_queue_delay_ms,
                           preferred_batch_sizes=self.preferred_batch_sizes)  # fmt: skip


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


class Batcher:
    """Dynamic batching over ``instances`` (runtime instances of one model, possibly on several devices).

    ``policy`` decides when a batch goes and how big it is; by default the one ``config.policy`` names.
    """

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
        policy: BatchPolicy | None = None,
    ) -> None:
        if not instances:
            raise ValueError("a batcher needs at least one runtime instance")
        self.config = config or BatcherConfig()
        self.name = name
        self.spec = instances[0].spec
        self.outputs = instances[0].outputs  # every instance of a model answers the same named outputs
        self.observer = observer
        self.policy = policy if policy is not None else self.config.make_policy()
        self._pool = InstancePool(instances, self.config, name=name, on_device_lost=on_device_lost,
                                  on_instance_stuck=on_instance_stuck, on_state_change=on_state_change)  # fmt: skip
        self._queue = ImageQueue()
        self._closing = False
        self._inflight = 0
        self._started = False
        self.batches = 0
        self.images = 0
        self.size_counts: dict[int, int] = {}
        self.size_compute_ns: dict[int, int] = {}

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._pool.start(loop)
        self._tasks: set[asyncio.Task[None]] = set()
        self._dispatcher = loop.create_task(self._dispatch(), name=f"batcher-{self.name}")
        self._started = True

    @property
    def queue_depth(self) -> int:
        """Images queued, not yet in a batch."""
        return len(self._queue)

    @property
    def inflight_batches(self) -> int:
        """Batches computing now."""
        return self._inflight

    @property
    def instances(self) -> list[RuntimeLike]:
        """The instances in service (a copy)."""
        return list(self._pool.instances)

    @property
    def replacing(self) -> int:
        """Stuck instances whose replacements are loading."""
        return self._pool.replacing

    @property
    def stuck_total(self) -> int:
        """Instances declared stuck so far."""
        return self._pool.stuck_total

    @property
    def failed_streak(self) -> int:
        """Batches in a row that failed every image."""
        return self._pool.failed_streak

    @property
    def last_failure(self) -> str | None:
        """The last error a batch met, if any."""
        return self._pool.last_failure

    @property
    def healthy(self) -> bool:
        """False while the last ``unhealthy_after_failed_batches`` batches (or more) failed every image."""
        return self._pool.healthy

    async def close(self, timeout_s: float = 30.0, *, close_runtimes: bool = True) -> None:
        """Stop intake, drain what is queued within ``timeout_s``, fail the rest, close the runtimes."""
        self._closing = True
        if self._started:
            self._wakeup.set()
            deadline = time.monotonic() + timeout_s
            while (self._queue or self._inflight) and time.monotonic() < deadline:
                self._idle.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._idle.wait(), max(0.0, deadline - time.monotonic()))
            self._queue.fail_all(OverloadedError(f"model {self.name} shut down before this request was computed"))
            self._dispatcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._dispatcher
            for task in list(self._tasks):
                task.cancel()
        if close_runtimes:
            self._pool.close()

    # ---- intake ---------------------------------------------------------------------------------------------
    async def submit(self, request: InferRequest) -> InferResult:
        """Queue the request's images and wait for all of them; resolves exactly once."""
        return await self.enqueue(request)

    def enqueue(self, request: InferRequest, on_released: Release | None = None) -> asyncio.Future[InferResult]:
        """Queue the request's images; the future resolves exactly once (cancelling it drops the request's images
        that are still queued). ``on_released`` is called once no batch reads them any more, at once or when the
        batches that took some are done, for a request cancelled or failed (a deadline) while a batch read them.
        Raises at once when the request is refused. Call on the batcher's event loop."""
        if not self._started:
            self._start()
        if self._closing:
            raise OverloadedError(f"model {self.name} is shutting down")
        if not self._pool.serving:
            raise DeviceFailure(f"model {self.name} has no working device left")
        images = request.images
        n = int(images.shape[0])
        queued = len(self._queue)
        if queued + n > self.config.max_queue_size:
            raise OverloadedError(
                f"model {self.name}: queue full ({queued} of {self.config.max_queue_size} images queued)"
            )
        future: asyncio.Future[InferResult] = self._loop.create_future()
        now = time.monotonic()
        pending = Pending(future, n, self.outputs, now)
        pending.on_released = on_released
        timeout_ms = request.timeout_ms or self.config.default_timeout_ms
        if timeout_ms and timeout_ms > 0:
            pending.timer = self._loop.call_later(
                timeout_ms / 1000.0,
                pending.finish,
                DeadlineExceededError(f"deadline of {timeout_ms:g} ms passed before the answer was ready"),
            )
        future.add_done_callback(pending.abandon_if_cancelled)
        self._queue.put(request.priority, (QueuedImage(pending, i, images[i], now) for i in range(n)))
        self.policy.observe_arrival(now)
        if self.policy.wakes(queued, queued + n):
            self._wakeup.set()
        return future

    # ---- forming batches ------------------------------------------------------------------------------------
    async def _next_batch(self) -> list[QueuedImage] | None:
        while True:
            queued = len(self._queue)
            if queued == 0:
                if self._closing:
                    return None
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            wait_s = self.policy.wait_s(queued, time.monotonic() - self._queue.oldest())
            if wait_s <= 0 or self._closing:
                batch = self._queue.take(self.policy.batch_size(queued))
                if batch:
                    return batch
                continue
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), wait_s)

    async def _dispatch(self) -> None:
        while True:
            instance = await self._pool.free.get()
            free_since = time.monotonic()  # the stages tell waiting for an instance from waiting for a batch
            batch = await self._next_batch()
            if batch is None:  # closing and empty: wait in case a failed device's images are requeued
                self._pool.free.put_nowait(instance)
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._inflight += 1
            for item in batch:  # read from here on: a deadline or cancel before the batch runs must not free them
                item.pending.inflight += 1
            task = self._loop.create_task(self._execute(instance, batch, free_since))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    # ---- running batches ------------------------------------------------------------------------------------
    async def _execute(self, instance: RuntimeLike, items: list[QueuedImage], free_since: float) -> None:
        started = time.monotonic()
        for item in items:
            item.pending.instance = free_since
            item.pending.batch = started
        outcome = Outcome()
        try:

            def answer(rows: list[int], outputs: Outputs | None, error: VisionServeError | None) -> None:
                part = items if len(rows) == len(items) else [items[row] for row in rows]
                deliver(part, outputs, error, started, len(rows))

            outcome = await self._pool.compute(instance, [item.image for item in items], answer)
            if not outcome.healthy:
                await self._after_loss(instance, items, outcome, started)
            compute_s = time.monotonic() - started
            self._pool.track_health(outcome.failed == len(items))
            self.batches += 1
            self.images += len(items)
            self.size_counts[len(items)] = self.size_counts.get(len(items), 0) + 1
            self.size_compute_ns[len(items)] = self.size_compute_ns.get(len(items), 0) + int(compute_s * 1e9)
            if outcome.failed == 0:
                self.policy.observe_batch(len(items), compute_s)
            if self.observer is not None:
                self.observer(BatchRecord(len(items), [started - i.enqueued for i in items], compute_s,
                                          instance.device, outcome.failed))  # fmt: skip
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
            for item in items:  # this batch reads their pixels no more (a retry image by image included)
                item.pending.inflight -= 1
                item.pending.release_if_unread()
            if outcome.healthy:
                self._pool.free.put_nowait(instance)
            if not self._queue and self._inflight == 0:
                self._idle.set()

    async def _after_loss(
        self, instance: RuntimeLike, items: list[QueuedImage], outcome: Outcome, started: float
    ) -> None:
        """The batch's instance was lost: fail (stuck) or requeue first in line (taken out of service) its images
        still unanswered, and fail the queue when no instance is left or coming."""
        live = [item for item in items if not item.delivered and not item.pending.done]
        if outcome.stuck is not None:
            deliver(live, None, outcome.stuck, started, len(items))
            await self._pool.replace_stuck(instance, outcome.stuck)
            if not self._pool.serving:
                self._queue.fail_all(DeviceFailure(f"model {self.name} has no working instance left: {outcome.stuck}"))
            self._wakeup.set()
            self._pool.changed()
        elif outcome.removed is not None:
            if self._pool.instances:
                self._queue.requeue(live)
                self._wakeup.set()
                return
            failure = DeviceFailure(f"model {self.name} has no working device left: {outcome.removed}")
            for item in live:
                item.pending.finish(failure)
            self._queue.fail_all(failure)
