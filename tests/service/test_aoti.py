"""The AOTInductor path: export behind the parity gate, the runtime (same seam as the others), the repository,
config and ``backend = "auto"``. The package is compiled once per session (tests/service/conftest.py)."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from export.exporter import ExportReport
from export.sources import from_checkpoint
from models.datasets import load_dataset
from service.core.config import ModelConfig, parse_config
from service.core.errors import BadInputError, ConfigError, RuntimeFailure
from service.core.repository import ModelRepository, random_batch
from service.runtime import PREFERENCE, AotiRuntime, OnnxRuntime, artifact, choose_backend, make_runtime


def test_aoti_passes_the_parity_gate_on_real_digits(aoti_export: ExportReport) -> None:
    by_format = {a.format: a for a in aoti_export.artifacts}
    assert set(by_format) == {"onnx", "torchscript", "aoti"}  # no GPU here: no model.cuda.pt2
    aoti = by_format["aoti"]
    assert aoti.file == "model.pt2" and aoti.written and aoti.parity.checked
    assert aoti.parity.max_rel_error <= 1e-4 and aoti.parity.top1_agreement == 1.0
    assert aoti.parity.images > 300  # the validation split, not only random batches
    record = next(e for e in aoti_export.spec.exports if e.format == "aoti")  # type: ignore[union-attr]
    assert record.file == "model.pt2" and record.opset is None and record.parity_max_rel_error is not None


def test_the_runtime_matches_eager_at_every_batch_size_on_its_own_thread(
    aoti_repo: Path, digits_checkpoint: Path
) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    assert version.files["aoti"].name == "model.pt2"
    eager = from_checkpoint(digits_checkpoint).eager
    seen: list[int] = []

    class Watched(AotiRuntime):
        def _forward(self, batch: np.ndarray) -> np.ndarray:
            seen.append(threading.get_ident())
            return super()._forward(batch)

    runtime = Watched(version.spec, version.files["aoti"], max_batch_size=64)
    try:
        for n in (1, 3, 64, 200):  # the batch dimension is dynamic, past the runtime's bucket sizes too
            batch = random_batch(version.spec, n, seed=n)
            with torch.inference_mode():
                expected = eager(torch.from_numpy(batch)).numpy()
            np.testing.assert_allclose(runtime.run(batch), expected, rtol=1e-4, atol=1e-4)
        data = load_dataset("digits", version.spec)
        images = list(data.val_images.numpy()[:40])  # a list is stacked on the worker, as the batcher sends it
        got = runtime.submit(images).result()
        assert (got.argmax(1) == data.val_targets.numpy()[:40]).mean() > 0.7
        with pytest.raises(BadInputError, match=r"uint8 \[N, 3, 32, 32\]"):
            runtime.run(np.zeros((2, 3, 28, 28), np.uint8))
    finally:
        runtime.close()
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()
    with pytest.raises(RuntimeFailure, match="closed"):
        runtime.run(random_batch(version.spec, 1))


def test_aoti_onnxruntime_and_eager_agree_on_real_digits(aoti_repo: Path) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    batch = load_dataset("digits", version.spec).val_images.numpy()
    a, b = AotiRuntime(version.spec, version.files["aoti"]), OnnxRuntime(version.spec, version.files["onnx"])
    try:
        np.testing.assert_allclose(a.run(batch), b.run(batch), rtol=1e-4, atol=1e-4)
    finally:
        a.close()
        b.close()


def test_config_takes_backend_aoti_and_names_it_when_refusing() -> None:
    assert parse_config({"backend": "aoti"}, source="x/config.toml").backend == "aoti"
    with pytest.raises(ConfigError, match=r"backend must be auto, onnxruntime, torchscript or aoti, got 'trt'"):
        parse_config({"backend": "trt"}, source="x/config.toml")


def test_auto_picks_the_measured_fastest_per_device_among_the_files_present(aoti_repo: Path, tmp_path: Path) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    auto = ModelConfig(device="cpu")
    assert choose_backend(version, auto) == PREFERENCE["cpu"][0]
    assert choose_backend(version, auto, "cpu") == PREFERENCE["cpu"][0]
    # On CUDA a CPU package does not count: without model.cuda.pt2 the next in CUDA's order is taken.
    cuda_order = [b for b in PREFERENCE["cuda"] if b != "aoti"]
    assert choose_backend(version, ModelConfig(device="cuda"), "cuda:0") == cuda_order[0]
    assert artifact(version, "aoti", "cuda:0") is None and artifact(version, "aoti", "cpu") == version.files["aoti"]

    # Only model.onnx: onnxruntime, whatever the device (and no GPU probe is needed to say so).
    only_onnx = tmp_path / "repo" / "digits" / "1"
    only_onnx.mkdir(parents=True)
    for name in ("model.onnx", "spec.json"):
        shutil.copy(version.path / name, only_onnx / name)
    onnx_version = ModelRepository(tmp_path / "repo").model("digits").latest
    assert choose_backend(onnx_version, ModelConfig(device="cuda")) == "onnxruntime"
    with pytest.raises(ConfigError, match=r"backend aoti asked for, but .* has no model.pt2 or model.cuda.pt2"):
        choose_backend(onnx_version, ModelConfig(backend="aoti"))


def test_a_cuda_runtime_of_a_cpu_only_package_is_refused_before_loading(aoti_repo: Path) -> None:
    version = ModelRepository(aoti_repo).model("digits").latest
    config = ModelConfig(backend="aoti", device="cuda")
    with pytest.raises(ConfigError, match=r"no artifact .* for cuda:0 .*model.cuda.pt2"):
        make_runtime(version, config, "aoti", "cuda:0")
    with pytest.raises(ConfigError, match="bf16 has no AOTInductor package"):
        AotiRuntime(version.spec, version.files["aoti"], precision="bf16", device="cuda:0")
    # An explicit backend that has its file for the CPU still loads there (the CPU fallback of a GPU model).
    make_runtime(version, config, "aoti", "cpu").close()


def test_the_repository_refuses_a_truncated_package(aoti_repo: Path, tmp_path: Path) -> None:
    src = aoti_repo / "digits" / "1"
    dst = tmp_path / "repo" / "digits" / "1"
    dst.mkdir(parents=True)
    shutil.copy(src / "spec.json", dst / "spec.json")
    data = (src / "model.pt2").read_bytes()
    (dst / "model.pt2").write_bytes(data[: len(data) // 2])
    index = ModelRepository(tmp_path / "repo").scan()
    assert "digits" in index.errors and "model.pt2 is truncated or not an AOTInductor package" in index.errors["digits"]
