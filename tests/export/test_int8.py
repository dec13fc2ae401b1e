"""INT8 at export: the gate on held-out images, a refusal that writes nothing and names the miss, ungated artifacts
marked in spec.json, and calibration sets that never overlap the gate's images; then the speed gate against fp32,
forced either way by ``int8_min_speedup`` so that no test depends on which is really faster here."""

from __future__ import annotations

import argparse
from pathlib import Path

import msgspec
import numpy as np
import onnx
import pytest
import torch

from export import calibration
from export.commands import add_export_arguments
from export.exporter import ExportReport, ExportRequest, export_model
from export.quantize import MIN_SPEEDUP, MIN_TOP1_AGREEMENT, SPEED_BLOCK_RUNS, SPEED_ROUNDS, Int8Data
from export.sources import from_checkpoint
from service.core.cpu import describe_cpu
from service.core.errors import ConfigError
from service.core.repository import ModelRepository
from service.core.spec import ModelSpec, decode_spec, encode_spec, load_spec
from tests.conftest import encode_image

# Always fast enough: the accuracy gate's tests must not depend on which model is faster on a shared machine.
ANY_SPEED = -1.0
# int8 must take at most 1% of fp32's time, 100x faster: never met, so "not faster" is forced.
NEVER_FAST_ENOUGH = 0.99


def _request(repo: Path, name: str, **kw: object) -> ExportRequest:
    settings: dict[str, object] = {
        "formats": ("onnx",), "latency": False, "int8": True, "int8_min_speedup": ANY_SPEED, **kw
    }  # fmt: skip
    return ExportRequest(name=name, repository=str(repo), **settings)  # type: ignore[arg-type]


def _blank_calibration(spec: ModelSpec) -> Int8Data:
    """Calibration on all-black images: every activation range collapses, so real digits saturate and the int8
    model's answers stop agreeing with fp32's. A gate failure that does not depend on the machine."""
    real = calibration.from_dataset("digits", spec)
    return Int8Data(
        calibration=np.zeros_like(real.calibration[:16]),
        calibration_source="16 black images",
        held_out=real.held_out,
        held_out_source=real.held_out_source,
        held_out_labels=real.held_out_labels,
    )


def confident_calibration(eager: torch.nn.Module, spec: ModelSpec, images: int = 24) -> Int8Data:
    """The real digits split, held out on the validation images fp32 is most sure of (largest gap between its
    top two logits, over its largest): int8 agrees with fp32 on all of them, so the accuracy gate passes on any
    machine and a test reaches the speed gate."""
    real = calibration.from_dataset("digits", spec)
    with torch.no_grad():
        logits = eager(torch.from_numpy(real.held_out)).float().numpy()
    top2 = np.sort(logits, axis=1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) / np.maximum(np.abs(logits).max(axis=1), 1e-12)
    keep = np.sort(np.argsort(margin)[-images:])
    labels = real.held_out_labels[keep] if real.held_out_labels is not None else None
    return Int8Data(
        calibration=real.calibration,
        calibration_source=real.calibration_source,
        held_out=real.held_out[keep],
        held_out_source=f"the {images} validation images fp32 is surest of",
        held_out_labels=labels,
    )


def test_trained_digits_int8_gate_on_held_out_validation_split(digits_checkpoint: Path, tmp_path: Path) -> None:
    source = from_checkpoint(digits_checkpoint)
    report = export_model(
        source.eager,
        source.spec,
        _request(tmp_path, "digits"),
        real_images=source.real_images,
        int8_data=lambda spec: calibration.from_dataset("digits", spec),
    )
    int8 = next(a for a in report.artifacts if a.precision == "int8")
    message = int8.parity.describe()
    version_dir = tmp_path / "digits" / "1"
    record = load_spec(version_dir / "spec.json").export_record("model.int8.onnx")
    # The embedded smallcnn (4 epochs) passed here: 99.44% agreement on the 359 validation images (2 differ),
    # accuracy equal to fp32's. Where it does not, it must be refused with its figures and nothing written.
    if int8.parity.passed:
        assert report.ok and int8.written and (version_dir / "model.int8.onnx").is_file(), message
        assert record is not None and record.precision == "int8" and record.int8 is not None
        gate = record.int8
        assert gate.gated and gate.passed and gate.top1_agreement >= MIN_TOP1_AGREEMENT
        assert gate.fp32_accuracy is not None and gate.int8_accuracy is not None
        assert gate.int8_accuracy >= gate.fp32_accuracy - gate.max_accuracy_drop
        assert gate.held_out_images == len(calibration.from_dataset("digits", source.spec).held_out) > 300
        assert "validation split" in gate.held_out_source and "training images" in gate.calibration_source
        assert gate.calibration_method in gate.methods_tried and {"minmax", "percentile"} <= set(gate.methods_tried)
        # The uint8 front (Cast, normalising Mul and Add) stays in float: the graph starts with the Cast.
        graph = onnx.load(str(version_dir / "model.int8.onnx")).graph
        assert len(gate.excluded_nodes) == 3
        assert [n.op_type for n in graph.node if n.name in gate.excluded_nodes] == ["Cast", "Mul", "Add"]
        assert sum(n.op_type == "QuantizeLinear" for n in graph.node) > 3
        assert ModelRepository(tmp_path).model("digits").latest.int8_files.keys() == {"onnx"}
        assert "pass: top-1 agreement with fp32" in message
    else:
        assert not report.ok and not (version_dir / "model.int8.onnx").exists() and record is None
        assert "short by" in message or "accuracy" in message


