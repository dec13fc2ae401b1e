"""What the PyTorch runtimes (TorchScript, AOTInductor) share: on CUDA a pinned uint8 host buffer, one
non-blocking copy in on the instance's own stream, CUDA graphs per batch-size bucket, reduced precision, one copy
out; and the translation of torch's errors into :class:`DeviceFailure` / :class:`RuntimeFailure`, at load (graph
capture included: it runs the model) as at run time, so a GPU that runs out of memory while capturing is left out by
the engine and the model falls back to the CPU, as it would at run time.

Checked against torch 2.11-2.14 (``torch.cuda.graph``, ``torch.cuda.graph_pool_handle``, ``torch.autocast``):

- The worker thread sets its CUDA device first: the current device is per thread, and an instance on ``cuda:1``
  must not allocate its graph pool or its kernels' workspaces on ``cuda:0``.
- Warm-up before a capture runs on the side stream after it waited for the default stream (the static input is
  zeroed there), as the CUDA-graphs notes require; every bucket's graph shares one memory pool, captured from the
  largest bucket down. Sharing is safe because this instance replays one graph at a time on one stream and copies
  the output out before the next replay. Capture is thread-local, so other instances on the device keep working.
- A module whose weights are float32 runs fp16/bf16 under ``torch.autocast`` (cache off, which capture needs).
  Casting the weights of a traced model does not work: the trace baked ``x.to(torch.float32)`` into the graph, so
  half weights meet float activations in the first convolution. A module already in fp16 (``model.fp16.pt``) runs
  as it is.
- The pinned host buffer is reused batch after batch; that is safe only because every forward waits for its
  stream before returning (the next batch is stacked into it after that).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.core.errors import ConfigError, DeviceFailure, OutOfMemoryError, RuntimeFailure, VisionServeError
from service.core.spec import ModelSpec
from service.core.status import LOGITS_OUTPUT, OutputInfo
from service.runtime.base import Runtime

# Text of CUDA failures that torch raises as plain RuntimeError (from cuBLAS/cuDNN, or through TorchScript's
# interpreter, which re-raises a kernel's OutOfMemoryError as RuntimeError "... CUDA out of memory ...").
CUDA_ERROR_MARKERS = ("CUDA out of memory", "CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NVML")


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size``, and ``max_batch_size`` itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def translate_torch_error(exc: BaseException, kind: str, device: str) -> VisionServeError:
    """A torch exception as the project's error: device failures (out of memory, CUDA errors) apart."""
    import torch

    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8: CUDA errors get their own type
    is_oom = isinstance(exc, torch.cuda.OutOfMemoryError)
    is_device = accelerator_error is not None and isinstance(exc, accelerator_error)
    if is_oom or is_device or any(marker in str(exc) for marker in CUDA_ERROR_MARKERS):
        if is_oom or "out of memory" in str(exc):
            return OutOfMemoryError(f"{kind} out of memory on {device}: {type(exc).__name__}: {exc}")
        return DeviceFailure(f"{kind} device failure on {device}: {type(exc).__name__}: {exc}")
    return RuntimeFailure(f"{kind} failed on {device}: {type(exc).__name__}: {exc}")


def _flatten(out: Any) -> tuple[list[str], list[Any]]:
    """A module's return value as named tensors in order (floating ones as float32: reduced precision is how it
    ran, not what it answers)."""
    if isinstance(out, dict):
        names, tensors = [str(k) for k in out], list(out.values())
    elif isinstance(out, (list, tuple)):
        names, tensors = [f"output_{i}" for i in range(len(out))], list(out)
    else:
        names, tensors = [LOGITS_OUTPUT], [out]
    return names, [t.float() if t.is_floating_point() else t for t in tensors]


