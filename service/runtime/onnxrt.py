"""The onnxruntime runtime: CUDA execution provider with IO binding on a GPU, the CPU provider otherwise.

Checked against onnxruntime(-gpu) 1.31's Python API: ``io_binding()``, ``bind_cpu_input``, ``bind_output`` with a
device and no shape (onnxruntime allocates the output for each batch's shape, so one binding serves every batch
size), ``run_with_iobinding``, ``copy_outputs_to_cpu``. Its errors come as the pybind classes of
``onnxruntime.capi.onnxruntime_pybind11_state`` (``RuntimeException``, ``Fail``, ``EPFail``, ``DeviceReset``, ...),
so they are told apart by class name and by the CUDA execution provider's own failure texts.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import numpy as np

from service.core.errors import ConfigError, DeviceFailure, OutOfMemoryError, RuntimeFailure, VisionServeError
from service.core.spec import ModelSpec
from service.core.status import OutputInfo
from service.runtime.base import Runtime

log = logging.getLogger(__name__)
_preload_lock = threading.Lock()
_preloaded: list[bool] = []  # one attempt per process


def preload_cuda_libraries(ort: Any) -> bool:
    """Load the CUDA and cuDNN libraries onnxruntime-gpu's CUDA provider links to, once per process; True when they
    were. The provider finds them only if something has loaded them already: importing torch does, which is why it
    worked beside torch and fails without it, or with a torch built for another CUDA (onnxruntime's docs,
    "Compatibility with PyTorch"). ``preload_dlls()`` (onnxruntime 1.21 and later) loads the pip packages' copies.
    A failure is logged, not raised: the session then comes up without the CUDA provider, and that is refused as a
    device failure (the CPU fallback, observable), never served as if on the GPU."""
    with _preload_lock:
        if _preloaded:
            return _preloaded[0]
        preload = getattr(ort, "preload_dlls", None)
        ok = False
        if preload is None:
            log.warning("onnxruntime %s has no preload_dlls(): its CUDA provider relies on CUDA being loaded already",
                        getattr(ort, "__version__", "?"))  # fmt: skip
        else:
            try:
                preload()
                ok = True
            except Exception as exc:  # a missing library: the provider will say so when the session is made
                log.warning("onnxruntime.preload_dlls() failed: %s (its CUDA provider may not load)", exc)
        _preloaded.append(ok)
        return ok


def _cuda_index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


DEVICE_ERROR_CLASSES = ("EPFail", "DeviceReset")
# What the CUDA execution provider says when the device fails (its arena's out of memory is told apart first).
DEVICE_ERROR_MARKERS = ("CUDA failure", "CUDNN failure", "CUBLAS failure", "cudaError", "CUDA error")


def translate_onnxruntime_error(exc: BaseException, device: str) -> VisionServeError:
    """An onnxruntime exception as the project's error: device failures (out of memory, CUDA errors) apart."""
    text = str(exc)
    if "out of memory" in text.lower() or "failed to allocate memory" in text.lower():
        return OutOfMemoryError(f"onnxruntime out of memory on {device}: {type(exc).__name__}: {text}")
    if type(exc).__name__ in DEVICE_ERROR_CLASSES or any(m.lower() in text.lower() for m in DEVICE_ERROR_MARKERS):
        return DeviceFailure(f"onnxruntime device failure on {device}: {type(exc).__name__}: {text}")
    return RuntimeFailure(f"onnxruntime failed on {device}: {type(exc).__name__}: {text}")


# onnxruntime's output types, as served: floating ones as float32 (see OnnxRuntime._output_infos)
ONNX_DTYPES = dict.fromkeys(["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"], "float32")
ONNX_DTYPES.update({f"tensor({kind})": kind for kind in ("int64", "int32", "int16", "int8", "uint8", "bool")})

NO_CUDA_PROVIDER = "onnxruntime here has no CUDA execution provider"


def runnable_device(fmt: str, device: str) -> str:
    """Where a ``fmt`` artifact asked to run on ``device`` can run here: an ONNX model runs on the CPU where
    onnxruntime has no CUDA execution provider (its CPU build beside a CUDA torch), the rest where asked."""
    if fmt == "onnx" and device.startswith("cuda"):
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return "cpu"
    return device


def int8_cuda_providers(available: list[str], index: int, path: Path) -> list[Any]:
    """TensorRT (real INT8 kernels for a QDQ graph) before CUDA; neither: a :class:`ConfigError`, since running the
    INT8 model on the CPU instead, or its fp32 source on the GPU, would both be a silent substitution."""
    providers: list[Any] = []
    if "TensorrtExecutionProvider" in available:
        providers.append(("TensorrtExecutionProvider", {"device_id": index, "trt_int8_enable": True}))
    if "CUDAExecutionProvider" in available:
        providers.append(("CUDAExecutionProvider", {"device_id": index}))
    if not providers:
        raise ConfigError(
            f"precision int8 on cuda:{index} needs onnxruntime's TensorRT or CUDA execution provider, and this "
            f"onnxruntime has neither (it has {', '.join(available)}) to run {path}: install onnxruntime-gpu, or "
            'serve int8 with device = "cpu"'
        )
    return [*providers, "CPUExecutionProvider"]


