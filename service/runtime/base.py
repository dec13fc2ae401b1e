"""The runtime seam: ``spec``, ``run(batch) -> logits``, ``close()``, and a worker thread of its own.

A runtime instance loads, warms up and runs every forward on one dedicated thread: torch's CPU forward was
measured 1.3-2x slower when a model was loaded on one thread and run on another, and it keeps device state
(streams, CUDA graphs) on the thread that made it. Callers either block on :meth:`Runtime.run` or take the
:class:`concurrent.futures.Future` from :meth:`Runtime.submit` (the batcher wraps it for asyncio). A runtime
imports neither asyncio nor any HTTP code.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from service.core.errors import BadInputError, DeviceFailure, RuntimeFailure, VisionServeError
from service.core.spec import ModelSpec
from service.runtime.faults import FaultPlan

log = logging.getLogger(__name__)
T = TypeVar("T")
Batch = np.ndarray | Sequence[np.ndarray]  # a uint8 [N, C, H, W] array, or N uint8 [C, H, W] images to stack


class RuntimeLike(Protocol):
    """What the batcher needs of a runtime instance."""

    spec: ModelSpec
    device: str
    kind: str

    def run(self, batch: Batch) -> np.ndarray: ...
    def submit(self, batch: Batch) -> Future[np.ndarray]: ...
    def close(self) -> None: ...
    def abandon(self) -> None: ...
    def describe(self) -> dict[str, Any]: ...


class Runtime:
    """Base of every runtime. Subclasses implement ``_load``, ``_forward`` and optionally ``_release``."""

    kind = "base"
    faults: FaultPlan | None = None  # injected faults (a model's ``[faults]``), armed after warm-up

    def __init__(self, spec: ModelSpec, *, device: str = "cpu", name: str = "model") -> None:
        self.spec = spec
        self.device = device
        self.name = name
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.kind}-{name}-{device}")
        self._thread_id: int | None = None
        try:
            self._call(self._load_on_worker)
        except BaseException:  # a runtime that failed to load must not leave its worker thread behind
            self._closed = True
            self._executor.shutdown(wait=True)
            raise

    # ---- the seam -------------------------------------------------------------------------------------------
    def run(self, batch: Batch) -> np.ndarray:
        """Logits ``[N, num_classes]`` (float32) for a uint8 batch ``[N, C, H, W]``; blocks until done."""
        return self.submit(batch).result()

    def submit(self, batch: Batch) -> Future[np.ndarray]:
        """Queue ``batch`` on the worker thread; the future holds the logits or a :class:`VisionServeError`.

        A list of images is stacked on the worker thread into a buffer this instance reuses (it runs one batch at
        a time), so the copy costs no allocation and stays off the caller's thread.
        """
        if self._closed:
            raise RuntimeFailure(f"runtime for {self.name} on {self.device} is closed")
        if isinstance(batch, np.ndarray):
            self._check_batch(batch)
        else:
            self._check_images(batch)
        return self._executor.submit(self._run_on_worker, batch)

    def close(self) -> None:
        """Release the model and stop the worker thread (after any batch in progress)."""
        if self._closed:
            return
        self._closed = True
        if self.faults is not None:
            self.faults.release()
        try:
            self._executor.submit(self._release).result()
        finally:
            self._executor.shutdown(wait=True)

    abandoned = 0  # instances abandoned in this process (their threads may never return: see engine/process.py)

    def abandon(self) -> None:
        """Give up on an instance whose worker thread is stuck: refuse new batches and let the thread go without
        waiting for it (a forward cannot be interrupted; the thread and what it holds stay until it returns)."""
        if not self._closed:
            Runtime.abandoned += 1
        self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- helpers --------------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        return self._executor.submit(fn).result()

    def _load_on_worker(self) -> None:
        self._thread_id = threading.get_ident()
        try:
            self._load()
        except Exception as exc:
            # What a half-done load holds (a module, CUDA graphs, a session) goes before the error does: an instance
            # that ran out of device memory must not keep it from the next one.
            try:
                self._release()
            except Exception:
                log.exception("releasing what the failed load of %s on %s held", self.name, self.device)
            if isinstance(exc, VisionServeError):
                raise
            raise self._translate_load(exc) from exc  # translated at the seam, as a run's errors are

    def _staging(self, n: int) -> np.ndarray:
        """A reused uint8 buffer of at least ``n`` images (subclasses may stage straight into pinned memory)."""
        buffer = getattr(self, "_stage", None)
        if buffer is None or len(buffer) < n:
            s = self.spec.input
            buffer = self._stage = np.empty((n, s.channels, s.height, s.width), dtype=np.uint8)
        return buffer[:n]

    def _run_on_worker(self, batch: Batch) -> np.ndarray:
        if not isinstance(batch, np.ndarray):
            batch = np.stack(batch, out=self._staging(len(batch)))
        try:
            if self.faults is not None:
                self.faults.before_batch(len(batch))
            out = self._forward(batch)
        except VisionServeError:
            raise
        except Exception as exc:  # translated at the seam; the original stays attached for the logs
            raise self._translate(exc) from exc
        if out.ndim != 2 or out.shape[0] != batch.shape[0] or out.shape[1] != self.spec.num_classes:
            raise RuntimeFailure(
                f"{self.kind} runtime for {self.name} returned shape {tuple(out.shape)} "
                f"for a batch of {batch.shape[0]}: expected [{batch.shape[0]}, {self.spec.num_classes}]"
            )
        return out

    def _check_batch(self, batch: np.ndarray) -> None:
        s = self.spec.input
        expected = (s.channels, s.height, s.width)
        if batch.dtype != np.uint8 or batch.ndim != 4 or tuple(batch.shape[1:]) != expected or batch.shape[0] < 1:
            raise BadInputError(
                f"batch must be uint8 [N, {s.channels}, {s.height}, {s.width}] with N >= 1, "
                f"got {batch.dtype} {list(batch.shape)}"
            )

    def _check_images(self, images: Sequence[np.ndarray]) -> None:
        s = self.spec.input
        expected = (s.channels, s.height, s.width)
        if not images:
            raise BadInputError("a batch needs at least one image")
        for image in images:
            if image.dtype != np.uint8 or image.shape != expected:
                raise BadInputError(
                    f"images must be uint8 [{s.channels}, {s.height}, {s.width}], got {image.dtype} {list(image.shape)}"
                )

    def _translate(self, exc: Exception) -> VisionServeError:
        return RuntimeFailure(f"{self.kind} runtime failed on {self.device}: {type(exc).__name__}: {exc}")

    def _translate_load(self, exc: Exception) -> VisionServeError:
        """A load error that is not ours (graph capture and warm-up runs included). A device failure (a CUDA error,
        out of memory) stays one, told apart by the runtime's own :meth:`_translate`, so the engine can leave the
        device out and load on the CPU (``fallback = "cpu"``); anything else is a :class:`RuntimeFailure` naming
        what was loaded and where."""
        where = f"{self.kind} runtime could not load {self._artifact()} on {self.device}"
        error = self._translate(exc)
        if isinstance(error, DeviceFailure):
            return type(error)(f"{where}: {error}")
        return RuntimeFailure(f"{where}: {type(exc).__name__}: {exc}")

    def _artifact(self) -> str:
        """What this runtime loads, for messages (subclasses name their file)."""
        return f"model {self.name}"

    # ---- for subclasses -------------------------------------------------------------------------------------
    def _load(self) -> None:
        raise NotImplementedError

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _release(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"runtime": self.kind, "device": self.device}
