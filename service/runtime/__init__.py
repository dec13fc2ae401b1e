"""Runtimes: one narrow interface (``spec``, ``run(batch)``, ``submit(batch)``, ``close()``) over onnxruntime,
TorchScript and AOTInductor. A runtime knows nothing of HTTP or asyncio."""

from __future__ import annotations

from service.runtime.aoti import AotiRuntime
from service.runtime.base import Runtime, RuntimeLike
from service.runtime.factory import BACKENDS, PREFERENCE, artifact, choose_backend, make_runtime, warm_up
from service.runtime.fake import FakeRuntime, FaultInjectingRuntime
from service.runtime.faults import FaultPlan
from service.runtime.onnxrt import OnnxRuntime
from service.runtime.torchscript import TorchScriptRuntime, bucket_sizes, load_torchscript

__all__ = [
    "BACKENDS",
    "PREFERENCE",
    "AotiRuntime",
    "FakeRuntime",
    "FaultInjectingRuntime",
    "FaultPlan",
    "OnnxRuntime",
    "Runtime",
    "RuntimeLike",
    "TorchScriptRuntime",
    "artifact",
    "bucket_sizes",
    "choose_backend",
    "load_torchscript",
    "make_runtime",
    "warm_up",
]
