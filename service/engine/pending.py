"""What waits in a batcher: each request in flight (:class:`Pending`) and its images, queued by priority level
(:class:`ImageQueue`) until a batch takes them. Plain bookkeeping, no event loop of its own."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable

import msgspec
import numpy as np

from service.core.errors import VisionServeError
from service.core.status import InferResult, OutputInfo

DEFAULT_PRIORITY = 0


class Release:
    """When a request's shared-memory region is free again, decided here for every path (plain, on-demand, rollout)
    and every end (answered, cancelled, expired, held). The front end frees the region on the request's answer, so
    that answer must not free it while a batch still reads the pixels; where no answer frees it, ``send`` does
    (a ``Failed(cancelled)``), once and only once nothing reads them any more. Three events decide:

    - :meth:`reading`: the batcher resolved the request (an error, or its caller went away) while a batch still
      reads its pixels; :meth:`unread`: the last such batch is done.
    - :meth:`answered`: the answer goes out. A result, or an error while no batch reads the pixels, frees the region
      itself; an error while one does says ``held``, and the release follows once it is read.
    - :meth:`cancelled`: no answer goes out (the caller went away): released once nothing reads the pixels, at once
      where nothing does (never queued, queued on the engine's own copy, or its batch already done).
    """

    __slots__ = ("_owed", "_reading", "_send", "_settled")

    def __init__(self, send: Callable[[str], None]) -> None:
        self._send = send
        self._reading = False
        self._owed = False  # nothing else frees the region: a release is sent once no batch reads it
        self._settled = False  # answered or cancelled: the first end decides

    def reading(self) -> None:
        """The request is resolved while a batch still reads its pixels."""
        self._reading = True

    def unread(self) -> None:
        """No batch reads the pixels any more."""
        self._reading = False
        if self._owed:
            self._owed = False
            self._send("cancelled")

    def answered(self, *, error: bool) -> bool:
        """The request's answer (``error``: a failure) goes out now: whether it must say ``held`` (a release
        follows it)."""
        if self._settled:
            return False
        self._settled = True
        held = error and self._reading
        self._owed = held
        return held

    def cancelled(self) -> None:
        """No answer will go out: release the region once nothing reads it (now, where nothing does)."""
        if self._settled:
            return
        self._settled = True
        self._owed = True
        if not self._reading:
            self.unread()


class Pending:
    """One request in flight: its caller's future and the answers of its images so far (one array per named output
    of the model, ``n`` rows each, zero until answered)."""

    __slots__ = ("batch", "batch_sizes", "compute_s", "done", "errors", "future", "inflight", "instance",
                 "on_released", "outputs", "queue_s", "received", "remaining", "timer")  # fmt: skip

    def __init__(
        self, future: asyncio.Future[InferResult], n: int, outputs: tuple[OutputInfo, ...], received: float
    ) -> None:
        self.future = future
        self.received = received  # time.monotonic() stamps: queued, an instance free, the batch dispatched
        self.instance = received
        self.batch = received
        self.outputs = {info.name: info.empty(n) for info in outputs}
        self.errors: list[VisionServeError | None] = [None] * n
        self.remaining = n
        self.done = False
        self.queue_s = 0.0
        self.compute_s = 0.0
        self.batch_sizes: list[int] = []
        self.timer: asyncio.TimerHandle | None = None
        self.inflight = 0  # batches computing (or retrying) any of its images: they read its pixels until done
        # told when the request is resolved while a batch reads its pixels, and when no batch reads them any more
        self.on_released: Release | None = None

    def abandon_if_cancelled(self, future: asyncio.Future[InferResult]) -> None:
        """The caller went away: its queued images are dropped before compute."""
        if future.cancelled():
            self.done = True
            if self.timer is not None:
                self.timer.cancel()
            self._resolved_while_read()

    def release_if_unread(self) -> None:
        """A batch that read its pixels is done: when it was the last one and the request is resolved, tell
        ``on_released`` (which decides whether a release is owed)."""
        released = self.on_released
        if self.inflight == 0 and released is not None and self.done:
            self.on_released = None
            released.unread()

    def _resolved_while_read(self) -> None:
        if self.inflight > 0 and self.on_released is not None:
            self.on_released.reading()

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
            self._resolved_while_read()  # a deadline while its batch computes: the answer says held
            self.future.set_exception(error)
        else:
            self.future.set_result(
                InferResult(self.outputs, self.errors, self.queue_s, self.compute_s, self.batch_sizes,
                            self.received, self.instance, self.batch, time.monotonic())
            )  # fmt: skip


class QueuedImage(msgspec.Struct):
    """One image of a request, from the queue to its answer."""

    pending: Pending
    index: int
    image: np.ndarray
    enqueued: float
    delivered: bool = False


def deliver(
    items: list[QueuedImage],
    outputs: dict[str, np.ndarray] | None,
    error: VisionServeError | None,
    started: float,
    size: int,
) -> None:
    """Answer ``items`` (of a batch of ``size`` dispatched at ``started``): a row of each of ``outputs`` each (one
    copy per output), or ``error``; a request is resolved with its last image."""
    compute_s = time.monotonic() - started
    answered = list(outputs.items()) if outputs is not None else None
    for row, item in enumerate(items):
        item.delivered = True
        pending = item.pending
        if pending.done:
            continue
        if answered is not None:
            into = pending.outputs
            for name, array in answered:
                into[name][item.index] = array[row]
        else:
            pending.errors[item.index] = error
        pending.queue_s = max(pending.queue_s, started - item.enqueued)
        pending.compute_s = max(pending.compute_s, compute_s)
        pending.batch_sizes.append(size)
        pending.remaining -= 1
        if pending.remaining == 0:
            pending.finish()


class ImageQueue:
    """Queued images by priority level (lower first), FIFO within a level."""

    def __init__(self) -> None:
        self._levels: dict[int, deque[QueuedImage]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def put(self, priority: int, items: Iterable[QueuedImage]) -> None:
        """Queue ``items`` at the back of their level."""
        level = self._levels.get(priority)
        if level is None:
            level = self._levels[priority] = deque()
            self._levels = dict(sorted(self._levels.items()))
        before = len(level)
        level.extend(items)
        self._count += len(level) - before

    def requeue(self, items: list[QueuedImage]) -> None:
        """Put ``items`` back first in line, in their order (at the front of the first level)."""
        front = self._levels.setdefault(min(self._levels, default=DEFAULT_PRIORITY), deque())
        front.extendleft(reversed(items))
        self._count += len(items)

    def oldest(self) -> float:
        """When the longest-waiting image was queued (the queue must not be empty)."""
        return min(level[0].enqueued for level in self._levels.values() if level)

    def take(self, limit: int) -> list[QueuedImage]:
        """Up to ``limit`` images in order, dropping those whose request is already resolved (deadline passed,
        rejected, or the caller went away)."""
        batch: list[QueuedImage] = []
        for level in self._levels.values():
            while level and len(batch) < limit:
                item = level.popleft()
                self._count -= 1
                if item.pending.done:
                    continue
                batch.append(item)
            if len(batch) >= limit:
                break
        return batch

    def fail_all(self, error: VisionServeError) -> None:
        """Empty the queue, resolving every request in it with ``error``."""
        for level in self._levels.values():
            while level:
                level.popleft().pending.finish(error)
        self._count = 0
