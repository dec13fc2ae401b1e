"""Every runtime error is translated at the runtime's seam, loading (graph capture included) as running, and
AOTInductor's untyped failure on CUDA too: checked on the CPU with the device as the only thing mocked
(``torch.cuda.set_device`` and ``torch.cuda.synchronize``), and on a GPU where there is one."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch._inductor

from service.core.config import ModelConfig
from service.core.errors import ConfigError, DeviceFailure, OutOfMemoryError, RuntimeFailure
from service.core.repository import ModelVersion
from service.core.spec import InputSpec, ModelSpec
from service.engine import Batcher, BatcherConfig, InferRequest
from service.engine.model import ModelEngine
from service.runtime import AotiRuntime, FakeRuntime, OnnxRuntime, TorchScriptRuntime

# test_batcher.py's spec, written again: this file runs on the GPU machine (it holds a GPU test), and
# test_batcher.py imports trio, which that machine lacks (tests/test_gpu_check.py imports it with only its packages).
SPEC = ModelSpec(
    name="fake",
    architecture="fake",
    input=InputSpec(height=4, width=4),
    resize_size=4,
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
    labels=tuple("abcdefghij"),
)
# What torch 2.14's AOTInductor runner raises when the compiled model returned an error code.
UNTYPED = (
    "run_func_( container_handle_, input_handles.data(), input_handles.size(), output_handles.data(), "
    "output_handles.size(), reinterpret_cast<AOTInductorStreamHandle>(stream_handle), proxy_executor_handle_) "
    "API call failed at /pytorch/torch/csrc/inductor/aoti_runner/model_container_runner.cpp, line 145"
)
ILLEGAL_ACCESS = "CUDA error: an illegal memory access was encountered"


class FakeGpu:
    """The CUDA device, mocked: ``set_device`` does nothing; ``synchronize`` answers, or raises ``fault``."""

    def __init__(self) -> None:
        self.fault: Exception | None = None
        self.probes = 0

    def synchronize(self, device: Any = None) -> None:
        self.probes += 1
        if self.fault is not None:
            raise self.fault


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeGpu:
    fake = FakeGpu()
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    return fake


def images(n: int) -> np.ndarray:
    return np.arange(n * 48, dtype=np.uint8).reshape(n, 3, 4, 4)


# ---- load: TorchScript, ONNX Runtime ---------------------------------------------------------------------------
def failing_load(exc: Exception) -> type[TorchScriptRuntime]:
    class FailsToLoad(TorchScriptRuntime):
        def _load_module(self) -> Any:
            raise exc

    return FailsToLoad


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), OutOfMemoryError),
        (torch.AcceleratorError(ILLEGAL_ACCESS), DeviceFailure),
        (RuntimeError(f"{ILLEGAL_ACCESS}\nCUDA kernel errors might be asynchronously reported"), DeviceFailure),
    ],
    ids=["oom", "accelerator-error", "runtime-error-with-cuda-text"],
)
def test_a_device_error_while_loading_is_a_device_failure_naming_file_and_device(
    gpu: FakeGpu, exc: Exception, expected: type[DeviceFailure]
) -> None:
    with pytest.raises(expected, match=r"could not load .*model\.pt on cuda:0") as info:
        failing_load(exc)(SPEC, "repo/tiny/1/model.pt", device="cuda:0")
    assert type(info.value) is expected and info.value.__cause__ is exc


def test_any_other_load_error_is_a_runtime_failure_naming_file_and_device(gpu: FakeGpu) -> None:
    with pytest.raises(RuntimeFailure, match=r"could not load .*model\.pt on cuda:0: KeyError") as info:
        failing_load(KeyError("conv1.weight"))(SPEC, "repo/tiny/1/model.pt", device="cuda:0")
    assert not isinstance(info.value, DeviceFailure)


def test_an_error_while_capturing_cuda_graphs_is_translated_too(gpu: FakeGpu) -> None:
    class CaptureFails(TorchScriptRuntime):
        """Loads on the CPU, then fails the way a CUDA graph capture does on a failing device."""

        def _load_module(self) -> Any:
            return torch.nn.Identity()

        def _load(self) -> None:
            super()._load()
            self._capture(self.max_batch_size)

        def _capture(self, size: int) -> None:
            raise torch.AcceleratorError(ILLEGAL_ACCESS)

    with pytest.raises(DeviceFailure, match="illegal memory access"):
        CaptureFails(SPEC, "model.pt", device="cpu")


def test_torchscript_weights_that_do_not_fit_the_device_are_not_a_config_error(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_torchscript(path: Path, device: str) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 98.00 MiB")

    monkeypatch.setattr("service.runtime.torchscript.load_torchscript", load_torchscript)
    with pytest.raises(OutOfMemoryError, match=r"could not load .*model\.pt on cuda:0"):
        TorchScriptRuntime(SPEC, "model.pt", device="cuda:0")


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("RuntimeException", "BFCArena::AllocateRawInternal Failed to allocate memory for buffer", OutOfMemoryError),
        ("Fail", "CUDA failure 100: no CUDA-capable device is detected", DeviceFailure),
        ("InvalidProtobuf", "Load model from model.onnx failed: Protobuf parsing failed", ConfigError),
    ],
)
def test_onnxruntime_device_errors_while_making_the_session_are_not_config_errors(
    monkeypatch: pytest.MonkeyPatch, name: str, text: str, expected: type[Exception]
) -> None:
    import onnxruntime as ort
    import onnxruntime.capi.onnxruntime_pybind11_state as ort_errors

    def session(*args: Any, **kwargs: Any) -> Any:
        raise getattr(ort_errors, name)(text)

    monkeypatch.setattr(ort, "InferenceSession", session)
    with pytest.raises(expected, match=r"load model\.onnx on cpu") as info:
        OnnxRuntime(SPEC, "model.onnx")
    assert type(info.value) is expected


def test_a_gpu_that_runs_out_of_memory_at_load_leaves_the_model_serving_on_the_cpu(gpu: FakeGpu) -> None:
    out_of_memory = failing_load(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))

    def factory(device: str) -> Any:
        return out_of_memory(SPEC, "model.pt", device=device) if device.startswith("cuda") else FakeRuntime(SPEC)

    version = ModelVersion("fake", 1, Path("fake/1"), SPEC, {}, {})
    config = ModelConfig(device="cuda", fallback="cpu", warmup=False, max_batch_size=4)
    engine = ModelEngine(version, config, factory=factory, available_gpus=["cuda:0"])
    try:
        state = engine.state()
        assert state.state == "DEGRADED" and state.devices == ("cpu",) and state.fallbacks == 1
        assert state.note is not None and "cuda:0 failed to load" in state.note and "out of memory" in state.note
    finally:
        asyncio.run(engine.close())


# ---- AOTInductor ---------------------------------------------------------------------------------------------
def aoti_load_fails(monkeypatch: pytest.MonkeyPatch, exc: Exception) -> None:
    def load(*args: Any, **kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(torch._inductor, "aoti_load_package", load)


@pytest.mark.parametrize(
    ("fault", "expected", "text"),
    [
        (None, OutOfMemoryError, "taken as out of memory"),
        (torch.AcceleratorError(ILLEGAL_ACCESS), DeviceFailure, "the device then failed: AcceleratorError"),
    ],
    ids=["device-answers", "device-fails"],
)
def test_aoti_untyped_failure_at_load_on_cuda_is_probed_not_a_config_error(
    gpu: FakeGpu,
    monkeypatch: pytest.MonkeyPatch,
    fault: Exception | None,
    expected: type[DeviceFailure],
    text: str,
) -> None:
    gpu.fault = fault
    aoti_load_fails(monkeypatch, RuntimeError(UNTYPED))
    with pytest.raises(expected, match=rf"could not load model\.cuda\.pt2 on cuda:0: .*{text}") as info:
        AotiRuntime(SPEC, "model.cuda.pt2", device="cuda:0")
    assert type(info.value) is expected and gpu.probes == 1


@pytest.mark.parametrize(
    ("device", "exc", "expected"),
    [
        ("cuda:0", torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"), OutOfMemoryError),
        ("cuda:0", RuntimeError("Incorrect device passed to aoti_runner_cpu"), ConfigError),  # the package's fault
        ("cpu", RuntimeError(UNTYPED), ConfigError),  # on the CPU no device is at fault
    ],
)
def test_aoti_load_errors_are_the_package_s_unless_the_device_s(
    gpu: FakeGpu, monkeypatch: pytest.MonkeyPatch, device: str, exc: Exception, expected: type[Exception]
) -> None:
    aoti_load_fails(monkeypatch, exc)
    with pytest.raises(expected) as info:
        AotiRuntime(SPEC, "model.pt2", device=device)
    assert type(info.value) is expected and gpu.probes == 0


class AotiOnAFakeGpu(AotiRuntime):
    """AotiRuntime's own error translation on a mocked CUDA device: batches larger than ``fits`` fail the way the
    compiled model fails there, with the runner's untyped RuntimeError."""

    fits = 1

    def _load(self) -> None:
        self.torch = torch
        self.tdevice = torch.device(self.device)
        self.cuda = self.tdevice.type == "cuda"
        self.host_np = np.empty((self.max_batch_size, 3, 4, 4), dtype=np.uint8)  # the pinned buffer, unpinned
        self.sizes: list[int] = []

    def _forward(self, batch: np.ndarray) -> np.ndarray:
        self.sizes.append(len(batch))
        if len(batch) > self.fits:
            raise RuntimeError(UNTYPED)
        return batch.reshape(len(batch), -1)[:, : SPEC.num_classes].astype(np.float32)

    def _release(self) -> None:
        return None


