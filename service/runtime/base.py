"""The runtime seam: ``spec``, ``outputs``, ``run(batch) -> outputs``, ``close()``, and a worker thread of its own.

A model answers one or several named outputs (a classifier its logits; a detector boxes, scores and labels), each
with a dtype and a per-image shape the runtime learns at load (:attr:`Runtime.outputs`). :meth:`Runtime.submit_outputs`
answers them all, batch-first, by name: the engine's path. :meth:`Runtime.run` and :meth:`Runtime.submit` answer the
first one alone, for the callers that read a classifier's logits (export's parity gate, benchmarks, tune).

A runtime instance loads, warms up and runs every forward on one dedicated thread: torch's CPU forward was
measured 1.3-2x slower when a model was loaded on one thread and run on another, and it keeps device state
(streams, CUDA graphs) on the thread that made it. Callers either block on :meth:`Runtime.run` or take the
:class:`concurrent.futures.Future` from :meth:`Runtime.submit` (the batcher wraps it for asyncio). A runtime
imports neither asyncio nor any HTTP code.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np

from service.core.errors import BadInputError, DeviceFailure, RuntimeFailure, VisionServeError
from service.core.spec import ModelSpec
from service.core.status import OutputInfo, classification_outputs
from service.runtime.faults import FaultPlan

log = logging.getLogger(__name__)
T = TypeVar("T")
Batch = np.ndarray | Sequence[np.ndarray]  # a uint8 [N, C, H, W] array, or N uint8 [C, H, W] images to stack
Outputs = dict[str, np.ndarray]  # a batch's named outputs, batch-first, in the model's order
# What a subclass's ``_forward`` may give: one array (a one-output model), arrays in order, or arrays by name.
Forwarded = np.ndarray | Sequence[np.ndarray] | dict[str, np.ndarray]


class RuntimeLike(Protocol):
    """What the batcher needs of a runtime instance."""

    spec: ModelSpec
    device: str
    kind: str
    outputs: tuple[OutputInfo, ...]

    def run(self, batch: Batch) -> np.ndarray: ...
    def submit(self, batch: Batch) -> Future[np.ndarray]: ...
    def submit_outputs(self, batch: Batch) -> Future[Outputs]: ...
    def close(self) -> None: ...
    def abandon(self) -> None: ...


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
        # A classifier's one output unless the subclass's load learns others from the model.
        self.outputs: tuple[OutputInfo, ...] = classification_outputs(spec.num_classes)
        try:
            self._call(self._load_on_worker)
        except BaseException:  # a runtime that failed to load must not leave its worker thread behind
            self._closed = True
            self._executor.shutdown(wait=True)
            raise

    # ---- the seam -------------------------------------------------------------------------------------------
    def run(self, batch: Batch) -> np.ndarray:
        """The first output (a classifier's logits ``[N, num_classes]``, float32) for a uint8 batch
        ``[N, C, H, W]``; blocks until done."""
        return self.submit(batch).result()

    def submit(self, batch: Batch) -> Future[np.ndarray]:
        """Queue ``batch`` on the worker thread; the future holds the first output or a :class:`VisionServeError`."""
        self._check(batch)
        return self._executor.submit(self._first_on_worker, batch)

    def submit_outputs(self, batch: Batch) -> Future[Outputs]:
        """Queue ``batch`` on the worker thread; the future holds every output by name (batch-first, the dtypes and
        per-image shapes of :attr:`outputs`) or a :class:`VisionServeError`.

        A list of images is stacked on the worker thread into a buffer this instance reuses (it runs one batch at
        a time), so the copy costs no allocation and stays off the caller's thread.
        """
        self._check(batch)
        return self._executor.submit(self._outputs_on_worker, batch)

    def _check(self, batch: Batch) -> None:
        if self._closed:
            raise RuntimeFailure(f"runtime for {self.name} on {self.device} is closed")
        s = self.spec.input
        expected = (s.channels, s.height, s.width)
        if isinstance(batch, np.ndarray):
            if batch.dtype != np.uint8 or batch.ndim != 4 or batch.shape[1:] != expected or batch.shape[0] < 1:
                raise BadInputError(
                    f"batch must be uint8 [N, {s.channels}, {s.height}, {s.width}] with N >= 1, "
                    f"got {batch.dtype} {list(batch.shape)}"
                )
            return
        if not batch:
            raise BadInputError("a batch needs at least one image")
        for image in batch:
            if image.dtype != np.uint8 or image.shape != expected:
                raise BadInputError(
                    f"images must be uint8 [{s.channels}, {s.height}, {s.width}], got {image.dtype} {list(image.shape)}"
                )

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

    def _first_on_worker(self, batch: Batch) -> np.ndarray:
        return next(iter(self._outputs_on_worker(batch).values()))

    def _outputs_on_worker(self, batch: Batch) -> Outputs:
        return self._named(self._run_on_worker(batch), len(batch))

    def _run_on_worker(self, batch: Batch) -> Forwarded:
        if not isinstance(batch, np.ndarray):
            batch = np.stack(batch, out=self._staging(len(batch)))
        try:
            if self.faults is not None:
                self.faults.before_batch(len(batch))
            return self._forward(batch)
        except VisionServeError:
            raise
        except Exception as exc:  # translated at the seam; the original stays attached for the logs
            raise self._translate(exc) from exc

    def _named(self, out: Forwarded, n: int) -> Outputs:
        """``out`` by name in :attr:`outputs`' order, each checked against its info (``n`` rows, its per-image
        shape) and in its dtype (no copy where it already is)."""
        infos = self.outputs
        if isinstance(out, np.ndarray):
            arrays: list[Any] = [out]
        elif isinstance(out, dict):
            arrays = [out.get(info.name) for info in infos]
        else:
            arrays = list(out)
        named: Outputs = {}
        if len(arrays) == len(infos):
            for info, array in zip(infos, arrays, strict=True):
                if array is None or array.shape != (n, *info.shape):
                    break
                named[info.name] = array if array.dtype == info.dtype else array.astype(info.dtype)
        if len(named) == len(infos):
            return named
        got = ", ".join(f"{list(np.shape(a))}" for a in (out.values() if isinstance(out, dict) else arrays))
        expected = ", ".join(f"{i.name} [{', '.join(map(str, (n, *i.shape)))}]" for i in infos)
        raise RuntimeFailure(
            f"{self.kind} runtime for {self.name} returned shape {got} for a batch of {n}: expected {expected}"
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
        """What this runtime loads, for messages: its file (a subclass's ``path``), or the model's name."""
        return str(getattr(self, "path", f"model {self.name}"))

    # ---- for subclasses -------------------------------------------------------------------------------------
    def _load(self) -> None:
        raise NotImplementedError

    def _forward(self, batch: np.ndarray) -> Forwarded:
        """The model's outputs for ``batch``: one array, arrays in :attr:`outputs`' order, or arrays by name."""
        raise NotImplementedError

    def _release(self) -> None:
        return None
