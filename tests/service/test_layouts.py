"""Reading each detector output layout (service/core/layouts.py) into candidate rows, and a YOLO head's decode and
suppression held box for box to torchvision's ``batched_nms`` on a realistic 640-pixel, 80-class output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision

from service.bench.detect import yolo_head
from service.core.boxes import suppress
from service.core.errors import ConfigError
from service.core.layouts import check_outputs, image_rows, select, top_rows
from service.core.tasks import DetectOptions

ROWS = np.array([[10, 20, 30, 60, 0.9, 2], [0, 0, 5, 5, 0.2, 0], [40, 40, 50, 50, 0.6, 1]], dtype=np.float32)


def yolo_of(rows: np.ndarray, classes: int, objectness: bool = False) -> np.ndarray:
    """``rows`` as one image's YOLO output ``[4 (+1) + C, A]``: centre, size, (objectness 1), class scores."""
    centre = (rows[:, :2] + rows[:, 2:4]) / 2
    size = rows[:, 2:4] - rows[:, :2]
    scores = np.zeros((len(rows), classes), dtype=np.float32)
    scores[np.arange(len(rows)), rows[:, 5].astype(int)] = rows[:, 4]
    parts = [centre, size] + ([np.ones((len(rows), 1), np.float32)] if objectness else []) + [scores]
    return np.concatenate(parts, axis=1).T.astype(np.float32)


@pytest.mark.parametrize("transposed", [False, True])
def test_yolo_rows_in_either_orientation(transposed: bool) -> None:
    out = yolo_of(ROWS, 3)[None]
    got = image_rows("yolo", {"output0": out.transpose(0, 2, 1) if transposed else out}, 3, 0.25)
    np.testing.assert_allclose(got[0], ROWS[[0, 2]], atol=1e-5)  # the 0.2 row under the threshold left out


def test_yolov5_scores_are_objectness_times_the_class_score() -> None:
    out = yolo_of(ROWS, 3, objectness=True).T[None].copy()  # [1, A, 5 + C]
    out[0, :, 4] = 0.5
    got = image_rows("yolov5", {"output0": out}, 3)[0]
    np.testing.assert_allclose(got[:, 4], ROWS[:, 4] * 0.5, atol=1e-6)
    np.testing.assert_array_equal(got[:, 5], ROWS[:, 5])


def test_efficientnms_takes_each_images_first_num_dets_rows() -> None:
    outputs = {
        "num_dets": np.array([[2], [0]], dtype=np.int32),
        "det_boxes": np.stack([ROWS[:, :4], ROWS[:, :4]]),
        "det_scores": np.stack([ROWS[:, 4], ROWS[:, 4]]),
        "det_classes": np.stack([ROWS[:, 5], ROWS[:, 5]]).astype(np.int32),
    }
    first, second = image_rows("efficientnms", outputs, 3)
    np.testing.assert_allclose(first, ROWS[:2])
    assert second.shape == (0, 6)


def test_select_and_top_rows() -> None:
    np.testing.assert_array_equal(select(ROWS, 0.5, None, 10), ROWS[[0, 2]])
    np.testing.assert_array_equal(select(ROWS, 0.0, (1,), 10), ROWS[[2]])
    assert len(select(ROWS, 0.0, None, 1)) == 1
    top = top_rows([ROWS, ROWS[:0]], 4)
    assert top.shape == (2, 4, 6) and top[0, 0, 4] == pytest.approx(0.9) and not top[0, 3].any() and not top[1].any()


@pytest.mark.parametrize(
    ("layout", "outputs", "message"),
    [
        ("yolo", {"o": [1, 84, 8400]}, None),
        ("yolo", {"o": ["batch", 8400, 84]}, None),
        ("yolo", {"o": [1, 85, 8400]}, "neither axis 1 nor axis 2"),
        ("yolov5", {"o": [1, 25200, 85]}, None),
        ("yolo", {"a": [1, 84, 8400], "b": [1, 32, 160, 160]}, "takes one output, the graph has 2"),
        ("end2end", {"o": [1, 300, 6]}, None),
        ("end2end", {"o": [1, 300, 7]}, "rows of 6"),
        ("candidates", {"o": [1, 300]}, "rank-3"),
        (
            "efficientnms",
            {"num_dets": [1, 1], "det_boxes": [1, 100, 4], "det_scores": [1, 100], "det_classes": [1, 100]},
            None,
        ),
        ("efficientnms", {"num_dets": [1, 1], "det_boxes": [1, 100, 4]}, "missing ['det_scores', 'det_classes']"),
    ],
)
def test_output_shapes_are_held_to_the_layout(layout: str, outputs: dict[str, list[object]], message: str) -> None:
    if message is None:
        check_outputs(layout, outputs, 80)  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError, match="do not fit output_layout") as refused:
        check_outputs(layout, outputs, 80)  # type: ignore[arg-type]
    assert message in str(refused.value)


def reference(head: np.ndarray, threshold: float, iou: float, most: int) -> np.ndarray:
    """torchvision's decode-and-suppress of a YOLO head, as ultralytics' own non-max suppression does it."""
    x = torch.from_numpy(head[0].T)
    score, cls = x[:, 4:].max(1)
    keep = score >= threshold
    cxcywh, score, cls = x[keep, :4], score[keep], cls[keep]
    boxes = torchvision.ops.box_convert(cxcywh, "cxcywh", "xyxy")
    kept = torchvision.ops.batched_nms(boxes, score, cls, iou)[:most]
    return torch.cat([boxes[kept], score[kept, None], cls[kept, None].float()], 1).numpy()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_yolo_heads_decode_and_suppression_equal_torchvisions_box_for_box(seed: int) -> None:
    head = yolo_head(seed)
    options = DetectOptions(score_threshold=0.25, iou_threshold=0.45, max_detections=300)
    rows = image_rows("yolo", {"output0": head}, 80, options.score_threshold)[0]
    assert len(rows) >= 1000  # the target's load: at least 1,000 candidates above the threshold
    got = suppress(rows, options)
    expected = reference(head, 0.25, 0.45, 300)
    assert len(got) == len(expected) > 30
    np.testing.assert_allclose(got[:, :4], expected[:, :4], atol=1e-3)
    np.testing.assert_allclose(got[:, 4], expected[:, 4], atol=1e-6)
    np.testing.assert_array_equal(got[:, 5], expected[:, 5])