@pytest.mark.parametrize(
    ("device", "fault", "expected"),
    [
        ("cuda:0", None, OutOfMemoryError),
        ("cuda:0", torch.AcceleratorError(ILLEGAL_ACCESS), DeviceFailure),
        ("cpu", None, RuntimeFailure),
    ],
    ids=["cuda-device-answers", "cuda-device-fails", "cpu"],
)
def test_aoti_untyped_failure_at_run_is_out_of_memory_only_while_the_device_answers(
    gpu: FakeGpu, device: str, fault: Exception | None, expected: type[RuntimeFailure]
) -> None:
    gpu.fault = fault
    runtime = AotiOnAFakeGpu(SPEC, "model.pt2", device=device)
    try:
        with pytest.raises(expected) as info:
            runtime.run(images(2))
        assert type(info.value) is expected and isinstance(info.value.__cause__, RuntimeError)
        assert gpu.probes == (1 if device.startswith("cuda") else 0)
        if fault is not None:
            assert ILLEGAL_ACCESS in str(info.value)  # the probe's message is the one that says what failed
    finally:
        runtime.close()


def test_aoti_error_that_names_the_cuda_error_needs_no_probe(gpu: FakeGpu) -> None:
    class SaysOutOfMemory(AotiOnAFakeGpu):
        def _forward(self, batch: np.ndarray) -> np.ndarray:
            raise RuntimeError("CUDA out of memory. Tried to allocate 512.00 MiB")

    runtime = SaysOutOfMemory(SPEC, "model.pt2", device="cuda:0")
    try:
        with pytest.raises(OutOfMemoryError):
            runtime.run(images(2))
        assert gpu.probes == 0
    finally:
        runtime.close()


