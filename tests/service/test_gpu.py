"""CUDA paths, run for real wherever a GPU is at hand (skipped without one)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture
from service.core.config import ModelConfig
from service.core.errors import DeviceFailure
from service.core.repository import ModelRepository, random_batch
from service.engine import InferRequest
from service.engine.model import ModelEngine
from service.runtime import AotiRuntime, TorchScriptRuntime

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
    import onnxruntime as ort

    spec = ModelRepository(resnet).model("r18").latest.spec
    fp16 = {e.format: e for e in spec.exports if e.precision == "fp16"}
    assert set(fp16) == {"onnx", "torchscript"}
    checked = fp16 if "CUDAExecutionProvider" in ort.get_available_providers() else {"torchscript": fp16["torchscript"]}
    assert all(e.parity_max_rel_error is not None and e.parity_max_rel_error <= 2e-2 for e in checked.values())
    if "onnx" not in checked:  # a CPU build of onnxruntime beside CUDA torch: written, said to be unchecked
        assert fp16["onnx"].parity_max_rel_error is None
        assert fp16["onnx"].parity_checked_on == "onnxruntime here has no CUDA execution provider"


@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_torchscript_cuda_graphs_match_the_cpu(resnet: Path, precision: str) -> None:
    version = ModelRepository(resnet).model("r18").latest
    cpu = TorchScriptRuntime(version.spec, version.files["torchscript"], max_batch_size=8)
    gpu = TorchScriptRuntime(
        version.spec, version.files["torchscript"], device="cuda", precision=precision, max_batch_size=8
    )
    try:
        assert sorted(gpu.graphs) == [1, 2, 4, 8]
        # The static input has the pinned host buffer's layout: the copy in is one memcpy (the channels-last
        # transpose runs inside the graph, not through a temporary outside it).
        assert all(static_in.is_contiguous() for _, static_in, _ in gpu.graphs.values())
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


@pytest.fixture(scope="module")
def small_cuda_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """smallcnn as every artifact, AOTInductor compiled for CUDA in fp32 and fp16 (each gated on the GPU)."""
    root = tmp_path_factory.mktemp("cuda-repo")
    source = from_architecture("smallcnn")
    request = ExportRequest(
        name="tiny", repository=str(root), formats=("onnx", "torchscript", "aoti"), fp16=True, latency=False
    )
    report = export_model(source.eager, source.spec, request)
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    return root


def test_aoti_packages_for_cuda_pass_parity_and_match_the_cpu(small_cuda_repo: Path) -> None:
    version = ModelRepository(small_cuda_repo).model("tiny").latest
    assert {"aoti", "aoti-cuda"} <= set(version.files) and "aoti-cuda" in version.fp16_files
    cpu = AotiRuntime(version.spec, version.files["aoti"], max_batch_size=8)
    runs = [
        AotiRuntime(version.spec, version.files["aoti-cuda"], device="cuda", max_batch_size=8),
        AotiRuntime(version.spec, version.files["aoti-cuda"], device="cuda", max_batch_size=8, cuda_graphs=False),
        AotiRuntime(version.spec, version.fp16_files["aoti-cuda"], device="cuda", precision="fp16", max_batch_size=8),
    ]
    try:
        assert sorted(runs[0].graphs) == [1, 2, 4, 8] and not runs[1].graphs
        for n in (1, 3, 8):
            batch = random_batch(version.spec, n, seed=n)
            a = cpu.run(batch)
            scale = np.abs(a).max(axis=1, keepdims=True)
            for runtime, tolerance in zip(runs, (1e-3, 1e-3, 5e-2), strict=True):
                assert (np.abs(a - runtime.run(batch)) / scale).max() < tolerance
    finally:
        for runtime in (cpu, *runs):
            runtime.close()


def test_auto_on_cuda_serves_the_cuda_package_and_the_cpu_fallback_the_cpu_one(small_cuda_repo: Path) -> None:
    from service.runtime import PREFERENCE, choose_backend, make_runtime

    version = ModelRepository(small_cuda_repo).model("tiny").latest
    config = ModelConfig(device="cuda", max_batch_size=4)
    assert choose_backend(version, config, "cuda:0") == PREFERENCE["cuda"][0]
    for device in ("cuda:0", "cpu"):
        runtime = make_runtime(version, config, choose_backend(version, config, device), device)
        try:
            assert runtime.device == device and runtime.run(random_batch(version.spec, 3)).shape == (3, 10)
        finally:
            runtime.close()


def test_torchscript_fp16_artifact_runs_as_exported(small_cuda_repo: Path) -> None:
    version = ModelRepository(small_cuda_repo).model("tiny").latest
    rt = TorchScriptRuntime(
        version.spec, version.fp16_files["torchscript"], device="cuda", precision="fp16", max_batch_size=4
    )
    try:
        assert rt.amp_dtype is None  # the artifact is already fp16: no autocast over it
        assert rt.run(random_batch(version.spec, 2)).dtype == np.float32
    finally:
        rt.close()


def test_onnxruntime_cuda_io_binding_matches_the_cpu(small_cuda_repo: Path) -> None:
    import onnxruntime as ort

    from service.runtime import OnnxRuntime

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime has no CUDA execution provider here (a CPU build of onnxruntime is installed)")
    version = ModelRepository(small_cuda_repo).model("tiny").latest
    cpu = OnnxRuntime(version.spec, version.files["onnx"])
    gpu = OnnxRuntime(version.spec, version.files["onnx"], device="cuda:0")
    try:
        for n in (1, 5, 32):  # one binding, every batch size
            batch = random_batch(version.spec, n, seed=n)
            np.testing.assert_allclose(gpu.run(batch), cpu.run(batch), rtol=1e-3, atol=1e-3)
    finally:
        cpu.close()
        gpu.close()


def test_nvjpeg_on_a_mixed_batch_keeps_each_image_its_own() -> None:
    import io

    from PIL import Image

    from service.core.decoding import GpuJpegDecoder, Preprocessor
    from service.core.errors import BadInputError
    from tests.conftest import encode_image, random_image

    spec = from_architecture("resnet18").spec
    cpu = Preprocessor(spec, workers=2)
    gpu = GpuJpegDecoder(spec, "cuda")
    rgb = random_image(300, 400, seed=1)
    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, format="JPEG", quality=95)
    baseline = encode_image(rgb, "JPEG", quality=95)
    files = [
        baseline,
        encode_image(rgb, "JPEG", quality=95, progressive=True),
        cmyk.getvalue(),
        encode_image(rgb[:, :, 0], "JPEG", quality=95),  # grayscale
        baseline[: len(baseline) // 2],  # truncated
        encode_image(rgb, "PNG"),
    ]
    on_gpu, on_cpu = gpu.decode_many(files, cpu), cpu.decode_many(files)
    for i in (0, 1, 2, 3, 5):
        a, b = on_gpu[i], on_cpu[i]
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), i
        assert np.abs(a.astype(float) - b.astype(float)).mean() < 4.0, i
    assert isinstance(on_gpu[4], BadInputError) and isinstance(on_cpu[4], BadInputError)
    cpu.close()
