"""CUDA paths, run for real wherever a GPU is at hand (skipped without one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture
from service.batching import InferRequest
from service.batching.engine import ModelEngine
from service.config import ModelConfig
from service.errors import DeviceFailure
from service.repository import ModelRepository, random_batch
from service.runtime import TorchScriptRuntime

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def resnet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    source = from_architecture("resnet18")
    report = export_model(
        source.eager, source.spec, ExportRequest(name="r18", repository=str(root), fp16=True, latency=False)
    )
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    return root


def test_fp16_parity_is_checked_on_the_gpu(resnet: Path) -> None:
    spec = ModelRepository(resnet).model("r18").latest.spec
    fp16 = [e for e in spec.exports if e.precision == "fp16"]
    assert fp16 and all(e.parity_max_rel_error is not None and e.parity_max_rel_error <= 2e-2 for e in fp16)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_torchscript_cuda_graphs_match_the_cpu(resnet: Path, precision: str) -> None:
    version = ModelRepository(resnet).model("r18").latest
    cpu = TorchScriptRuntime(version.spec, version.files["torchscript"], max_batch_size=8)
    gpu = TorchScriptRuntime(
        version.spec, version.files["torchscript"], device="cuda", precision=precision, max_batch_size=8
    )
    try:
        assert sorted(gpu.graphs) == [1, 2, 4, 8]
        for n in (1, 3, 8):
            batch = random_batch(version.spec, n, seed=n)
            a, b = cpu.run(batch), gpu.run(batch)
            tolerance = 1e-3 if precision == "fp32" else 5e-2
            scale = np.abs(a).max(axis=1, keepdims=True)
            assert (np.abs(a - b) / scale).max() < tolerance
    finally:
        cpu.close()
        gpu.close()


def test_real_cuda_out_of_memory_splits_the_batch(resnet: Path) -> None:
    """A real OOM: the first call of each batch of more than two images allocates past the device's memory."""
    version = ModelRepository(resnet).model("r18").latest
    inner = TorchScriptRuntime(version.spec, version.files["torchscript"], device="cuda", max_batch_size=8,
                               cuda_graphs=False)  # fmt: skip
    original = inner._forward
    hog: list[torch.Tensor] = []

    def forward(batch: np.ndarray) -> np.ndarray:
        if len(batch) > 2:
            free, _ = torch.cuda.mem_get_info()
            hog.append(torch.empty(free * 2, dtype=torch.uint8, device="cuda"))  # raises OutOfMemoryError
        return original(batch)

    inner._forward = forward  # type: ignore[method-assign]

    async def scenario() -> None:
        engine = ModelEngine(version, ModelConfig(device="cuda", max_batch_size=8, warmup=False),
                             factory=lambda d: inner, available_gpus=["cuda:0"])  # fmt: skip
        result = await engine.submit(InferRequest(request_id="x", model="r18", images=random_batch(version.spec, 8)))
        assert result.errors == [None] * 8
        await engine.close()

    asyncio.run(scenario())
    assert not hog


def test_device_auto_picks_the_gpu(resnet: Path) -> None:
    entry = ModelRepository(resnet).model("r18")
    engine = ModelEngine(entry.latest, entry.config)
    state = engine.state()
    assert state.devices[0].startswith("cuda") and state.state == "READY" and state.note is None
    asyncio.run(engine.close())


def test_device_failure_type_is_raised_for_cuda_errors() -> None:
    assert issubclass(DeviceFailure, Exception)
