"""The spec's task fields: every spec written before them reads unchanged; a detector's are checked with clear
messages."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.core.errors import ConfigError
from service.core.spec import decode_spec, encode_spec

BASE: dict[str, Any] = {
    "name": "m", "architecture": "a", "input": {"height": 32, "width": 48}, "resize_size": 48,
    "mean": [0, 0, 0], "std": [1, 1, 1], "labels": ["a", "b"],
}  # fmt: skip


def test_an_older_spec_reads_as_a_centre_cropping_classifier() -> None:
    spec = decode_spec(json.dumps(BASE))
    assert (spec.task, spec.resize, spec.pad_value, spec.output_layout, spec.max_detections) == (
        "classify", "center_crop", 114, None, 100
    )  # fmt: skip
    assert decode_spec(encode_spec(spec)) == spec


def test_a_detector_reads_and_round_trips() -> None:
    doc = {**BASE, "task": "detect", "resize": "letterbox", "pad_value": 0, "output_layout": "candidates",
           "max_detections": 300, "resize_size": 8}  # fmt: skip
    spec = decode_spec(json.dumps(doc))
    assert (spec.task, spec.resize, spec.pad_value, spec.max_detections) == ("detect", "letterbox", 0, 300)
    assert decode_spec(encode_spec(spec)) == spec


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"task": "embed"}, "task"),
        ({"resize": "crop"}, "resize"),
        ({"pad_value": 256}, "pad_value"),
        ({"task": "detect"}, "needs output_layout: one of candidates, yolo, yolov5, end2end, efficientnms"),
        ({"output_layout": "candidates"}, "output_layout is for detectors"),
        ({"task": "detect", "output_layout": "yolox"}, "output_layout"),
        ({"task": "detect", "output_layout": "candidates", "max_detections": 0}, "max_detections"),
        ({"resize_size": 8}, "centre crop would run off the image"),
    ],
)
def test_bad_task_fields_are_refused_by_name(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_spec(json.dumps({**BASE, **change}), source="spec.json")
