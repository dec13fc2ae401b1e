"""The runtimes: onnxruntime and TorchScript agree, run on their own thread, and refuse bad batches."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_checkpoint
from models.datasets import load_dataset
from service.core.errors import BadInputError, RuntimeFailure
from service.core.repository import ModelRepository
from service.runtime import OnnxRuntime, TorchScriptRuntime, bucket_sizes


@pytest.fixture(scope="module")
def version(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("repo")
    source = from_checkpoint(digits_checkpoint)
    export_model(source.eager, source.spec, ExportRequest(name="digits", repository=str(root), latency=False))
    return ModelRepository(root).model("digits").latest


def test_onnxruntime_and_torchscript_give_the_same_top1_on_real_digits(version) -> None:  # type: ignore[no-untyped-def]
    data = load_dataset("digits", version.spec)
    batch = data.val_images.numpy()
    ort_rt = OnnxRuntime(version.spec, version.files["onnx"])
    ts_rt = TorchScriptRuntime(version.spec, version.files["torchscript"], max_batch_size=len(batch))
    try:
        a, b = ort_rt.run(batch), ts_rt.run(batch)
    finally:
        ort_rt.close()
        ts_rt.close()
    assert (a.argmax(1) == b.argmax(1)).all()
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert (a.argmax(1) == data.val_targets.numpy()).mean() > 0.7


def test_a_runtime_loads_and_runs_on_its_own_worker_thread(version) -> None:  # type: ignore[no-untyped-def]
    seen: list[int] = []

    class Watched(TorchScriptRuntime):
        def _load(self) -> None:
            seen.append(threading.get_ident())
            super()._load()

        def _forward(self, batch: np.ndarray) -> np.ndarray:
            seen.append(threading.get_ident())
            return super()._forward(batch)

    rt = Watched(version.spec, version.files["torchscript"])
    rt.run(np.zeros((2, 3, 32, 32), np.uint8))
    rt.close()
    assert len(set(seen)) == 1 and seen[0] != threading.get_ident()


def test_bad_batches_are_refused_and_a_closed_runtime_says_so(version) -> None:  # type: ignore[no-untyped-def]
    rt = OnnxRuntime(version.spec, version.files["onnx"])
    with pytest.raises(BadInputError, match=r"uint8 \[N, 3, 32, 32\]"):
        rt.run(np.zeros((2, 3, 28, 28), np.uint8))
    with pytest.raises(BadInputError):
        rt.run(np.zeros((2, 3, 32, 32), np.float32))
    rt.close()
    with pytest.raises(RuntimeFailure, match="closed"):
        rt.run(np.zeros((1, 3, 32, 32), np.uint8))


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(24) == [1, 2, 4, 8, 16, 24]


def test_onnxruntimes_cuda_libraries_are_preloaded_once_and_a_failure_is_only_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """onnxruntime-gpu's CUDA provider finds CUDA and cuDNN only once something loaded them (importing torch did):
    preload_dlls() before the first CUDA session, once per process; a failure leaves the provider to refuse, which
    the engine turns into its observable CPU fallback."""
    from service.runtime import onnxrt

    calls: list[int] = []

    class Ort:
        __version__ = "1.31.1"

        @staticmethod
        def preload_dlls() -> None:
            calls.append(1)
            raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(onnxrt, "_preloaded", [])
    assert onnxrt.preload_cuda_libraries(Ort) is False
    assert onnxrt.preload_cuda_libraries(Ort) is False and calls == [1]  # once per process
    assert "preload_dlls() failed: libcudnn.so.9" in caplog.text
    monkeypatch.setattr(onnxrt, "_preloaded", [])
    monkeypatch.setattr(Ort, "preload_dlls", staticmethod(lambda: calls.append(2)))
    assert onnxrt.preload_cuda_libraries(Ort) is True and calls == [1, 2]
