"""The TorchScript runtime: ``torch.jit.load``, ``inference_mode``, channels-last, and on CUDA a pinned uint8
host buffer, one non-blocking copy in, CUDA graphs per batch-size bucket and fp16/bf16 when configured."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np

from service.errors import ConfigError, DeviceFailure, RuntimeFailure, VisionServeError
from service.runtime.base import Runtime
from service.spec import ModelSpec


def bucket_sizes(max_batch_size: int) -> list[int]:
    """Powers of two up to ``max_batch_size``, and ``max_batch_size`` itself."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def load_torchscript(path: str | Path, device: str = "cpu") -> Any:
    """``torch.jit.load`` without its deprecation warning (TorchScript is the serving format we ship)."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path), map_location=device)


class TorchScriptRuntime(Runtime):
    """Runs ``model.pt`` (uint8 NCHW in, float logits out) with torch."""

    kind = "torchscript"

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
    ) -> None:
        self.path = Path(path)
        self.precision = precision
        self.max_batch_size = max_batch_size
        self.use_cuda_graphs = cuda_graphs
        super().__init__(spec, device=device, name=name)

    def _load(self) -> None:
        import torch

        self.torch = torch
        self.tdevice = torch.device(self.device)
        try:
            module = load_torchscript(self.path, self.device)
        except Exception as exc:
            raise ConfigError(f"torch cannot load TorchScript {self.path}: {exc}") from exc
        module.eval()
        self.cuda = self.tdevice.type == "cuda"
        if self.precision != "fp32":
            if not self.cuda:
                raise ConfigError(f"precision {self.precision} needs a CUDA device, got {self.device}")
            module = module.to(torch.float16 if self.precision == "fp16" else torch.bfloat16)
        self.module = module.to(memory_format=torch.channels_last)
        self.graphs: dict[int, tuple[Any, Any, Any]] = {}
        if self.cuda:
            c, h, w = self.spec.input.channels, self.spec.input.height, self.spec.input.width
            self.stream = torch.cuda.Stream(self.tdevice)
            self.host_in = torch.empty((self.max_batch_size, c, h, w), dtype=torch.uint8).pin_memory()
            self.host_out = torch.empty((self.max_batch_size, self.spec.num_classes), dtype=torch.float32).pin_memory()
            self.host_np = self.host_in.numpy()
            if self.use_cuda_graphs:
                for size in bucket_sizes(self.max_batch_size):
                    self._capture(size)

    def _capture(self, size: int) -> None:
        torch = self.torch
        c, h, w = self.spec.input.channels, self.spec.input.height, self.spec.input.width
        static_in = torch.zeros((size, c, h, w), dtype=torch.uint8, device=self.tdevice)
        static_in = static_in.contiguous(memory_format=torch.channels_last)
        with torch.inference_mode(), torch.cuda.stream(self.stream):
            for _ in range(3):  # warm-up on the side stream before capture, as CUDA graphs require
                self.module(static_in)
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                static_out = self.module(static_in).float()
        self.graphs[size] = (graph, static_in, static_out)

    def _bucket(self, n: int) -> int | None:
        for size in sorted(self.graphs):
            if size >= n:
                return size
        return None

    def _staging(self, n: int) -> np.ndarray:
        if getattr(self, "cuda", False) and n <= self.max_batch_size:
            return self.host_np[:n]  # images are stacked straight into pinned memory: the one copy in
        return super()._staging(n)

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        torch = self.torch
        n = batch.shape[0]
        with torch.inference_mode():
            if not self.cuda:
                x = torch.from_numpy(batch).contiguous(memory_format=torch.channels_last)
                return self.module(x).float().numpy()
            if n > self.max_batch_size:
                raise RuntimeFailure(f"batch of {n} is over this runtime's max_batch_size {self.max_batch_size}")
            host_in = self.host_in[:n]
            if batch.ctypes.data != self.host_np.ctypes.data:  # not already staged there by submit()
                self.host_np[:n] = batch  # pinned memory makes the copy below truly asynchronous
            with torch.cuda.stream(self.stream):
                bucket = self._bucket(n)
                if bucket is not None:
                    graph, static_in, static_out = self.graphs[bucket]
                    static_in[:n].copy_(host_in, non_blocking=True)
                    graph.replay()
                    out = static_out[:n]
                else:
                    x = host_in.to(self.tdevice, non_blocking=True).contiguous(memory_format=torch.channels_last)
                    out = self.module(x).float()
                self.host_out[:n].copy_(out, non_blocking=True)
            self.stream.synchronize()
            return self.host_out[:n].numpy().copy()

    def warm_up(self) -> None:
        """Run every bucket once (CPU: lets oneDNN build its kernels for each shape)."""
        c, h, w = self.spec.input.channels, self.spec.input.height, self.spec.input.width
        for size in bucket_sizes(self.max_batch_size):
            self.run(np.zeros((size, c, h, w), dtype=np.uint8))

    def _translate(self, exc: Exception) -> VisionServeError:
        torch = self.torch
        if isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA" in str(exc):
            return DeviceFailure(f"torch device failure on {self.device}: {exc}")
        return RuntimeFailure(f"torchscript failed on {self.device}: {type(exc).__name__}: {exc}")

    def _release(self) -> None:
        self.graphs.clear()
        self.__dict__.pop("module", None)
        if getattr(self, "cuda", False):
            self.torch.cuda.empty_cache()
