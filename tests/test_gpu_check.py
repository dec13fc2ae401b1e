"""`make gpu-check DRY_RUN=1`: the GPU proof's steps run end to end on the CPU with tiny sizes, so the command a
person with a GPU runs first cannot rot between GPUs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("environment", "install", "gpu_tests", "export", "bench", "decode", "serve_loadtest", "train")


def test_only_missing_packages_are_installed_and_never_the_machines_own() -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    names = ["torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_cudnn_cu13-9.1-py3-none-any.whl",
             "onnx_ir-1.1.0-py3-none-any.whl", "scikit_learn-1.9.1-cp312-cp312-manylinux_2_27_x86_64.whl",
             "litestar-2.25.0-py3-none-any.whl", "onnx-1.23.2-cp312-cp312-manylinux_2_28_x86_64.whl"]  # fmt: skip
    chosen, refused = gpu_check.choose_wheels([Path(n) for n in names], {"onnx-ir", "scikit-learn", "torch"})
    assert [w.name for w in chosen] == [names[2], names[3]]  # litestar is there already: not reinstalled
    assert [w.name for w in refused] == [names[0], names[1], names[5]]


@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_reports_each(tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--wheels", str(tmp_path / "none"),
         "--site", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert proc.returncode == 0, (proc.stderr[-3000:], report["errors"])
    assert report["errors"] == {} and report["gpu_tests_failed"] is False
    assert set(report["sections"]) == set(SECTIONS), report["skipped"]
    sections = report["sections"]

    env = sections["environment"]
    assert env["cuda_available"] is False and env["torch"] and env["onnxruntime"]
    assert sections["gpu_tests"]["failed"] == 0 and sections["gpu_tests"]["skipped"] > 0  # collected, skipped on CPU
    assert set(sections["export"]["files_mb"]) == {"model.onnx", "model.pt", "model.pt2"}

    bench = sections["bench"]
    measured = {run["backend"] for run in bench["runs"] if "engine_images_per_s" in run}
    assert measured == {"onnxruntime", "torchscript", "aoti"}
    for run in bench["runs"]:
        assert set(run["engine_images_per_s"]) == {"1", "4"} and min(run["engine_images_per_s"].values()) > 0
    reasons = {(s["backend"], s["precision"], s["cuda_graphs"]): s["reason"] for s in bench["skipped"]}
    assert "GPU-only" in reasons[("torchscript", "bf16", True)] and "bf16" in reasons[("aoti", "bf16", True)]

    decode = sections["decode"]
    assert decode["decode_cpu_images_per_s"] > 0 and decode["decode_gpu_skipped"] == "no CUDA device"

    served = sections["serve_loadtest"]
    assert [s["concurrency"] for s in served["closed"]] == [1, 2]
    assert all(s["requests"] > 0 and not s["errors"] for s in served["closed"])
    assert served["slo"]["target_p99_ms"] == 15.0 and served["slo"]["tried"]

    train = sections["train"]
    assert "validation accuracy" in train["single"]["result"] and "two or more" not in train["ddp"]["skipped"]
    assert report["skipped"]["train.ddp"] == "no CUDA device"

    markdown = (out / "report.md").read_text()
    for name in SECTIONS:
        assert f"## {name}" in markdown
    assert "| runtime | precision | CUDA graphs |" in markdown and "skipped torchscript fp16" in markdown
