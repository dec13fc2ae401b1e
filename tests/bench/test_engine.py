"""``visionserve bench --json`` (the engine) prints every promised figure (a smoke run; the numbers live in docs/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    source = from_architecture("smallcnn")
    export_model(source.eager, source.spec, ExportRequest(name="tiny", repository=str(root), latency=False))
    return root


def test_bench_json_has_every_figure(repo: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "--model", "tiny", "--repository", str(repo),
         "--batch-sizes", "1,4", "--seconds", "0.1", "--json", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["device"] == "cpu" and result["runtime"] == "onnxruntime"
    assert set(result["engine_images_per_s"]) == {"1", "4"}
    for key in ("pipeline_images_per_s", "batcher_images_per_s", "batcher_efficiency", "fake_items_per_s"):
        assert result[key] > 0, key
    assert result["batcher_efficiency"] == pytest.approx(
        result["batcher_images_per_s"] / result["pipeline_images_per_s"]
    )


def test_bench_compares_the_three_runtimes_in_one_run(aoti_repo: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "--model", "digits", "--repository", str(aoti_repo),
         "--backend", "onnxruntime,torchscript,aoti", "--figures", "engine,decode", "--batch-sizes", "1,4",
         "--seconds", "0.1", "--device", "cpu", "--json", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [r["runtime"] for r in result["runs"]] == ["onnxruntime", "torchscript", "aoti"]
    for run in result["runs"]:
        assert set(run["engine_images_per_s"]) == {"1", "4"} and run["decode_cpu_images_per_s"] > 0
        assert "pipeline_images_per_s" not in run and run["decode_gpu_skipped"] == "no CUDA device"
    assert set(result["fastest"]) == {"1", "4"} and set(result["fastest"].values()) <= {
        "onnxruntime",
        "torchscript",
        "aoti",
    }
    for size, best in result["fastest"].items():
        assert result["ratio_to_fastest"][best][size] == 1.0
        assert all(0 < r[size] <= 1.0 for r in result["ratio_to_fastest"].values())


def test_bench_refuses_an_unknown_backend() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", "--model", "x", "--backend", "onnxruntime,tensorrt"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and "onnxruntime, torchscript, aoti" in proc.stderr