class OnnxRuntime(Runtime):
    """Runs ``model.onnx`` (uint8 NCHW in, float logits out) with onnxruntime."""

    kind = "onnxruntime"

    def __init__(
        self,
        spec: ModelSpec,
        path: str | Path,
        *,
        device: str = "cpu",
        name: str = "model",
        threads: int | None = None,
        precision: str = "fp32",
        spinning: bool = True,
        conv_algo_search: str = "heuristic",
    ) -> None:
        self.path = Path(path)
        self.threads = threads
        self.spinning = spinning
        self.conv_algo_search = conv_algo_search
        self.precision = precision
        super().__init__(spec, device=device, name=name)

    def cuda_options(self) -> dict[str, Any]:
        """The CUDA execution provider's options. ``cudnn_conv_algo_search``: its default, EXHAUSTIVE, times every
        convolution algorithm on each new input shape, and batches are not padded to the warmed sizes, so most batch
        sizes would pay that search while serving; HEURISTIC (the config's default) asks cuDNN's heuristics instead.
        Which is faster once warm is for a GPU to measure (docs/gpu-check.md)."""
        return {"device_id": _cuda_index(self.device), "cudnn_conv_algo_search": self.conv_algo_search.upper()}

    def _load(self) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            options.intra_op_num_threads = self.threads
        options.log_severity_level = 3
        # onnxruntime's intra-op threads spin-wait for work between parallel sections (`intra_op_spinning`, on by
        # default). Off, they sleep: CPU other work gets back, but each section waits for its threads to wake and
        # find a core; on 2 cores under open-loop load that lengthened p99 by up to 1.6x (docs/performance.md,
        # "Where each request waits").
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spinning else "0")
        providers: list[Any] = ["CPUExecutionProvider"]
        if self.device.startswith("cuda"):
            preload_cuda_libraries(ort)
            if self.precision == "int8":
                providers = int8_cuda_providers(ort.get_available_providers(), _cuda_index(self.device), self.path)
            else:
                providers.insert(0, ("CUDAExecutionProvider", self.cuda_options()))
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=providers)
        except Exception as exc:
            # The CUDA provider allocates its arena and cuDNN/cuBLAS handles here: a device that is out of memory
            # or failing is a device failure (the engine falls back to the CPU), not a bad model file.
            if isinstance(translate_onnxruntime_error(exc, self.device), DeviceFailure):
                raise self._translate_load(exc) from exc
            raise ConfigError(f"onnxruntime cannot load {self.path} on {self.device}: {exc}") from exc
        gpu_providers = {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
        if self.device.startswith("cuda") and not gpu_providers & set(self.session.get_providers()):
            raise DeviceFailure(f"onnxruntime's CUDA execution provider is not usable for {self.device}")
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or inputs[0].type != "tensor(uint8)":
            described = ", ".join(f"{i.name}: {i.type}" for i in inputs)
            raise ConfigError(f"{self.path} must take one uint8 tensor, takes {described}")
        self.input_name = inputs[0].name
        self.output_names = [o.name for o in outputs]
        if self.device.startswith("cuda"):
            # One binding, rebound per batch: the output is bound to the device with no shape, so onnxruntime
            # allocates it at each batch's size and copy_outputs_to_cpu brings back exactly [N, ...] of each.
            self.binding = self.session.io_binding()
        self.outputs = self._output_infos(outputs)

    def _output_infos(self, outputs: list[Any]) -> tuple[OutputInfo, ...]:
        """Each graph output's name, dtype and per-image shape. Floating outputs are served as float32 whatever the
        graph computes in (an fp16 export answers what its fp32 source does); integer ones keep their dtype. A
        per-image dimension the graph leaves symbolic is learned from one image's forward."""
        shapes = [o.shape[1:] for o in outputs]
        if not all(isinstance(d, int) for shape in shapes for d in shape):
            c, h, w = self.spec.input.channels, self.spec.input.height, self.spec.input.width
            probe = self._forward(np.zeros((1, c, h, w), dtype=np.uint8))
            shapes = [list(array.shape[1:]) for array in probe]
        infos = []
        for o, shape in zip(outputs, shapes, strict=True):
            dtype = ONNX_DTYPES.get(o.type)
            if dtype is None:
                raise ConfigError(f"{self.path}: output {o.name} is a {o.type}, which is not served")
            infos.append(OutputInfo(o.name, dtype, tuple(int(d) for d in shape)))
        return tuple(infos)

    def _forward(self, batch: np.ndarray) -> list[np.ndarray]:
        """Every output in the graph's own dtype (the runtime casts what it serves)."""
        if self.device.startswith("cuda"):
            # IO binding: one host-to-device copy of the uint8 batch, outputs copied back once.
            binding = self.binding
            binding.clear_binding_inputs()
            binding.clear_binding_outputs()
            binding.bind_cpu_input(self.input_name, np.ascontiguousarray(batch))
            for name in self.output_names:
                binding.bind_output(name, "cuda", _cuda_index(self.device))
            self.session.run_with_iobinding(binding)
            return list(binding.copy_outputs_to_cpu())
        return list(self.session.run(self.output_names, {self.input_name: batch}))

    def _translate(self, exc: Exception) -> VisionServeError:
        return translate_onnxruntime_error(exc, self.device)

    def _release(self) -> None:
        self.__dict__.pop("binding", None)
        self.__dict__.pop("session", None)
