"""Runtimes translate torch's and onnxruntime's real exception types into the project's errors at their seam, and
the batcher splits a batch that ran out of device memory: checked on the CPU, with runtimes whose forward raises
the exception types a GPU raises."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors
import pytest
import torch

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture
from service.core.config import ModelConfig
from service.core.errors import ConfigError, DeviceFailure, OutOfMemoryError, RuntimeFailure
from service.core.repository import ModelRepository, ModelVersion, random_batch
from service.engine import InferRequest
from service.engine.model import ModelEngine
from service.runtime import OnnxRuntime, TorchScriptRuntime
from service.runtime.onnxrt import translate_onnxruntime_error
from service.runtime.torchbase import translate_torch_error


@pytest.fixture(scope="module")
def version(tmp_path_factory: pytest.TempPathFactory) -> ModelVersion:
    root = tmp_path_factory.mktemp("repo")
    source = from_architecture("smallcnn")
    export_model(source.eager, source.spec, ExportRequest(name="tiny", repository=str(root), latency=False))
    return ModelRepository(root).model("tiny").latest


TORCH_DEVICE_ERRORS = [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)"),
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
    # What TorchScript's interpreter raises when a kernel inside it ran out of memory: a plain RuntimeError.
    RuntimeError("The following operation failed in the TorchScript interpreter.\nRuntimeError: CUDA out of memory."),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
]


@pytest.mark.parametrize("exc", TORCH_DEVICE_ERRORS, ids=lambda e: type(e).__name__)
def test_torch_device_errors_become_device_failures(exc: Exception) -> None:
    assert isinstance(translate_torch_error(exc, "torchscript", "cuda:0"), DeviceFailure)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("Given groups=1, weight of size [32, 3, 3, 3], expected input to have 3 channels"),
        ValueError("bad"),
        RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu"),
    ],
)
def test_other_torch_errors_are_runtime_failures_but_not_device_failures(exc: Exception) -> None:
    error = translate_torch_error(exc, "torchscript", "cuda:0")
    assert isinstance(error, RuntimeFailure) and not isinstance(error, DeviceFailure)


@pytest.mark.parametrize(
    ("exc", "device_failure"),
    [
        (ort_errors.RuntimeException("BFCArena::AllocateRawInternal Failed to allocate memory for buffer"), True),
        (ort_errors.Fail("CUDA failure 2: out of memory ; GPU=0 ; hostname=x ; expr=cudaMalloc(&p, size);"), True),
        (ort_errors.RuntimeException("CUDNN failure 4: CUDNN_STATUS_INTERNAL_ERROR"), True),
        (ort_errors.EPFail("CUDAExecutionProvider failed"), True),
        (ort_errors.InvalidArgument("Got invalid dimensions for input: input for the following indices"), False),
        (ort_errors.RuntimeException("Non-zero status code returned while running Conv node. CUDAExecutionProvider"
                                     " was asked for an unsupported attribute"), False),
    ],
)  # fmt: skip
def test_onnxruntime_error_types_are_told_apart(exc: Exception, device_failure: bool) -> None:
    error = translate_onnxruntime_error(exc, "cuda:0")
    assert isinstance(error, RuntimeFailure) and isinstance(error, DeviceFailure) is device_failure
    assert type(exc).__name__ in str(error)


def test_a_runtime_whose_forward_raises_the_real_types_fails_its_future_with_ours(version: ModelVersion) -> None:
    class Failing(OnnxRuntime):
        def _forward(self, batch: np.ndarray) -> np.ndarray:
            raise ort_errors.Fail("CUDA failure 2: out of memory")

    rt = Failing(version.spec, version.files["onnx"])
    try:
        with pytest.raises(OutOfMemoryError, match="onnxruntime out of memory") as info:
            rt.run(random_batch(version.spec, 2))
        assert isinstance(info.value.__cause__, ort_errors.Fail)  # the original stays attached for the logs
    finally:
        rt.close()


class OutOfMemoryAbove(TorchScriptRuntime):
    """Raises torch's real OutOfMemoryError for batches larger than ``limit`` (as a GPU does past its memory)."""

    limit = 2

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        self.sizes.append(len(batch))
        if len(batch) > self.limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {len(batch)} GiB")
        return super()._forward(batch)


def test_out_of_memory_splits_the_batch_until_it_fits_and_every_image_is_answered(version: ModelVersion) -> None:
    runtime = OutOfMemoryAbove(version.spec, version.files["torchscript"], max_batch_size=8)
    runtime.sizes = []  # type: ignore[attr-defined]
    images = random_batch(version.spec, 8, seed=3)
    expected = TorchScriptRuntime(version.spec, version.files["torchscript"], max_batch_size=8)
    want = expected.run(images)
    expected.close()

    async def scenario() -> list[object]:
        engine = ModelEngine(version, ModelConfig(device="cpu", max_batch_size=8, warmup=False),
                             factory=lambda d: runtime, available_gpus=[])  # fmt: skip
        try:
            result = await engine.submit(InferRequest(request_id="x", model="tiny", images=images))
            np.testing.assert_allclose(result.logits, want, rtol=1e-5, atol=1e-5)
            assert engine.state().state == "READY"  # split and recovered: the instance stays in service
            return list(result.errors)
        finally:
            await engine.close()

    assert asyncio.run(scenario()) == [None] * 8
    sizes: list[int] = runtime.sizes  # type: ignore[attr-defined]
    assert sizes[0] == 8 and max(sizes[1:]) <= 4 and sorted(set(sizes)) == [2, 4, 8]
    runtime.close()


def test_a_runtime_that_cannot_load_says_why_and_leaves_no_thread_behind(tmp_path: Path, version: ModelVersion) -> None:
    before = threading.active_count()
    with pytest.raises(ConfigError, match=r"cannot load TorchScript .*missing.pt"):
        TorchScriptRuntime(version.spec, tmp_path / "missing.pt")
    assert threading.active_count() == before


def test_a_batch_that_needs_three_halvings_still_fits_without_losing_the_instance(version: ModelVersion) -> None:
    runtime = OutOfMemoryAbove(version.spec, version.files["torchscript"], max_batch_size=8)
    runtime.sizes = []  # type: ignore[attr-defined]
    runtime.limit = 1  # type: ignore[misc]

    async def scenario() -> tuple[list[object], str]:
        engine = ModelEngine(version, ModelConfig(device="cpu", max_batch_size=8, warmup=False, fallback="none"),
                             factory=lambda d: runtime, available_gpus=[])  # fmt: skip
        try:
            result = await engine.submit(
                InferRequest(request_id="x", model="tiny", images=random_batch(version.spec, 8))
            )
            return list(result.errors), engine.state().state
        finally:
            await engine.close()

    errors, state = asyncio.run(scenario())
    assert errors == [None] * 8 and state == "READY"
