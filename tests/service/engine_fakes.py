"""Stand-ins for the engine's parts that need a model on a device: a version whose batcher the test steps by hand
(queue, take into a batch, end the batch) over the real :class:`~service.engine.pending.Pending` and
:class:`~service.engine.pending.Release`, and a loader of such versions. With them, residency, rollouts and the
release of a request's region run in process, against the real model table, in milliseconds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from service.core.config import Faults, ModelConfig, RolloutConfig
from service.core.errors import VisionServeError
from service.core.repository import ModelEntry
from service.core.status import InferResult, classification_outputs
from service.engine.batcher import InferRequest
from service.engine.pending import Pending, Release
from service.engine.table import ModelTable
from service.transport.messages import Snapshot

CLASSES = 2
MB = 1_000_000


class FakeBatcher:
    """Queues whole requests; :meth:`take` puts every queued one in a batch, :meth:`end` answers that batch."""

    def __init__(self) -> None:
        self.queued: list[Pending] = []
        self.batch: list[Pending] = []
        self.requests: list[InferRequest] = []
        self.inflight_batches = 0

    @property
    def queue_depth(self) -> int:
        return sum(p.remaining for p in self.queued if not p.done)

    def enqueue(self, request: InferRequest, on_released: Release | None = None) -> asyncio.Future[InferResult]:
        future: asyncio.Future[InferResult] = asyncio.get_running_loop().create_future()
        pending = Pending(future, len(request.images), classification_outputs(CLASSES), time.monotonic())
        pending.on_released = on_released
        future.add_done_callback(pending.abandon_if_cancelled)
        self.queued.append(pending)
        self.requests.append(request)
        return future

    def take(self) -> None:
        """A batch takes every queued request: from now on it reads their pixels."""
        self.batch = [p for p in self.queued if not p.done]
        self.queued = []
        for pending in self.batch:
            pending.inflight += 1
        self.inflight_batches += 1

    def end(self, error: VisionServeError | None = None) -> None:
        """The batch is done: its requests answered (``error``: failed), their pixels read no more."""
        for pending in self.batch:
            if not pending.done:
                pending.remaining = 0
                pending.finish(error)
            pending.inflight -= 1
            pending.release_if_unread()
        self.batch = []
        self.inflight_batches -= 1


class FakeEngine:
    """One loaded version: its spec (what a rollout compares), its batcher, and whether it was closed."""

    def __init__(self, model: str, number: int) -> None:
        self.batcher = FakeBatcher()
        self.version = SimpleNamespace(model=model, version=number)
        self.spec = SimpleNamespace(
            name=model,
            task="classify",
            output_layout=None,
            input=(3, 8, 8),
            resize_size=8,
            interpolation="bilinear",
            labels=["a", "b"],
        )
        self.closed = False

    async def close(self, timeout_s: float = 30.0) -> None:
        self.closed = True


def entry(
    tmp: Path,
    name: str,
    *,
    versions: tuple[int, ...] = (1,),
    on_demand: bool = True,
    size_mb: int = 10,
    rollout: RolloutConfig | None = None,
) -> ModelEntry:
    """A model's repository entry; its size on the budget is ``size_mb`` (the drill's, so no file is measured)."""
    config = ModelConfig(
        residency="on_demand" if on_demand else "pinned",
        faults=Faults(resident_bytes=size_mb * MB, noop=True),  # no artifact to choose between: the size is the drill's
        rollout=rollout or RolloutConfig(),
    )
    folder = tmp / name
    folder.mkdir(parents=True, exist_ok=True)
    return ModelEntry(name, folder, config, {n: SimpleNamespace(version=n, files={}) for n in versions})  # type: ignore[misc]


class FakeLoader:
    """Loads an entry's versions as :class:`FakeEngine`\\ s into ``table``, once ``gate`` opens (a load the test
    holds open), counting its calls."""

    def __init__(self, table: ModelTable) -> None:
        self.table = table
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, entry: ModelEntry) -> None:
        self.calls.append(entry.name)
        await self.gate.wait()
        self.table.put(entry, {n: FakeEngine(entry.name, n) for n in entry.versions})
        self.table.changed()

    async def engine(self, entry: ModelEntry, number: int) -> Any:
        """The loader of one version (a rollout's candidate)."""
        self.calls.append(f"{entry.name}/{number}")
        return FakeEngine(entry.name, number)


class Endpoint:
    """The engine's side of the transport: what was sent, and how many times the catalog was announced."""

    name = "engine"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, Any]] = []
        self.announced = 0
        self.snapshots: dict[bytes, Snapshot] = {}

    def send(self, peer: bytes, message: Any) -> None:
        self.sent.append((peer, message))

    def announce(self) -> None:
        self.announced += 1

    def live_peer(self, peer: bytes) -> bool:
        return True

    async def flush(self, timeout_s: float = 0.5) -> None:
        return None


def images(n: int = 1) -> np.ndarray:
    return np.zeros((n, 3, 8, 8), dtype=np.uint8)


async def settle() -> None:
    """Let the event loop run what is ready (done callbacks, a task's next step)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def until(check: Callable[[], bool], timeout_s: float = 2.0) -> None:
    """Wait for ``check`` (a load measures memory in a worker thread: more than a step of the loop)."""
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.001)