class TorchRuntime(Runtime):
    """Base of the torch runtimes; subclasses implement ``_load_module`` (and say whether input goes channels-last)."""

    kind = "torch"
    channels_last_input = True

    def __init__(
        self,
        spec: ModelSpec,
        path: str | Path,
        *,
        device: str = "cpu",
        name: str = "model",
        precision: str = "fp32",
        max_batch_size: int = 32,
        cuda_graphs: bool = True,
        threads: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.threads = threads
        self.precision = precision
        self.max_batch_size = max_batch_size
        self.use_cuda_graphs = cuda_graphs
        super().__init__(spec, device=device, name=name)

    # ---- for subclasses -------------------------------------------------------------------------------------
    def _load_module(self) -> Any:
        """The callable model on ``self.tdevice`` (uint8 NCHW in, logits out)."""
        raise NotImplementedError

    def _check_precision(self) -> None:
        """Refuse a precision this runtime cannot honour, before touching the device."""
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"precision must be fp32, fp16 or bf16, got {self.precision!r}")
        if self.precision != "fp32" and not self.cuda:
            raise ConfigError(f"precision {self.precision} needs a CUDA device, got {self.device}")

    def _autocast_dtype(self) -> Any:
        """The dtype to run under autocast, or None to run the module as it is."""
        return None

    # ---- loading --------------------------------------------------------------------------------------------
    def _load(self) -> None:
        import torch

        self.torch = torch
        if self.threads:
            # On the instance's own worker thread, where every forward runs: torch's intra-op thread count is
            # per calling thread (OpenMP's ICV), so each instance keeps its own and the process default is untouched.
            torch.set_num_threads(self.threads)
        self.tdevice = torch.device(self.device)
        self.cuda = self.tdevice.type == "cuda"
        self._check_precision()
        if self.cuda:
            if self.tdevice.index is None:  # "cuda": the thread's current device, made explicit for set_device
                self.tdevice = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.tdevice)
        self.module = self._load_module()
        self.amp_dtype = self._autocast_dtype()
        self.graphs: dict[int, tuple[Any, Any, Any]] = {}
        self.outputs = self._probe_outputs()
        if self.cuda:
            c, h, w = self.spec.input.channels, self.spec.input.height, self.spec.input.width
            self.stream = torch.cuda.Stream(self.tdevice)
            self.host_in = torch.empty((self.max_batch_size, c, h, w), dtype=torch.uint8).pin_memory()
            self.host_outs = [
                torch.empty((self.max_batch_size, *info.shape), dtype=getattr(torch, info.dtype)).pin_memory()
                for info in self.outputs
            ]
            self.host_np = self.host_in.numpy()
            if self.use_cuda_graphs:
                self.pool = torch.cuda.graph_pool_handle()
                for size in sorted(bucket_sizes(self.max_batch_size), reverse=True):
                    self._capture(size)

    def _model(self, x: Any) -> list[Any]:
        """The module's outputs in order (floating ones as float32), under autocast where the precision asks."""
        return _flatten(self._call_module(x))[1]

    def _call_module(self, x: Any) -> Any:
        if self.amp_dtype is None:
            return self.module(x)
        with self.torch.autocast(self.tdevice.type, dtype=self.amp_dtype, cache_enabled=False):
            return self.module(x)

    def _probe_outputs(self) -> tuple[OutputInfo, ...]:
        """The module's named outputs, from one zero image's forward: a tensor is a classifier's ``logits``, a
        tuple or list gives ``output_0``, ``output_1``..., a dict its keys."""
        with self.torch.inference_mode():
            names, tensors = _flatten(self._call_module(self._layout(self._device_input(1))))
        return tuple(
            OutputInfo(name, str(t.dtype).removeprefix("torch."), tuple(t.shape[1:]))
            for name, t in zip(names, tensors, strict=True)
        )

    def _device_input(self, n: int) -> Any:
        """A graph's static input: contiguous NCHW like the pinned host buffer, so the copy in is one memcpy. A
        channels-last static input made every copy go through a temporary and a transpose kernel outside the graph
        (``copy_`` across devices and memory formats); the transpose now runs inside the graph (:meth:`_layout`)."""
        torch = self.torch
        c, h, w = self.spec.input.channels, self.spec.input.height, self.spec.input.width
        return torch.zeros((n, c, h, w), dtype=torch.uint8, device=self.tdevice)

    def _layout(self, x: Any) -> Any:
        """``x`` in the memory format the module runs fastest in."""
        return x.contiguous(memory_format=self.torch.channels_last) if self.channels_last_input else x

    def _capture(self, size: int) -> None:
        torch = self.torch
        with torch.inference_mode():
            static_in = self._device_input(size)
            self.stream.wait_stream(torch.cuda.current_stream(self.tdevice))
            with torch.cuda.stream(self.stream):
                for _ in range(3):  # warm-up on the side stream before capture, as CUDA graphs require
                    self._model(self._layout(static_in))
            torch.cuda.current_stream(self.tdevice).wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another instance's thread (or the nvJPEG decoder) may allocate on this device while
            # this one captures; the default "global" mode would fail that thread's call.
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                static_outs = self._model(self._layout(static_in))
        self.graphs[size] = (graph, static_in, static_outs)

    def _bucket(self, n: int) -> int | None:
        return next((size for size in sorted(self.graphs) if size >= n), None)

    # ---- running --------------------------------------------------------------------------------------------
    def _staging(self, n: int) -> np.ndarray:
        if getattr(self, "cuda", False) and n <= self.max_batch_size:
            return self.host_np[:n]  # images are stacked straight into pinned memory: the one copy in
        return super()._staging(n)

    def _forward(self, batch: np.ndarray) -> list[np.ndarray]:
        torch = self.torch
        n = batch.shape[0]
        with torch.inference_mode():
            if not self.cuda:
                return [out.numpy() for out in self._model(self._layout(torch.from_numpy(batch)))]
            if n > self.max_batch_size:
                raise RuntimeFailure(f"batch of {n} is over this runtime's max_batch_size {self.max_batch_size}")
            host_in = self.host_in[:n]
            if batch.ctypes.data != self.host_np.ctypes.data:  # not already staged there by submit()
                self.host_np[:n] = batch  # pinned memory makes the copy below truly asynchronous
            with torch.cuda.stream(self.stream):
                bucket = self._bucket(n)
                if bucket is not None:
                    graph, static_in, static_outs = self.graphs[bucket]
                    static_in[:n].copy_(host_in, non_blocking=True)
                    graph.replay()
                    outs = [out[:n] for out in static_outs]
                else:
                    outs = self._model(self._layout(host_in.to(self.tdevice, non_blocking=True)))
                for host_out, out in zip(self.host_outs, outs, strict=True):
                    host_out[:n].copy_(out, non_blocking=True)
            # The pinned buffers are reused by the next batch: wait for the copies before handing them back.
            self.stream.synchronize()
            return [host_out[:n].numpy().copy() for host_out in self.host_outs]

    def _translate(self, exc: Exception) -> VisionServeError:
        return translate_torch_error(exc, self.kind, self.device)

    def _release(self) -> None:
        self.__dict__.get("graphs", {}).clear()
        self.__dict__.pop("module", None)
        if getattr(self, "cuda", False):
            self.torch.cuda.empty_cache()