def test_gate_failure_writes_no_int8_artifact_and_names_the_miss(digits_checkpoint: Path, tmp_path: Path) -> None:
    source = from_checkpoint(digits_checkpoint)
    report = export_model(
        source.eager,
        source.spec,
        _request(tmp_path, "digits", int8_method="minmax"),
        real_images=source.real_images,
        int8_data=_blank_calibration,
    )
    assert not report.ok
    int8 = next(a for a in report.artifacts if a.precision == "int8")
    assert not int8.written and not int8.parity.passed
    message = int8.parity.describe()
    assert message.startswith("FAIL: top-1 agreement with fp32")
    assert "short by" in message and "(limit 99%" in message
    assert "Try: more calibration images" in message and "--int8-method" in message and "--int8-exclude" in message
    version_dir = tmp_path / "digits" / "1"
    assert not (version_dir / "model.int8.onnx").exists()
    assert (version_dir / "model.onnx").is_file()  # the fp32 artifact passed its own parity and is written
    assert [e.file for e in load_spec(version_dir / "spec.json").exports] == ["model.onnx"]


def test_ungated_writes_it_marked_in_spec_json(digits_checkpoint: Path, tmp_path: Path) -> None:
    source = from_checkpoint(digits_checkpoint)
    report = export_model(
        source.eager,
        source.spec,
        _request(tmp_path, "digits", int8_method="minmax", int8_ungated=True),
        int8_data=_blank_calibration,
    )
    assert report.ok
    version_dir = tmp_path / "digits" / "1"
    assert (version_dir / "model.int8.onnx").is_file()
    record = load_spec(version_dir / "spec.json").export_record("model.int8.onnx")
    assert record is not None and record.int8 is not None
    assert not record.int8.gated and not record.int8.passed  # written, and the figures it would have failed on
    assert record.int8.top1_agreement < MIN_TOP1_AGREEMENT
    assert ModelRepository(tmp_path).model("digits").latest.int8_ungated
    assert "UNGATED, would FAIL" in next(a for a in report.artifacts if a.precision == "int8").parity.describe()


def test_int8_without_images_is_refused_before_anything_is_exported(digits_checkpoint: Path, tmp_path: Path) -> None:
    source = from_checkpoint(digits_checkpoint)
    with pytest.raises(ConfigError, match="--calibration-images DIR"):
        export_model(source.eager, source.spec, _request(tmp_path, "digits"))
    with pytest.raises(ConfigError, match="add onnx to --formats"):
        export_model(source.eager, source.spec, _request(tmp_path, "digits", formats=("torchscript",)))
    assert not (tmp_path / "digits").exists()


def test_folder_calibration_and_held_out_sets_are_disjoint_and_labelled(
    digits_checkpoint: Path, tmp_path: Path
) -> None:
    spec = from_checkpoint(digits_checkpoint).spec
    rng = np.random.default_rng(0)
    for label in ("3", "7"):
        (tmp_path / label).mkdir()
        for i in range(6):
            (tmp_path / label / f"{i}.png").write_bytes(encode_image(rng.integers(0, 256, (40, 40), np.uint8)))
    data = calibration.from_folder(tmp_path, spec)
    assert len(data.calibration) == len(data.held_out) == 6
    assert data.held_out_labels is not None and sorted(set(data.held_out_labels.tolist())) == [3, 7]
    assert "labelled by folder" in data.held_out_source
    calibrated = {a.tobytes() for a in data.calibration}
    assert not calibrated & {a.tobytes() for a in data.held_out}
    (tmp_path / "loose.png").write_bytes(encode_image(rng.integers(0, 256, (40, 40), np.uint8)))
    assert calibration.from_folder(tmp_path, spec).held_out_labels is None  # not every image has a class folder


def test_spec_json_written_before_int8_still_loads(digits_checkpoint: Path) -> None:
    spec = from_checkpoint(digits_checkpoint).spec
    old = msgspec.json.decode(encode_spec(spec))
    old["exports"] = [{"format": "onnx", "file": "model.onnx", "precision": "fp32", "parity_max_rel_error": 1e-6}]
    loaded = decode_spec(msgspec.json.encode(old))
    assert loaded.exports[0].int8 is None and loaded.export_record("model.onnx") is not None


