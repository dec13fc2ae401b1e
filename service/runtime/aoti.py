"""The AOTInductor runtime: a ``torch.export`` program compiled ahead of time by Inductor into a ``.pt2``
package (``model.pt2`` for the CPU, ``model.cuda.pt2`` / ``model.fp16.cuda.pt2`` for CUDA), loaded with
``torch._inductor.aoti_load_package``. It needs no Python model code and no TorchScript, which torch 2.14 marks
deprecated; it is the path PyTorch is going forward with for serving.

A package is compiled for one device type: the CPU one cannot load on CUDA ("Incorrect device passed to
aoti_runner_cpu", seen with torch 2.14.1), so the runtime is handed the file for its device. Its precision is the
one it was compiled in (no autocast over compiled kernels); bf16 has no package and is refused.
"""

from __future__ import annotations

import warnings
from typing import Any

from service.core.errors import ConfigError
from service.runtime.torchbase import TorchRuntime


class AotiRuntime(TorchRuntime):
    """Runs an AOTInductor package: uint8 NCHW in, float logits out, batch dimension dynamic."""

    kind = "aoti"
    # The kernels were compiled for the contiguous NCHW input of the export (Inductor picks its own internal
    # layouts); a channels-last input would be read with the wrong strides.
    channels_last_input = False

    def _check_precision(self) -> None:
        if self.precision == "bf16":
            raise ConfigError(
                f"precision bf16 has no AOTInductor package (export writes fp32 and, with --fp16 on a GPU, fp16): "
                f"use precision fp32 or fp16, or backend torchscript for bf16 ({self.path})"
            )
        super()._check_precision()

    def _load_module(self) -> Any:
        torch = self.torch
        index = self.tdevice.index if self.cuda else -1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # One worker thread per instance calls it, so the runner's own locking is not needed.
                return torch._inductor.aoti_load_package(str(self.path), run_single_threaded=True, device_index=index)
        except Exception as exc:
            raise ConfigError(
                f"torch {torch.__version__} cannot load the AOTInductor package {self.path} on {self.device}: {exc} "
                "(a package loads only on the device type and torch version it was compiled for: re-export it)"
            ) from exc
