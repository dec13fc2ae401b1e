"""INT8 of a detector, judged on boxes (export/int8_gate.py): the shipped digits-detect quantized with its decoding
tail in float keeps mAP@0.5 against fp32's boxes and on the held-out canvases' known boxes; calibrated on blank
images it is refused with the figures; through ``export --int8`` its record says what was measured."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from PIL import Image

from export.calibration import from_canvases
from export.int8_gate import BoxJudge
from export.quantize import Int8Data, Int8Options, quantize_model
from models.canvases import CanvasParams
from service.core.repository import ModelRepository
from service.core.spec import ModelSpec, load_spec
from tests.test_cli import in_process

SHIPPED = Path(__file__).parents[2] / "examples" / "model_repository" / "digits-detect"
SPEC = load_spec(SHIPPED / "1" / "spec.json")
PARAMS = msgspec.convert(json.loads((SHIPPED / "training.json").read_text())["generator"], CanvasParams)


def test_the_box_judge_scores_its_own_answers_one_and_shifted_boxes_lower() -> None:
    rows = np.zeros((2, 100, 6), dtype=np.float32)
    rows[:, :2] = [[10, 10, 30, 40, 0.9, 3], [50, 20, 80, 60, 0.8, 7]]
    judge = BoxJudge(SPEC, 0.95, 0.01)
    assert judge.agreement({"output": rows}, {"output": rows}) == 1.0  # the graph's outputs by name
    shifted = rows.copy()
    shifted[:, 0, :4] += [10, 12, 10, 12]  # each image's class-3 box moved off its place: IoU < 0.5
    assert judge.agreement({"output": shifted}, {"output": rows}) == pytest.approx(0.5)  # class 3 lost its box
    truth = [(rows[i, :2, :4], np.array([3, 7])) for i in range(2)]
    assert judge.accuracy({"output": rows}, truth) == 1.0


def test_the_shipped_detector_keeps_its_boxes_in_int8_and_a_blank_calibration_is_refused(tmp_path: Path) -> None:
    data = from_canvases(PARAMS, SPEC, held_out=64)
    options = Int8Options(allow_slower=True)  # the speed gate is not what this test judges
    verdict = quantize_model(SHIPPED / "1" / "model.onnx", tmp_path / "good.onnx", data, options, spec=SPEC)
    r = verdict.record
    assert verdict.passed and r.passed, verdict.describe()
    assert r.box_map50_vs_fp32 is not None and r.box_map50_vs_fp32 >= 0.95 and r.top1_agreement is None
    assert r.fp32_map50 is not None and r.int8_map50 is not None and r.int8_map50 >= r.fp32_map50 - 0.01
    assert r.fp32_map50 >= 0.9  # the held-out canvases' known boxes: the detector is a real one
    assert any("sigmoid" in n or "topk" in n for n in r.excluded_nodes)  # its decoding kept in float

    blank = Int8Data(np.zeros_like(data.calibration[:8]), "blank canvases", data.held_out, data.held_out_source,
                     data.held_out_labels)  # fmt: skip
    refused = quantize_model(SHIPPED / "1" / "model.onnx", tmp_path / "bad.onnx", blank, options, spec=SPEC)
    text = refused.describe()
    assert not refused.passed and "FAIL: mAP@0.5 of int8's boxes against fp32's" in text and "limit 95%" in text
    assert not (tmp_path / "bad.onnx").exists()


def export_outside_int8(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, onnx: Path, images: np.ndarray, labels: tuple[str, ...],
    task: str, layout: str, folder: str = "canvases",
) -> tuple[ModelSpec, str]:  # fmt: skip
    """``onnx`` exported as an outside ``task`` model (named ``task``) with INT8, calibrated and gated on ``images``
    (NCHW) saved as PNGs in ``tmp_path / folder``: its spec as written and export's output."""
    where = tmp_path / folder
    where.mkdir(parents=True)
    for i, image in enumerate(images):
        Image.fromarray(image.transpose(1, 2, 0)).save(where / f"{i:03d}.png")
    (tmp_path / "labels.txt").write_text("\n".join(labels))
    proc = in_process(
        capsys, "export", "--onnx", str(onnx), "--task", task, "--output-layout", layout, "--input-size", "96",
        "--mean", "0.5,0.5,0.5", "--std", "0.5,0.5,0.5", "--labels", str(tmp_path / "labels.txt"), "--name", task,
        "--repository", str(tmp_path / "repo"), "--int8", "--int8-allow-slower", "--calibration-images",
        str(tmp_path / folder.split("/")[0]), "--no-latency", "--no-progress",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return ModelRepository(tmp_path / "repo").model(task).latest.spec, proc.stdout


def test_export_int8_of_a_detector_records_box_agreement(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped graph placed as an outside detector, calibrated and gated on a folder of canvases."""
    data = from_canvases(PARAMS, SPEC, held_out=24)
    images = np.concatenate([data.calibration[:24], data.held_out])
    spec, out = export_outside_int8(capsys, tmp_path, SHIPPED / "1" / "model.onnx", images, SPEC.labels, "detect",
                                    "candidates")  # fmt: skip
    assert "mAP@0.5 of int8's boxes against fp32's" in out
    record = spec.export_record("model.int8.onnx")
    assert record is not None and record.int8 is not None and record.int8.box_map50_vs_fp32 is not None
    assert record.int8.box_map50_vs_fp32 >= 0.95 and record.int8.min_box_map50 == 0.95
