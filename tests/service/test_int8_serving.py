"""Serving INT8: ``precision = "int8"`` serves model.int8.onnx through a real server, metadata, /metrics and the log
say so (and that it was written ungated), and a model without the artifact is refused at load with a clear message.

The served model is written with ``--int8-ungated`` (calibrated on the real digits training split all the same), so
that the fixture does not depend on how a brief training run on this machine fares at the gate; the gate itself is
tested in tests/export/test_int8.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from export import calibration
from export.exporter import ExportRequest, export_model
from export.sources import from_checkpoint
from service.core.preprocess import preprocess_image
from service.core.spec import load_spec
from service.runtime import OnnxRuntime
from tests.conftest import encode_image, random_image
from tests.http.conftest import ADMIN_TOKEN, RunningServer, start_server, stop_server

INT8_CONFIG = 'precision = "int8"\nmax_batch_size = 8\n'


@pytest.fixture(scope="module")
def int8_repo(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``digits`` (model.onnx and model.int8.onnx) and ``missing`` (model.onnx only), both configured for int8."""
    root = tmp_path_factory.mktemp("int8repo")
    source = from_checkpoint(digits_checkpoint)
    for name, int8 in (("digits", True), ("missing", False)):
        request = ExportRequest(
            name=name, repository=str(root), formats=("onnx",), latency=False, int8=int8, int8_ungated=int8
        )
        export_model(
            source.eager, source.spec, request, int8_data=lambda spec: calibration.from_dataset("digits", spec)
        )
        (root / name / "config.toml").write_text(INT8_CONFIG)
    return root


@pytest.fixture(scope="module")
def int8_server(int8_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    log = tmp_path_factory.mktemp("int8logs") / "server.log"
    running = start_server(int8_repo, log, "--admin-token", ADMIN_TOKEN, real_models=("digits", "missing"))
    yield running
    stop_server(running)


def test_int8_model_answers_classify_and_says_int8(int8_server: RunningServer, int8_repo: Path) -> None:
    png = encode_image(random_image(48, 40, seed=3))
    answer = httpx.post(
        f"{int8_server.url}/v1/models/digits/classify?top_k=1",
        content=png,
        headers={"Content-Type": "image/png"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    # The same answer as model.int8.onnx run here on the same preprocessed image: the int8 artifact served it.
    version = int8_repo / "digits" / "1"
    spec = load_spec(version / "spec.json")
    runtime = OnnxRuntime(spec, version / "model.int8.onnx")
    try:
        logits = runtime.run(preprocess_image(png, spec)[np.newaxis])
    finally:
        runtime.close()
    assert spec.labels[int(logits.argmax())] in answer.text

    state = httpx.get(f"{int8_server.url}/v2/models/digits", timeout=10).json()["parameters"]
    assert state["precision"] == "int8" and state["backend"] == "onnxruntime" and state["devices"] == "cpu"
    assert state["ungated"] is True
    metrics = httpx.get(f"{int8_server.url}/metrics", timeout=10).text
    info = [line for line in metrics.splitlines() if line.startswith("visionserve_model_info{")]
    assert any('model="digits"' in line and 'precision="int8-ungated"' in line for line in info), info
    assert "written with --int8-ungated" in int8_server.log.read_text()


def test_int8_without_the_artifact_is_refused_at_load(int8_server: RunningServer) -> None:
    assert httpx.get(f"{int8_server.url}/v2/models/missing/ready", timeout=10).status_code != 200
    log = int8_server.log.read_text()
    assert 'precision = "int8" asked for, but' in log and "has no model.int8.onnx" in log
    assert "export it with `visionserve export ... --int8`" in log


def test_bench_measures_int8(int8_repo: Path) -> None:
    from service.bench.engine import BenchOptions, run_bench

    options = BenchOptions(
        model="digits", repository=str(int8_repo), device="cpu", precision="int8", batch_sizes=(1, 4), seconds=0.1,
        figures=("engine",),
    )  # fmt: skip
    result = run_bench(options)
    assert result["precision"] == "int8" and result["runtime"] == "onnxruntime"
    assert set(result["engine_images_per_s"]) == {"1", "4"} and min(result["engine_images_per_s"].values()) > 0


def test_int8_config_and_cuda_providers() -> None:
    from service.core.config import parse_config
    from service.core.errors import ConfigError
    from service.runtime.onnxrt import int8_cuda_providers

    assert parse_config({"precision": "int8", "device": "cpu"}, source="t").precision == "int8"
    with pytest.raises(ConfigError, match="precision fp16 needs a GPU"):
        parse_config({"precision": "fp16", "device": "cpu"}, source="t")
    with pytest.raises(ConfigError, match="TensorRT or CUDA execution provider"):
        int8_cuda_providers(["CPUExecutionProvider"], 0, Path("model.int8.onnx"))
    providers = int8_cuda_providers(["TensorrtExecutionProvider", "CUDAExecutionProvider"], 1, Path("m"))
    assert [p[0] if isinstance(p, tuple) else p for p in providers] == [
        "TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider",
    ]  # fmt: skip
