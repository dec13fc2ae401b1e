"""What waits in a batcher: each request in flight (:class:`Pending`) and its images, queued by priority level
(:class:`ImageQueue`) until a batch takes them. Plain bookkeeping, no event loop of its own."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from service.core.errors import VisionServeError
from service.core.status import InferResult

DEFAULT_PRIORITY = 0


class Release:
    """How a request's sender learns that no batch reads its pixels any more (the shared-memory front end frees its
    region then, not before): called once, for a request cancelled, or answered with an error (a deadline) while a
    batch still read them. ``held``: the error's answer must say that a release follows; ``answered``: it was sent."""

    __slots__ = ("answered", "held", "send")

    def __init__(self, send: Callable[[str], None]) -> None:
        self.send = send
        self.held = False
        self.answered = False

    def __call__(self, why: str = "cancelled") -> None:
        if self.held and not self.answered:  # read no more before the error went out: that answer frees it alone
            self.held = False
            return
        self.send(why)

    def unanswered(self) -> None:
        """No answer will go out (cancelled after its computation ended): free the pixels now, or, held, once the
        batch still reading them is done."""
        self.answered = True
        if not self.held:
            self.send("cancelled")


class Pending:
    """One request in flight: its caller's future and the answers of its images so far."""

    __slots__ = ("batch", "batch_sizes", "compute_s", "done", "errors", "future", "inflight", "instance", "logits",
                 "on_released", "queue_s", "received", "remaining", "timer")  # fmt: skip

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
        self.inflight = 0  # batches computing (or retrying) any of its images: they read its pixels until done
        # called once when a cancelled (or failed early) request's pixels are read by no batch any more
        self.on_released: Release | None = None

    def abandon_if_cancelled(self, future: asyncio.Future[InferResult]) -> None:
        """The caller went away: its queued images are dropped before compute."""
        if future.cancelled():
            self.done = True
            if self.timer is not None:
                self.timer.cancel()
            self.release_if_unread()

    def release_if_unread(self) -> None:
        """Say once (``on_released``) that a cancelled request's pixels, or those of one failed while a batch read
        them, are no longer read: at once when none of its images is in a batch, else when the last such batch is
        done."""
        released = self.on_released
        if self.inflight == 0 and released is not None and (self.future.cancelled() or released.held):
            self.on_released = None
            released()

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
            if self.inflight > 0 and self.on_released is not None:  # a batch still reads its pixels: said later
                self.on_released.held = True
            self.future.set_exception(error)
        else:
            self.future.set_result(
                InferResult(self.logits, self.errors, self.queue_s, self.compute_s, self.batch_sizes,
                            self.received, self.instance, self.batch, time.monotonic())
            )  # fmt: skip


class QueuedImage:
    """One image of a request, from the queue to its answer."""

    __slots__ = ("delivered", "enqueued", "image", "index", "pending")

    def __init__(self, pending: Pending, index: int, image: np.ndarray, enqueued: float) -> None:
        self.pending = pending
        self.index = index
        self.image = image
        self.enqueued = enqueued
        self.delivered = False


def deliver(
    items: list[QueuedImage], logits: np.ndarray | None, error: VisionServeError | None, started: float, size: int
) -> None:
    """Answer ``items`` (of a batch of ``size`` dispatched at ``started``): a row of ``logits`` each, or ``error``;
    a request is resolved with its last image."""
    compute_s = time.monotonic() - started
    for row, item in enumerate(items):
        item.delivered = True
        pending = item.pending
        if pending.done:
            continue
        if logits is not None:
            pending.logits[item.index] = logits[row]
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
