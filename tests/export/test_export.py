"""Export: artifacts with proven parity, a parity gate that refuses a broken wrapper, the repository entry."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import onnx
import pytest
import torch

from export.exporter import ExportRequest, export_model, export_source
from export.sources import Source, calibration_images, from_architecture, from_checkpoint
from models.normalize import Uint8Classifier
from models.registry import architecture_names, get_architecture
from service.core.errors import ConfigError
from service.core.repository import ModelRepository, random_batch
from service.core.spec import load_spec
from service.runtime import OnnxRuntime, TorchScriptRuntime
from service.runtime.onnxrt import runnable_device
from tests.conftest import encode_image, random_image
from tests.test_cli import in_process


def _request(repo: Path, name: str, **kw: object) -> ExportRequest:
    return ExportRequest(name=name, repository=str(repo), latency=False, **kw)  # type: ignore[arg-type]


def _assert_parity_recorded(version_dir: Path, formats: set[str]) -> None:
    spec = load_spec(version_dir / "spec.json")
    assert {e.format for e in spec.exports} == formats
    for record in spec.exports:
        assert record.parity_max_rel_error is not None and record.parity_max_rel_error <= 1e-4
        assert record.parity_top1_agreement == 1.0
        assert record.versions["torch"] == str(torch.__version__)
        assert (version_dir / record.file).is_file()


def test_trained_smallcnn_exports_with_parity_on_real_digits(digits_checkpoint: Path, tmp_path: Path) -> None:
    source = from_checkpoint(digits_checkpoint)
    assert source.real_images is not None and len(source.real_images) > 300  # the validation split
    report = export_source(source, _request(tmp_path, "digits"))
    assert report.ok and report.version == 1
    version_dir = tmp_path / "digits" / "1"
    _assert_parity_recorded(version_dir, {"onnx", "torchscript"})
    assert (tmp_path / "digits" / "config.toml").is_file()
    spec = load_spec(version_dir / "spec.json")
    assert spec.exports[0].source_sha256 == source.sha256 and spec.labels == source.spec.labels
    assert "validation images of digits" in (spec.exports[0].parity_checked_on or "")

    model = onnx.load(str(version_dir / "model.onnx"))
    onnx.checker.check_model(model, full_check=True)
    assert model.opset_import[0].version == 20
    entry = ModelRepository(tmp_path).model("digits")
    assert entry.latest.files.keys() == {"onnx", "torchscript"}

    # Dynamic batch: any size from 1 to 256, the same answers from both formats and eager.
    for runtime_cls in (OnnxRuntime, TorchScriptRuntime):
        runtime = runtime_cls(spec, entry.latest.files["onnx" if runtime_cls is OnnxRuntime else "torchscript"])
        try:
            for n in (1, 3, 256):
                batch = random_batch(spec, n, seed=n)
                with torch.inference_mode():
                    expected = source.eager(torch.from_numpy(batch)).numpy()
                np.testing.assert_allclose(runtime.run(batch), expected, rtol=1e-4, atol=1e-4)
        finally:
            runtime.close()

    # Without --version the next free version is written.
    again = export_model(source.eager, source.spec, _request(tmp_path, "digits", formats=("onnx",)))
    assert again.version == 2 and (tmp_path / "digits" / "2" / "model.onnx").is_file()
    with pytest.raises(ConfigError, match="already exists"):
        export_model(source.eager, source.spec, _request(tmp_path, "digits", version=1))


def test_resnet18_exports_in_both_formats_with_parity(tmp_path: Path) -> None:
    source = from_architecture("resnet18")
    report = export_model(source.eager, source.spec, _request(tmp_path, "resnet18", max_batch_size=8))
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    _assert_parity_recorded(tmp_path / "resnet18" / "1", {"onnx", "torchscript"})
    spec = load_spec(tmp_path / "resnet18" / "1" / "spec.json")
    assert spec.num_classes == 1000 and spec.input.height == 224


def test_a_broken_wrapper_is_refused_by_the_parity_gate(tmp_path: Path) -> None:
    source = from_architecture("smallcnn")
    network = source.eager.get_submodule("network")
    wrong_std = tuple(s * 1.01 for s in source.spec.std)  # a 1% normalisation slip
    broken = Uint8Classifier(network, source.spec.mean, wrong_std)
    report = export_model(source.eager, source.spec, _request(tmp_path, "broken"), artifact_model=broken)
    assert not report.ok
    for artifact in report.artifacts:
        assert not artifact.parity.passed and not artifact.written
        assert artifact.parity.max_rel_error > 1e-3  # the report says by how much
        assert "FAIL" in artifact.parity.describe()
    assert not (tmp_path / "broken").exists()  # nothing was written


def test_calibration_images_are_used_for_parity(tmp_path: Path) -> None:
    folder = tmp_path / "calib"
    folder.mkdir()
    for i in range(5):
        (folder / f"{i}.jpg").write_bytes(encode_image(random_image(80, 100, seed=i), "JPEG"))
    source = from_architecture("smallcnn")
    images = calibration_images(folder, source.spec)
    assert images.shape == (5, 3, 32, 32)
    report = export_model(
        source.eager, source.spec, _request(tmp_path / "repo", "s", formats=("onnx",)), real_images=images,
        real_source="5 calibration images",
    )  # fmt: skip
    assert report.ok and report.artifacts[0].parity.images == 5 + 1 + 7 + 32


def test_fp16_variants_are_written_and_reported_unchecked_without_a_gpu(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("with a GPU the fp16 parity is checked for real (test_gpu)")
    source = from_architecture("smallcnn")
    report = export_model(source.eager, source.spec, _request(tmp_path, "s", fp16=True))
    fp16 = [a for a in report.artifacts if a.precision == "fp16"]
    assert {a.file for a in fp16} == {"model.fp16.onnx", "model.fp16.pt"}
    assert all(not a.parity.checked and "no GPU" in a.parity.describe() for a in fp16)
    spec = load_spec(tmp_path / "s" / "1" / "spec.json")
    assert {e.file for e in spec.exports if e.precision == "fp16"} == {"model.fp16.onnx", "model.fp16.pt"}
    assert ModelRepository(tmp_path).model("s").latest.fp16_files.keys() == {"onnx", "torchscript"}


# every registered classifier (tests/models/test_registry.py pins which ones those are); the detector, whose gate is
# another, has its own tests below
ZOO = [name for name in architecture_names() if get_architecture(name).task == "classify"]
# The smallest square input each one takes: the registry's floor of 8, but ConvNeXt's 4x4 stem and three 2x2
# downsamplings need 32. The exporter, the graph and the gate are the same at any size; only the arithmetic shrinks.
SMALLEST_INPUT = {"convnext_tiny": 32}


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_every_zoo_model_exports_to_both_formats(name: str, tmp_path: Path) -> None:
    source = from_architecture(name, input_size=SMALLEST_INPUT.get(name, 8))
    # A largest batch of 8 gives the gate its fewest images: batches of 1, 7 and 8 reach MIN_RANDOM_IMAGES (16).
    report = export_model(source.eager, source.spec, _request(tmp_path, name, max_batch_size=8))
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    _assert_parity_recorded(tmp_path / name / "1", {"onnx", "torchscript"})


def _detector(input_size: int = 32) -> Source:
    """digitdet at a small input, made to answer as a trained one does (seeded). Initial weights put every score near
    the 0.1 prior, so neighbouring peaks tie to float error, which no trained detector does and no gate should be
    asked to settle, and every box near zero size: the class heatmaps' weights widened spread the scores, and a
    size bias of 3 cells gives boxes of about 12 pixels."""
    source = from_architecture("digitdet", input_size=input_size)
    out = source.eager.get_submodule("network.out")
    torch.manual_seed(1)
    with torch.no_grad():
        torch.nn.init.normal_(out.weight[:10], std=0.5)
        out.bias[10:12] = 3.0
    return source


def test_a_detector_exports_with_its_detection_parity_gate(tmp_path: Path) -> None:
    """Replaces the refusal that stood until this gate existed (test_a_detector_is_refused_until_its_parity_gate_
    exists): both formats pass, and spec.json records the gate's figures, not the classifier's."""
    source = _detector()
    report = export_model(source.eager, source.spec, _request(tmp_path, "det", max_batch_size=8))
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    version_dir = tmp_path / "det" / "1"
    spec = load_spec(version_dir / "spec.json")
    assert spec.task == "detect" and {e.format for e in spec.exports} == {"onnx", "torchscript"}
    for record in spec.exports:
        gate = record.detection_parity
        assert gate is not None and record.parity_max_rel_error is None and record.parity_top1_agreement is None
        assert gate.images == 1 + 7 + 8 and gate.boxes > 100 and gate.unmatched == 0 and gate.class_agreement == 1.0
        assert gate.min_iou >= 0.99 and gate.max_score_error <= gate.max_score_error_limit == 1e-4
    assert [o.name for o in onnx.load(str(version_dir / "model.onnx")).graph.output] == ["candidates"]
    assert "boxes matched at IoU >= 0.99" in report.artifacts[0].parity.describe()


def test_a_perturbed_detector_artifact_is_refused_by_the_detection_gate(tmp_path: Path) -> None:
    source = _detector()
    network = source.eager.get_submodule("network")
    wrong_std = tuple(s * 1.01 for s in source.spec.std)  # a 1% normalisation slip
    broken = Uint8Classifier(network, source.spec.mean, wrong_std)
    report = export_model(source.eager, source.spec, _request(tmp_path, "det", max_batch_size=8), artifact_model=broken)
    assert not report.ok
    for artifact in report.artifacts:
        assert not artifact.parity.passed and not artifact.written and "FAIL" in artifact.parity.describe()
        assert artifact.parity.max_rel_error > 1e-3, artifact.parity.describe()  # the report says by how much
    assert not (tmp_path / "det").exists()


def test_the_detection_gate_matches_boxes_one_to_one_beyond_the_margin() -> None:
    from export.detect_parity import DETECT_FP32, match_image

    def rows(*boxes: tuple[float, ...]) -> np.ndarray:
        out = np.zeros((6, 6), np.float32)  # K = 6: the rest score 0, under the cut
        out[: len(boxes)] = boxes
        return out

    eager = rows((10, 10, 30, 30, 0.9, 3), (10, 10, 30, 30, 0.4, 5), (50, 50, 60, 70, 0.3, 1), (0, 0, 9, 9, 0.0505, 2))
    same = match_image(eager, eager[[1, 0, 2, 3, 4, 5]], DETECT_FP32)  # order is free; the margin row left out
    assert (same.boxes, same.unmatched, same.left_out, same.class_mismatches) == (6, 0, 2, 0)
    shifted = eager.copy()
    shifted[2, :4] += [0.5, 0, 0.5, 0]  # half a pixel on a 10-pixel box: IoU 0.9
    assert match_image(eager, shifted, DETECT_FP32).unmatched == 2
    swapped = eager.copy()
    swapped[0, 5] = 4
    assert match_image(eager, swapped, DETECT_FP32).class_mismatches == 1
    dropped = eager.copy()
    dropped[3, 4] = 0.0495  # within the margin of the 0.05 cut: either side of it is fine
    assert match_image(eager, dropped, DETECT_FP32).unmatched == 0
    nudged = eager.copy()
    nudged[0, 4] += 5e-4
    assert match_image(eager, nudged, DETECT_FP32).max_score_error == pytest.approx(5e-4, rel=1e-3)


def test_aotinductor_of_a_detector_is_refused_with_the_reason(tmp_path: Path) -> None:
    source = _detector()
    with pytest.raises(ConfigError, match="--formats aoti of digitdet is refused: it is a detector"):
        export_model(source.eager, source.spec, _request(tmp_path, "det", formats=("onnx", "aoti")))
    assert not (tmp_path / "det").exists()


def _visionserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], capture_output=True, text=True, timeout=600)


def test_export_command_prints_a_report_with_sizes_parity_and_latency(tmp_path: Path) -> None:
    """A real process: the command as a user starts it, its imports in a fresh interpreter."""
    proc = _visionserve(
        "export", "--arch", "smallcnn", "--input-size", "8", "--name", "tiny", "--repository", str(tmp_path),
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model.onnx" in out and "model.pt" in out and "opset 20" in out
    assert "pass: max relative logit error" in out and "MB" in out
    assert "1: " in out and "32: " in out  # latency per batch size
    assert (tmp_path / "tiny" / "1" / "spec.json").is_file()


def test_export_command_refuses_bad_arguments_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before any model is built: ``main`` in this process, as a process would run it (a process per
    refusal imported torch again, 3-9 s apiece)."""
    import export.sources

    def no_model_work(*_args: object, **_kw: object) -> None:
        raise AssertionError("a model was built before the arguments were checked")

    monkeypatch.setattr(export.sources, "from_architecture", no_model_work)
    proc = in_process(
        capsys, "export", "--arch", "smallcnn", "--name", "t", "--repository", str(tmp_path), "--formats", "tflite"
    )
    assert proc.returncode == 2 and "--formats" in proc.stderr and "Traceback" not in proc.stderr
    proc = in_process(capsys, "export", "--onnx", "x.onnx", "--name", "t", "--repository", str(tmp_path))
    assert proc.returncode == 2 and "--labels is required" in proc.stderr


