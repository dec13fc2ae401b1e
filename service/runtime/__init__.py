"""Runtimes: one narrow interface (``spec``, ``run(batch)``, ``submit(batch)``, ``close()``) over onnxruntime and
TorchScript. A runtime knows nothing of HTTP or asyncio."""

from __future__ import annotations

from service.runtime.base import Runtime, RuntimeLike
from service.runtime.fake import FakeRuntime, FaultInjectingRuntime
from service.runtime.onnxrt import OnnxRuntime
from service.runtime.torchscript import TorchScriptRuntime, bucket_sizes, load_torchscript

__all__ = [
    "FakeRuntime",
    "FaultInjectingRuntime",
    "OnnxRuntime",
    "Runtime",
    "RuntimeLike",
    "TorchScriptRuntime",
    "bucket_sizes",
    "load_torchscript",
]