def _export_speed(checkpoint: Path, repo: Path, **kw: object) -> tuple[ExportReport, Path]:
    source = from_checkpoint(checkpoint)
    report = export_model(
        source.eager,
        source.spec,
        _request(repo, "digits", int8_method="minmax", **kw),
        int8_data=lambda spec: confident_calibration(source.eager, spec),
    )
    return report, repo / "digits" / "1"


def test_int8_not_faster_than_fp32_is_refused_with_the_figures(digits_checkpoint: Path, tmp_path: Path) -> None:
    report, version_dir = _export_speed(digits_checkpoint, tmp_path, int8_min_speedup=NEVER_FAST_ENOUGH)
    assert not report.ok
    int8 = next(a for a in report.artifacts if a.precision == "int8")
    assert not int8.written and not int8.parity.passed
    message = int8.parity.describe()
    assert message.startswith("FAIL, not faster than fp32: speed on cpu, "), message
    assert f"{describe_cpu()} (CPUExecutionProvider, median of " in message  # the CPU and its int8 instruction sets
    assert "batch 1 int8 " in message and "batch 8 int8 " in message and " ms against fp32 " in message
    assert "limit 0.01x" in message and "top-1 agreement with fp32 100.00%" in message  # accuracy passed
    assert "Try: --int8-allow-slower to write it anyway" in message and "--int8-min-speedup (it was 0.99" in message
    assert not (version_dir / "model.int8.onnx").exists()
    assert [e.file for e in load_spec(version_dir / "spec.json").exports] == ["model.onnx"]  # fp32 still written


def test_int8_allow_slower_writes_it_marked_with_the_figures(digits_checkpoint: Path, tmp_path: Path) -> None:
    report, version_dir = _export_speed(
        digits_checkpoint, tmp_path, int8_min_speedup=NEVER_FAST_ENOUGH, int8_allow_slower=True
    )
    assert report.ok
    int8 = next(a for a in report.artifacts if a.precision == "int8")
    assert int8.written and (version_dir / "model.int8.onnx").is_file()
    assert int8.parity.describe().startswith("NOT FASTER than fp32, written anyway: speed on cpu")
    record = load_spec(version_dir / "spec.json").export_record("model.int8.onnx")
    assert record is not None and record.int8 is not None and record.int8.speed is not None
    assert record.int8.gated and record.int8.passed  # the accuracy gate passed; only speed was waived
    speed = record.int8.speed
    assert not speed.passed and speed.allowed_slower and speed.min_speedup == NEVER_FAST_ENOUGH


def test_spec_json_carries_the_speed_figures(digits_checkpoint: Path, tmp_path: Path) -> None:
    report, version_dir = _export_speed(digits_checkpoint, tmp_path, int8_min_speedup=ANY_SPEED)
    assert report.ok
    record = load_spec(version_dir / "spec.json").export_record("model.int8.onnx")
    assert record is not None and record.int8 is not None and record.int8.speed is not None
    speed = record.int8.speed
    assert speed.passed and not speed.allowed_slower
    assert speed.device == "cpu" and speed.provider == "CPUExecutionProvider"
    assert speed.fp32_median_ms.keys() == speed.int8_median_ms.keys() == {1, 8}  # 1 and min(8, max batch size)
    assert all(ms > 0 for ms in (*speed.fp32_median_ms.values(), *speed.int8_median_ms.values()))
    ratios = [speed.int8_median_ms[n] / speed.fp32_median_ms[n] for n in (1, 8)]
    assert speed.ratio == pytest.approx(max(ratios), rel=1e-3)  # the worst batch size decides
    assert speed.runs == SPEED_ROUNDS * SPEED_BLOCK_RUNS  # a tiny model never reaches the time budget
    assert "; speed on cpu" in next(a for a in report.artifacts if a.precision == "int8").parity.describe()


def test_min_speedup_of_one_or_more_is_refused(digits_checkpoint: Path, tmp_path: Path) -> None:
    source = from_checkpoint(digits_checkpoint)
    for bad in (1.0, float("nan")):
        with pytest.raises(ConfigError, match="--int8-min-speedup must be a number below 1"):
            export_model(source.eager, source.spec, _request(tmp_path, "digits", int8_min_speedup=bad),
                         int8_data=lambda spec: calibration.from_dataset("digits", spec))  # fmt: skip
    assert not (tmp_path / "digits").exists()  # nothing written, model.onnx included


def test_export_flags_for_the_speed_gate(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args(["--arch", "smallcnn", "--name", "x"])
    assert args.int8_min_speedup == MIN_SPEEDUP and not args.int8_allow_slower
    args = parser.parse_args(["--arch", "smallcnn", "--name", "x", "--int8-allow-slower", "--int8-min-speedup", "-1"])
    assert args.int8_allow_slower and args.int8_min_speedup == -1.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--arch", "smallcnn", "--name", "x", "--int8-min-speedup", "1"])
    assert "--int8-min-speedup must be a number below 1" in capsys.readouterr().err
