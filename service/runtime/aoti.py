"""The AOTInductor runtime: a ``torch.export`` program compiled ahead of time by Inductor into a ``.pt2``
package (``model.pt2`` for the CPU, ``model.cuda.pt2`` / ``model.fp16.cuda.pt2`` for CUDA), loaded with
``torch._inductor.aoti_load_package``. It needs no Python model code and no TorchScript, which torch 2.14 marks
deprecated; it is the path PyTorch is going forward with for serving.

A package is compiled for one device type: the CPU one cannot load on CUDA ("Incorrect device passed to
aoti_runner_cpu", seen with torch 2.14.1), so the runtime is handed the file for its device. Its precision is the
one it was compiled in (no autocast over compiled kernels); bf16 has no package and is refused.

Its errors on CUDA need more than torch's translation. The compiled model's C entry points catch every C++
exception, print it to stderr and return an error code (``CONVERT_EXCEPTION_TO_ERROR_CODE`` in Inductor's
``aoti_runtime/interface.cpp``); the runner (``torch/csrc/inductor/aoti_runner/model_container_runner.cpp``) turns
that code into a plain ``RuntimeError`` whose text is only ``run_func_( container_handle_, ...) API call failed at
.../model_container_runner.cpp, line N``. A CUDA error, out of memory included, thus reaches Python with no type
and no CUDA text. So on CUDA such an error is followed by a probe of the device (``torch.cuda.synchronize``): a
sticky CUDA error (an illegal memory access, a lost device) raises there, and is a :class:`DeviceFailure`; a device
that answers is taken as out of memory (:class:`OutOfMemoryError`), so the batcher splits the batch instead of
retrying image by image, and a single image that still fails counts against the device. Where the text does name
the CUDA error (a later torch may pass it on), torch's own translation decides and no probe is needed.
"""

from __future__ import annotations

import warnings
from typing import Any

from service.core.errors import ConfigError, DeviceFailure, OutOfMemoryError, VisionServeError
from service.runtime.torchbase import TorchRuntime, translate_torch_error

# The text of the runner's RuntimeError when the compiled model returned an error code (its real error went to stderr).
AOTI_UNTYPED_FAILURE = "API call failed"


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
            if self._device_error_at_load(exc):
                raise self._translate_load(exc) from exc
            raise ConfigError(
                f"torch {torch.__version__} cannot load the AOTInductor package {self.path} on {self.device}: {exc} "
                "(a package loads only on the device type and torch version it was compiled for: re-export it)"
            ) from exc

    def _device_error_at_load(self, exc: Exception) -> bool:
        """Whether a failure of ``aoti_load_package`` is the device's: a CUDA error or out of memory by its type or
        text, or on CUDA the runner's untyped failure (creating the model container, which allocates the weights on
        the device, failed: the probe in :meth:`_translate` tells a failing device from memory). Anything else (a
        package for another device type or torch version) is the package's, a :class:`ConfigError`."""
        if isinstance(translate_torch_error(exc, self.kind, self.device), DeviceFailure):
            return True
        return self.cuda and type(exc) is RuntimeError and AOTI_UNTYPED_FAILURE in str(exc)

    def _translate(self, exc: Exception) -> VisionServeError:
        error = translate_torch_error(exc, self.kind, self.device)
        if isinstance(error, DeviceFailure) or type(exc) is not RuntimeError or not getattr(self, "cuda", False):
            return error  # typed, or not a plain RuntimeError, or on the CPU (where no device can be at fault)
        # A plain RuntimeError with no CUDA text, on CUDA: AOTInductor's untyped failure (see the module docstring).
        try:
            self._probe_device()
        except Exception as probe:
            return DeviceFailure(
                f"{self.kind} device failure on {self.device}: AOTInductor failed without an error type "
                f"({type(exc).__name__}: {exc}), and the device then failed: {type(probe).__name__}: {probe}"
            )
        return OutOfMemoryError(
            f"{self.kind} failed on {self.device} and AOTInductor gave no error type ({type(exc).__name__}: {exc}); "
            "the device answered, so it is taken as out of memory and the batch is split (its message went to stderr)"
        )

    def _probe_device(self) -> None:
        """Raise if the device is failing: a sticky CUDA error surfaces on the next synchronisation."""
        self.torch.cuda.synchronize(self.tdevice)
