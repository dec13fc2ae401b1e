"""The onnxruntime runtime: CUDA execution provider with IO binding on a GPU, the CPU provider otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from service.errors import ConfigError, DeviceFailure, RuntimeFailure, VisionServeError
from service.runtime.base import Runtime
from service.spec import ModelSpec


def _cuda_index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


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
    ) -> None:
        self.path = Path(path)
        self.threads = threads
        super().__init__(spec, device=device, name=name)

    def _load(self) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.threads:
            options.intra_op_num_threads = self.threads
        options.log_severity_level = 3
        providers: list[Any]
        if self.device.startswith("cuda"):
            providers = [("CUDAExecutionProvider", {"device_id": _cuda_index(self.device)}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        try:
            self.session = ort.InferenceSession(str(self.path), options, providers=providers)
        except Exception as exc:
            raise ConfigError(f"onnxruntime cannot load {self.path}: {exc}") from exc
        if self.device.startswith("cuda") and "CUDAExecutionProvider" not in self.session.get_providers():
            raise DeviceFailure(f"onnxruntime's CUDA execution provider is not usable for {self.device}")
        inputs, outputs = self.session.get_inputs(), self.session.get_outputs()
        if len(inputs) != 1 or inputs[0].type != "tensor(uint8)":
            described = ", ".join(f"{i.name}: {i.type}" for i in inputs)
            raise ConfigError(f"{self.path} must take one uint8 tensor, takes {described}")
        self.input_name = inputs[0].name
        self.output_name = outputs[0].name

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        if self.device.startswith("cuda"):
            # IO binding: one host-to-device copy of the uint8 batch, outputs copied back once.
            binding = self.session.io_binding()
            binding.bind_cpu_input(self.input_name, batch)
            binding.bind_output(self.output_name, "cpu")
            self.session.run_with_iobinding(binding)
            out = binding.copy_outputs_to_cpu()[0]
        else:
            out = self.session.run([self.output_name], {self.input_name: batch})[0]
        return np.asarray(out, dtype=np.float32)

    def _translate(self, exc: Exception) -> VisionServeError:
        text = str(exc)
        if "Failed to allocate memory" in text or "out of memory" in text.lower() or "CUDA" in text:
            return DeviceFailure(f"onnxruntime device failure on {self.device}: {text}")
        return RuntimeFailure(f"onnxruntime failed on {self.device}: {text}")

    def _release(self) -> None:
        self.__dict__.pop("session", None)
