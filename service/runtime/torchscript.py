"""The TorchScript runtime: ``torch.jit.load``, ``inference_mode``, channels-last input, and on CUDA everything
:mod:`service.runtime.torchbase` does (pinned buffers, CUDA graphs per bucket, fp16/bf16)."""

from __future__ import annotations

from typing import Any

from service.core.errors import ConfigError, DeviceFailure
from service.core.repository import load_torchscript
from service.runtime.torchbase import TorchRuntime, bucket_sizes

__all__ = ["TorchScriptRuntime", "bucket_sizes", "load_torchscript"]


class TorchScriptRuntime(TorchRuntime):
    """Runs ``model.pt`` (or ``model.fp16.pt``): uint8 NCHW in, float logits out."""

    kind = "torchscript"

    def _load_module(self) -> Any:
        try:
            module = load_torchscript(self.path, self.device)
        except Exception as exc:
            # Its weights are mapped onto the device here: out of memory or a CUDA error is the device's failure
            # (the engine falls back to the CPU), not a bad file.
            if isinstance(self._translate(exc), DeviceFailure):
                raise self._translate_load(exc) from exc
            raise ConfigError(f"torch cannot load TorchScript {self.path} on {self.device}: {exc}") from exc
        module.eval()
        return module.to(memory_format=self.torch.channels_last)

    def _autocast_dtype(self) -> Any:
        torch = self.torch
        if self.precision == "fp32":
            return None
        first = next((p for p in self.module.parameters() if p.is_floating_point()), None)
        wanted = torch.float16 if self.precision == "fp16" else torch.bfloat16
        if first is not None and first.dtype == wanted:
            return None  # an artifact exported in that precision (model.fp16.pt): run it as it is
        return wanted
