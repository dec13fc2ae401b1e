"""Devices and the CPU fallback, proven with a fault-injecting runtime (no GPU here), plus the real runtimes."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_checkpoint
from service.core.config import ModelConfig
from service.core.errors import DeviceFailure
from service.core.repository import ModelRepository, ModelVersion
from service.engine import InferRequest
from service.engine.model import ModelEngine, plan_devices
from service.runtime import FakeRuntime, FaultInjectingRuntime, OnnxRuntime
from tests.service.test_batcher import SPEC, ident, images


def _version(tmp_path: Path) -> ModelVersion:
    return ModelVersion(model="fake", version=1, path=tmp_path, spec=SPEC, files={}, fp16_files={})


def _oom_above(limit: int) -> Any:
    def fault(batch: np.ndarray) -> Exception | None:
        return DeviceFailure("CUDA out of memory (injected)") if len(batch) > limit else None

    return fault


def _always_broken(batch: np.ndarray) -> Exception | None:
    return DeviceFailure("CUDA error: an illegal memory access was encountered (injected)")


async def _classify(engine: ModelEngine, ids: list[int]) -> Any:
    return await engine.submit(InferRequest(request_id="r", model="fake", images=images(ids)))


def test_out_of_memory_splits_the_batch_and_retries(tmp_path: Path) -> None:
    gpu = FakeRuntime(SPEC, device="cuda:0", fault=_oom_above(2))

    async def scenario() -> None:
        engine = ModelEngine(
            _version(tmp_path), ModelConfig(device="cuda", max_batch_size=8, warmup=False),
            factory=lambda device: gpu, available_gpus=["cuda:0"],
        )  # fmt: skip
        result = await _classify(engine, list(range(8)))
        assert result.errors == [None] * 8
        assert [ident(r.astype(np.uint8)) for r in result.logits] == list(range(8))
        assert gpu.batch_sizes[0] == 8 and max(gpu.batch_sizes[1:]) <= 4 and 2 in gpu.batch_sizes
        assert engine.state().state == "READY" and engine.state().devices == ("cuda:0",)
        await engine.close()

    asyncio.run(scenario())


def test_a_device_that_keeps_failing_is_replaced_by_cpu_instances(tmp_path: Path) -> None:
    fallbacks: list[str] = []
    made: list[str] = []

    def factory(device: str) -> Any:
        made.append(device)
        if device.startswith("cuda"):
            return FakeRuntime(SPEC, device=device, fault=_always_broken)
        return FakeRuntime(SPEC, device=device)

    async def scenario() -> None:
        engine = ModelEngine(
            _version(tmp_path), ModelConfig(device="cuda", fallback="cpu", max_batch_size=4, warmup=False),
            factory=factory, available_gpus=["cuda:0"], on_fallback=fallbacks.append,
        )  # fmt: skip
        results = await asyncio.gather(*(_classify(engine, [i, i + 100]) for i in range(6)))
        for i, result in enumerate(results):  # nothing accepted was dropped: every image answered from the CPU
            assert result.errors == [None, None]
            assert [ident(r.astype(np.uint8)) for r in result.logits] == [i, i + 100]
        state = engine.state()
        assert state.state == "DEGRADED" and state.devices == ("cpu",) and state.fallbacks == 1
        assert "cuda:0 taken out of service" in (state.note or "") and "fallback" in (state.note or "")
        assert made == ["cuda:0", "cpu"] and fallbacks == ["device_failed"]
        await engine.close()

    asyncio.run(scenario())


def test_with_fallback_none_a_failing_device_fails_its_requests(tmp_path: Path) -> None:
    async def scenario() -> None:
        engine = ModelEngine(
            _version(tmp_path), ModelConfig(device="cuda", fallback="none", max_batch_size=4, warmup=False),
            factory=lambda d: FakeRuntime(SPEC, device=d, fault=_always_broken), available_gpus=["cuda:0"],
        )  # fmt: skip
        outcomes = await asyncio.gather(*(_classify(engine, [i]) for i in range(6)), return_exceptions=True)
        failures = [o for o in outcomes if isinstance(o, DeviceFailure)]
        errors = [o.errors[0] for o in outcomes if not isinstance(o, BaseException)]
        assert failures or errors
        assert all(isinstance(e, DeviceFailure) for e in errors)
        assert len(failures) + len(errors) == 6  # every request resolved, none on a CPU
        assert engine.state().state == "FAILED"
        with pytest.raises(DeviceFailure):
            await _classify(engine, [99])
        await engine.close()

    asyncio.run(scenario())


def test_device_planning_is_explicit() -> None:
    assert plan_devices(ModelConfig(device="auto"), []) == (
        ["cpu"],
        False,
        "device auto: no usable GPU, serving on CPU",
    )
    assert plan_devices(ModelConfig(device="auto"), ["cuda:0", "cuda:1"]) == (["cuda:0", "cuda:1"], False, None)
    assert plan_devices(ModelConfig(device="cuda:1"), ["cuda:0", "cuda:1"])[0] == ["cuda:1"]
    devices, degraded, note = plan_devices(ModelConfig(device="cuda", fallback="cpu"), [])
    assert devices == ["cpu"] and degraded and "fallback" in (note or "")
    with pytest.raises(DeviceFailure, match="fallback = 'none'"):
        plan_devices(ModelConfig(device="cuda:0", fallback="none"), [])


def test_no_gpu_with_device_cuda_serves_degraded_from_cpu(tmp_path: Path) -> None:
    fallbacks: list[str] = []
    engine = ModelEngine(
        _version(tmp_path), ModelConfig(device="cuda", warmup=False), factory=lambda d: FakeRuntime(SPEC, device=d),
        available_gpus=[], on_fallback=fallbacks.append,
    )  # fmt: skip
    assert engine.state().state == "DEGRADED" and engine.state().devices == ("cpu",)
    assert fallbacks == ["device_unavailable"]
    asyncio.run(engine.close())


def test_a_gpu_instance_that_fails_to_load_falls_back_to_the_cpu_where_the_config_allows(tmp_path: Path) -> None:
    """A CUDA instance that fails at load (here a device failure from its runtime, as onnxruntime's session without
    its CUDA provider is) used to refuse the whole model even with fallback = "cpu"."""

    def factory(device: str) -> Any:
        if device.startswith("cuda"):
            raise DeviceFailure(f"onnxruntime's CUDA execution provider is not usable for {device}")
        return FakeRuntime(SPEC, device=device)

    fallbacks: list[str] = []
    engine = ModelEngine(
        _version(tmp_path), ModelConfig(device="cuda", instances=2, warmup=False), factory=factory,
        available_gpus=["cuda:0"], on_fallback=fallbacks.append,
    )  # fmt: skip
    state = engine.state()
    assert (state.state, state.devices, state.fallbacks) == ("DEGRADED", ("cpu",), 1)
    assert "cuda:0 failed to load: onnxruntime's CUDA execution provider" in state.note and "(fallback)" in state.note
    assert fallbacks == ["load_failed"] and len(engine.batcher.instances) == 2
    results = asyncio.run(_classify(engine, [1, 2, 3]))
    assert len(results.logits) == 3 and results.errors == [None] * 3
    asyncio.run(engine.close())
    with pytest.raises(DeviceFailure, match="not usable for cuda:0"):  # fallback = "none": refused, as it asks
        ModelEngine(_version(tmp_path), ModelConfig(device="cuda", fallback="none", warmup=False), factory=factory,
                    available_gpus=["cuda:0"])  # fmt: skip


def test_one_gpu_failing_to_load_leaves_the_other_serving(tmp_path: Path) -> None:
    def factory(device: str) -> Any:
        if device == "cuda:1":
            raise DeviceFailure("CUDA error: out of memory")
        return FakeRuntime(SPEC, device=device)

    engine = ModelEngine(_version(tmp_path), ModelConfig(device="cuda", warmup=False), factory=factory,
                         available_gpus=["cuda:0", "cuda:1"])  # fmt: skip
    state = engine.state()
    assert (state.state, state.devices, state.fallbacks) == ("DEGRADED", ("cuda:0",), 0)
    assert "cuda:1 failed to load" in state.note and "fallback" not in state.note
    asyncio.run(engine.close())


@pytest.fixture(scope="module")
def digits_repo(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    source = from_checkpoint(digits_checkpoint)
    export_model(source.eager, source.spec, ExportRequest(name="digits", repository=str(root), latency=False))
    return root


def test_fault_injection_around_a_real_runtime_falls_back_to_a_real_cpu_runtime(digits_repo: Path) -> None:
    version = ModelRepository(digits_repo).model("digits").latest
    spec = version.spec

    def factory(device: str) -> Any:
        cpu = OnnxRuntime(spec, version.files["onnx"], device="cpu")
        if device == "cpu":
            return cpu
        return FaultInjectingRuntime(cpu, _always_broken, device=device)  # a "GPU" that always fails

    async def scenario() -> None:
        engine = ModelEngine(version, ModelConfig(device="cuda:0", warmup=False), factory=factory,
                             available_gpus=["cuda:0"])  # fmt: skip
        batch = np.random.default_rng(0).integers(0, 256, (5, 3, 32, 32), dtype=np.uint8)
        result = await engine.submit(InferRequest(request_id="x", model="digits", images=batch))
        reference = OnnxRuntime(spec, version.files["onnx"])
        np.testing.assert_allclose(result.logits, reference.run(batch), rtol=1e-5, atol=1e-5)
        reference.close()
        assert engine.state().state == "DEGRADED" and engine.state().devices == ("cpu",)
        await engine.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("backend", ["onnxruntime", "torchscript"])
def test_engine_serves_a_real_model_on_cpu_with_warm_up(digits_repo: Path, tmp_path: Path, backend: str) -> None:
    root = tmp_path / "repo"
    shutil.copytree(digits_repo, root)
    (root / "digits" / "config.toml").write_text(f'backend = "{backend}"\nmax_batch_size = 8\n')
    entry = ModelRepository(root).model("digits")

    async def scenario() -> None:
        engine = ModelEngine(entry.latest, entry.config, available_gpus=[])
        state = engine.state()
        assert state.backend == backend and state.devices == ("cpu",) and state.state == "READY"
        assert state.note == "device auto: no usable GPU, serving on CPU"
        batch = np.random.default_rng(1).integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
        result = await engine.submit(InferRequest(request_id="x", model="digits", images=batch))
        assert result.logits.shape == (3, 10) and result.errors == [None] * 3
        await engine.close()

    asyncio.run(scenario())


def test_the_precision_reported_is_the_one_the_instances_run(tmp_path: Path) -> None:
    """precision = "fp16" with only an fp32 ONNX graph runs fp32 (a graph cannot be cast at load): its state, hence
    metadata and metrics, say fp32, not what the config asked for."""
    from service.runtime.factory import served_precision

    version = _version(tmp_path)
    fp16 = tmp_path / "model.fp16.onnx"
    assert served_precision(version, "onnxruntime", tmp_path / "model.onnx", "fp16") == "fp32"
    assert served_precision(version, "onnxruntime", tmp_path / "model.onnx", "bf16") == "fp32"
    assert served_precision(version, "torchscript", tmp_path / "model.pt", "fp16") == "fp16"  # cast at load
    with_fp16 = ModelVersion(model="fake", version=1, path=tmp_path, spec=SPEC, files={}, fp16_files={"onnx": fp16})
    assert served_precision(with_fp16, "onnxruntime", fp16, "fp16") == "fp16"

    def factory(device: str) -> Any:
        runtime = FakeRuntime(SPEC, device=device)
        runtime.precision = "fp32"  # what make_runtime gives an fp32 graph asked to serve fp16
        return runtime

    engine = ModelEngine(version, ModelConfig(device="cuda", precision="fp16", warmup=False), factory=factory,
                         available_gpus=["cuda:0"])  # fmt: skip
    assert engine.state().precision == "fp32"
    asyncio.run(engine.close())