# ---- models from elsewhere ---------------------------------------------------------------------------------------


# The floor visionserve sets for its own models' inputs (resnet18 pads its way down to 1x1 maps from there): the
# wrapping, probing and parity paths are the same at any size, the arithmetic is not. The commands run through
# ``main`` in this process, as a process would run them: a process apiece imported torch again, 3-9 s each.
OUTSIDE_SIZE = 8


@pytest.fixture(scope="module")
def outside_resnet18(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """torchvision resnet18 exported outside visionserve by plain torch.onnx.export and torch.jit.trace, for an
    input of OUTSIDE_SIZE."""
    import warnings

    import torchvision

    folder = tmp_path_factory.mktemp("outside")
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(1, 3, OUTSIDE_SIZE, OUTSIDE_SIZE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), str(folder / "static.onnx"))  # the plainest call: batch fixed at 1
        torch.onnx.export(
            model, (x,), str(folder / "dynamic.onnx"), input_names=["x"], dynamic_axes={"x": {0: "n"}}, dynamo=False
        )
        torch.jit.trace(model, (x,)).save(str(folder / "traced.pt"))
    labels = torchvision.models.ResNet18_Weights.DEFAULT.meta["categories"]
    (folder / "labels.txt").write_text("\n".join(labels))
    (folder / "short.txt").write_text("a\nb\nc\n")
    return {
        "static": folder / "static.onnx",
        "dynamic": folder / "dynamic.onnx",
        "traced": folder / "traced.pt",
        "labels": folder / "labels.txt",
        "short": folder / "short.txt",
    }


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_torchvision_onnx_exported_elsewhere_goes_in(
    outside_resnet18: dict[str, Path], tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = in_process(
        capsys, "export", "--onnx", str(outside_resnet18[kind]), "--labels", str(outside_resnet18["labels"]),
        "--input-size", str(OUTSIDE_SIZE), "--name", "r18", "--repository", str(tmp_path), "--no-latency",
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entry = ModelRepository(tmp_path).model("r18")
    spec = entry.latest.spec
    assert spec.architecture == "external-onnx" and spec.num_classes == 1000 and spec.labels[0] == "tench"
    assert entry.config.max_batch_size == (32 if kind == "dynamic" else 1)
    if kind == "static":
        assert "batch size of 1 fixed" in proc.stdout
    runtime = OnnxRuntime(spec, entry.latest.files["onnx"])
    try:
        n = entry.config.max_batch_size
        assert runtime.run(random_batch(spec, n)).shape == (n, 1000)  # it runs on a uint8 batch
    finally:
        runtime.close()


def test_a_torchscript_model_from_elsewhere_goes_in(
    outside_resnet18: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = in_process(
        capsys, "export", "--torchscript", str(outside_resnet18["traced"]), "--labels", str(outside_resnet18["labels"]),
        "--input-size", str(OUTSIDE_SIZE), "--name", "r18ts", "--repository", str(tmp_path), "--no-latency",
        "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ModelRepository(tmp_path).model("r18ts").latest.files.keys() == {"torchscript"}


def test_outside_model_with_the_wrong_label_count_is_refused(
    outside_resnet18: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proc = in_process(
        capsys, "export", "--onnx", str(outside_resnet18["dynamic"]), "--labels", str(outside_resnet18["short"]),
        "--input-size", str(OUTSIDE_SIZE), "--name", "bad", "--repository", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 2
    assert "3 labels" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()


def test_spec_round_trips_through_json(tmp_path: Path) -> None:
    spec = from_architecture("resnet18").spec
    from service.core.spec import decode_spec, encode_spec

    assert decode_spec(encode_spec(spec)) == spec
    assert msgspec.json.decode(encode_spec(spec))["input"]["dtype"] == "uint8"


def test_a_candidate_that_cannot_be_produced_fails_alone_with_its_reason(tmp_path: Path) -> None:
    """One format that raises (an AOTInductor compile, a CUDA session on a new GPU) used to raise out of the export
    and take every other artifact with it."""
    from export.exporter import Candidate, module_candidates, publish
    from export.parity import eager_outputs

    source = from_architecture("smallcnn", input_size=32)
    request = ExportRequest(name="m", repository=str(tmp_path), latency=False)

    def broken(path: Path) -> None:
        path.write_bytes(b"half written")
        raise RuntimeError("no kernel image is available for execution on the device")

    candidates = [
        Candidate(c.format, c.precision, broken if c.format == "torchscript" else c.produce, c.device)
        for c in module_candidates(source.eager.eval(), source.spec, request)
    ]
    report = publish(source.spec, request, candidates, lambda batches: eager_outputs(source.eager.eval(), batches))
    by_format = {a.format: a for a in report.artifacts}
    assert by_format["onnx"].written and not by_format["torchscript"].written and not report.ok
    assert by_format["torchscript"].parity.describe() == (
        "FAIL: RuntimeError: no kernel image is available for execution on the device"
    )
    version = tmp_path / "m" / "1"
    assert (version / "model.onnx").is_file() and not (version / "model.pt").exists()
    assert [e["format"] for e in json.loads((version / "spec.json").read_text())["exports"]] == ["onnx"]


def test_aotinductors_cuda_compile_is_refused_before_it_starts_without_the_toolkit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.utils import cpp_extension

    from export.artifacts import cuda_toolkit_missing

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)  # a pip-only torch: no toolkit (pytorch/pytorch#150442)
    assert "needs the CUDA toolkit" in (cuda_toolkit_missing() or "")
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    assert cuda_toolkit_missing() is None


def test_fp32_parity_on_cuda_runs_with_tf32_off_and_puts_it_back() -> None:
    import torch

    from export.parity import exact_fp32

    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with exact_fp32("cuda:0"):
            assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (False, False)
        assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == (True, True)
        with exact_fp32("cpu"):  # the CPU has no TF32: left alone
            assert torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_an_onnx_artifact_is_checked_on_the_cpu_where_onnxruntime_has_no_cuda_provider(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA torch beside onnxruntime's CPU build (as on a GPU machine without onnxruntime-gpu): the ONNX gates
    run where onnxruntime can run them; the torch formats stay on the device asked for."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    assert runnable_device("onnx", "cuda") == "cpu" and runnable_device("onnx", "cuda:1") == "cpu"
    assert runnable_device("torchscript", "cuda") == "cuda" and runnable_device("onnx", "cpu") == "cpu"
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert runnable_device("onnx", "cuda:0") == "cuda:0"