def run_batch(runtime: AotiOnAFakeGpu, n: int) -> tuple[list[object], np.ndarray]:
    async def scenario() -> tuple[list[object], np.ndarray]:
        batcher = Batcher([runtime], BatcherConfig(max_batch_size=n, max_queue_delay_ms=0))
        try:
            result = await batcher.submit(InferRequest(request_id="x", model="fake", images=images(n)))
            return list(result.errors), result.logits
        finally:
            await batcher.close()

    return asyncio.run(scenario())


def test_aoti_untyped_failure_on_a_batch_of_four_splits_it_instead_of_going_image_by_image(gpu: FakeGpu) -> None:
    runtime = AotiOnAFakeGpu(SPEC, "model.pt2", device="cuda:0")
    errors, logits = run_batch(runtime, 4)
    assert errors == [None] * 4
    np.testing.assert_array_equal(logits, images(4).reshape(4, -1)[:, :10].astype(np.float32))
    assert runtime.sizes == [4, 2, 1, 1, 2, 1, 1]  # halved (out of memory), not 4 then 1, 1, 1, 1


def test_aoti_device_that_keeps_failing_is_taken_out_of_service_for_the_cpu_fallback(gpu: FakeGpu) -> None:
    gpu.fault = torch.AcceleratorError(ILLEGAL_ACCESS)
    runtime = AotiOnAFakeGpu(SPEC, "model.pt2", device="cuda:0")
    runtime.fits = 0
    fallbacks: list[str] = []
    heard: list[str] = []  # the engine's state each time it tells of a change (the front ends re-read the catalog)

    def factory(device: str) -> Any:
        return runtime if device.startswith("cuda") else FakeRuntime(SPEC)

    version = ModelVersion("fake", 1, Path("fake/1"), SPEC, {}, {})
    config = ModelConfig(device="cuda", fallback="cpu", warmup=False, max_batch_size=4)

    async def scenario() -> tuple[list[object], str, tuple[str, ...]]:
        engine = ModelEngine(version, config, factory=factory, available_gpus=["cuda:0"], on_fallback=fallbacks.append,
                             on_state_change=lambda: heard.append(engine.state().state))  # fmt: skip
        try:
            result = await engine.submit(InferRequest(request_id="x", model="fake", images=images(4)))
            state = engine.state()
            return list(result.errors), state.state, state.devices
        finally:
            await engine.close()

    errors, state, devices = asyncio.run(scenario())
    assert errors == [None] * 4 and state == "DEGRADED" and devices == ("cpu",)
    assert fallbacks == ["device_failed"] and heard[-1:] == ["DEGRADED"]  # told, with or without metrics


