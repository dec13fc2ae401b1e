"""INT8 of a segmenter, judged on masks (export/int8_gate.py): fp32's instances are the truth and int8's are held
to them by mask mAP@0.5 of pycocotools' COCOeval (iouType "segm"). The judge sees spoiled masks the box judge
passes; the shipped digits-segment keeps its masks in int8 (and its labelled mask mAP on held-out canvases);
calibrated on blank images it is refused, the reason naming masks; through ``export --int8`` its record says what
was measured."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest

from export.calibration import from_canvases
from export.int8_gate import BoxJudge, MaskJudge, judge_for
from export.quantize import Int8Data, Int8Options, _run, _session, quantize_model
from models.canvases import CanvasParams
from service.core.errors import ConfigError
from service.core.spec import load_spec
from tests.export.test_int8_detect import export_outside_int8

SHIPPED = Path(__file__).parents[2] / "examples" / "model_repository" / "digits-segment"
SPEC = load_spec(SHIPPED / "1" / "spec.json")
PARAMS = msgspec.convert(json.loads((SHIPPED / "training.json").read_text())["generator"], CanvasParams)
FAST = Int8Options(allow_slower=True)  # the speed gate is not what these tests judge


@pytest.fixture(scope="module")
def data() -> Int8Data:
    """16 calibration canvases and 24 held-out ones (the gate's minimum is 20), their masks known."""
    canvases = from_canvases(PARAMS, SPEC, held_out=24)
    return Int8Data(canvases.calibration[:16], canvases.calibration_source, canvases.held_out,
                    canvases.held_out_source, canvases.held_out_labels)  # fmt: skip


def test_the_mask_judge_sees_spoiled_masks_the_box_judge_passes(data: Int8Data) -> None:
    outputs = _run(_session(SHIPPED / "1" / "model.onnx"), data.held_out[:8])
    assert set(outputs) == {"output0", "output1"}  # a head and prototypes, both handed to the judge
    judge = judge_for(SPEC, min_top1=0.99, max_drop=0.01, min_box_map=0.95, min_mask_map=0.9)
    assert isinstance(judge, MaskJudge) and judge.minimum == 0.9
    assert judge.agreement(outputs, outputs) == 1.0
    spoiled = {**outputs, "output1": -outputs["output1"]}  # every mask inverted inside its box; boxes untouched
    assert judge.agreement(spoiled, outputs) < 0.2
    assert BoxJudge(SPEC, 0.95, 0.01).agreement(spoiled, outputs) == 1.0


def test_int8_of_a_semantic_model_is_still_refused() -> None:
    semantic = msgspec.structs.replace(SPEC, task="semantic", output_layout=None)
    with pytest.raises(ConfigError, match="gated on top-1, boxes or masks, and this model is judged on pixels"):
        judge_for(semantic, min_top1=0.99, max_drop=0.01, min_box_map=0.95)


def test_the_shipped_segmenter_keeps_its_masks_in_int8_and_a_blank_calibration_is_refused(
    data: Int8Data, tmp_path: Path
) -> None:
    verdict = quantize_model(SHIPPED / "1" / "model.onnx", tmp_path / "good.onnx", data, FAST, spec=SPEC)
    r = verdict.record
    print(verdict.describe())
    assert verdict.passed and r.passed and (tmp_path / "good.onnx").is_file(), verdict.describe()
    assert r.mask_map50_vs_fp32 is not None and r.mask_map50_vs_fp32 >= 0.95 and r.min_mask_map50 == 0.95
    assert r.top1_agreement is None and r.box_map50_vs_fp32 is None and verdict.top1_agreement == r.mask_map50_vs_fp32
    assert r.fp32_mask_map50 is not None and r.int8_mask_map50 is not None
    assert r.fp32_mask_map50 >= 0.9 and r.int8_mask_map50 >= r.fp32_mask_map50 - 0.01  # the canvases' own masks
    assert "mask mAP@0.5 of int8's instances against fp32's" in verdict.describe()

    blank = Int8Data(np.zeros_like(data.calibration[:8]), "blank canvases", data.held_out, data.held_out_source,
                     data.held_out_labels)  # fmt: skip
    refused = quantize_model(SHIPPED / "1" / "model.onnx", tmp_path / "bad.onnx", blank, FAST, spec=SPEC)
    text = refused.describe()
    assert not refused.passed and "FAIL: mask mAP@0.5 of int8's instances against fp32's" in text, text
    assert "limit 95%: short by" in text and "mAP@0.5 on the labelled masks" in text
    assert not (tmp_path / "bad.onnx").exists()


def test_export_int8_of_a_segmenter_records_mask_agreement(
    data: Int8Data, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped graph placed as an outside segmenter, calibrated and gated on a folder of canvases (in a
    sub-folder named as a label: a classifier's labels, which a segmenter must not take for its truth)."""
    images = np.concatenate([data.calibration, data.held_out])
    spec, out = export_outside_int8(capsys, tmp_path, SHIPPED / "1" / "model.onnx", images, SPEC.labels, "segment",
                                    "yolo-seg", folder="canvases/7")  # fmt: skip
    assert "mask mAP@0.5 of int8's instances against fp32's" in out
    record = spec.export_record("model.int8.onnx")
    assert record is not None and record.int8 is not None and record.int8.mask_map50_vs_fp32 is not None
    assert record.int8.mask_map50_vs_fp32 >= 0.95 and record.int8.fp32_mask_map50 is None  # no masks known
