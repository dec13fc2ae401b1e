"""Runtimes for tests and the batcher's own benchmark: a fake that does no model work, and a wrapper that
injects faults into a real runtime (the CPU stand-in for a failing GPU).

The fake's logits for an image are its first ``num_classes`` pixel values, so a test can tell whose answer
reached whom.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from service.core.spec import ModelSpec
from service.runtime.base import Batch, Forwarded, Outputs, Runtime, RuntimeLike

Fault = Callable[[np.ndarray], Exception | None]


class FakeRuntime(Runtime):
    """No model: logits are pixel values. ``delay_s`` simulates compute; ``fault`` may raise per batch."""

    kind = "fake"

    def __init__(
        self,
        spec: ModelSpec,
        *,
        device: str = "cpu",
        name: str = "fake",
        delay_s: float = 0.0,
        fault: Fault | None = None,
    ) -> None:
        self.delay_s = delay_s
        self.fault = fault
        self.batch_sizes: list[int] = []
        super().__init__(spec, device=device, name=name)

    def _load(self) -> None:
        return None

    def _run_on_worker(self, batch: Batch) -> Forwarded:
        overridden = type(self)._forward is not FakeRuntime._forward
        slow = self.fault is not None or self.delay_s or self.faults is not None or overridden
        if isinstance(batch, np.ndarray) or slow:
            return super()._run_on_worker(batch)
        # No model, so no stacking copy either: this is the batcher's own ceiling, not memory bandwidth's.
        self.batch_sizes.append(len(batch))
        c = self.spec.num_classes
        return np.stack([image.reshape(-1)[:c] for image in batch]).astype(np.float32)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        self.batch_sizes.append(int(batch.shape[0]))
        if self.fault is not None:
            error = self.fault(batch)
            if error is not None:
                raise error
        if self.delay_s:
            time.sleep(self.delay_s)
        flat = batch.reshape(batch.shape[0], -1)
        return flat[:, : self.spec.num_classes].astype(np.float32)


class FaultInjectingRuntime:
    """Wraps a real runtime; ``fault(batch)`` may return an exception to raise instead of running the batch."""

    def __init__(self, inner: RuntimeLike, fault: Fault, *, device: str | None = None) -> None:
        self.inner = inner
        self.fault = fault
        self.spec = inner.spec
        self.device = device or inner.device
        self.kind = inner.kind
        self.outputs = inner.outputs

    def run(self, batch: Batch) -> np.ndarray:
        return self.submit(batch).result()

    def submit(self, batch: Batch) -> Future[np.ndarray]:
        failed = self._failed(batch)
        return self.inner.submit(batch) if failed is None else failed

    def submit_outputs(self, batch: Batch) -> Future[Outputs]:
        failed = self._failed(batch)
        return self.inner.submit_outputs(batch) if failed is None else failed

    def _failed(self, batch: Batch) -> Future[Any] | None:
        error = self.fault(batch if isinstance(batch, np.ndarray) else np.stack(batch))
        if error is None:
            return None
        failed: Future[Any] = Future()
        failed.set_exception(error)
        return failed

    def close(self) -> None:
        self.inner.close()

    def abandon(self) -> None:
        self.inner.abandon()