# ---- on a real GPU ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_a_real_out_of_memory_while_capturing_cuda_graphs_is_out_of_memory() -> None:
    class TooBig(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.empty((1 << 47,), dtype=torch.float32, device=x.device)  # 512 TiB

    class Allocates(TorchScriptRuntime):
        def _load_module(self) -> Any:
            return TooBig()

    with pytest.raises(OutOfMemoryError, match=r"could not load .*model\.pt on cuda"):
        Allocates(SPEC, "model.pt", device="cuda", max_batch_size=2)


def test_a_graphs_static_input_has_the_host_buffers_layout_and_the_module_gets_channels_last(
    tmp_path: Path,
) -> None:
    """The host-to-device copy of a graph's input is one memcpy only when both sides are contiguous NCHW; the module
    still runs channels-last (the transpose is the first kernel of the graph). Built on the CPU, where the layouts are
    the same objects: the device is the only thing missing (tests/service/test_gpu.py checks the captured graphs)."""
    import torch

    class Tiny(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.float().flatten(1)[:, :10]

    torch.jit.script(Tiny()).save(str(tmp_path / "model.pt"))
    runtime = TorchScriptRuntime(SPEC, tmp_path / "model.pt")
    try:
        assert runtime.run(images(2)).shape == (2, 10)
        static_in = runtime._call(lambda: runtime._device_input(2))
        assert static_in.is_contiguous()
        assert runtime._layout(static_in).is_contiguous(memory_format=torch.channels_last)
    finally:
        runtime.close()
