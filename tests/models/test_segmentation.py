"""The segmenter's model side (issue 54): each pasted digit's ink as its mask, the ``digitseg`` forward in
ultralytics' segmentation layout read by the server's own segment task, and a tiny ``visionserve train --arch
digitseg`` run whose record holds pycocotools' COCOeval figures. The full training is run by hand
(scripts/default_model.py; its figures are in examples/model_repository/digits-segment/training.json)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.canvases import CanvasParams, digit_pool, make_canvases
from models.checkpoint import load_checkpoint
from models.registry import get_architecture
from models.segment_train import segm_ap, truth_coco
from models.segmenter import DigitSeg
from service.core.status import InferResult
from service.core.tasks import Segment, Want
from tests.models.test_detection import PLAIN, _box_above
from tests.test_cli import in_process


def test_each_digit_s_mask_is_its_ink_inside_its_box() -> None:
    plain = make_canvases(PLAIN, 16, pool=digit_pool("train"), seed=3, masks=True)
    assert plain.masks is not None and plain.masks.shape == (16, 1, 96, 96)
    for image, mask, box in zip(plain.images, plain.masks[:, 0], plain.boxes[:, 0], strict=True):
        ground = float(np.median(image))
        ink = image >= ground + 0.25 * (255 - ground) - 0.5  # the ink threshold, read off the image (no noise)
        assert (mask == ink).mean() > 0.99 and _box_above(mask.astype(float), 0.5) == tuple(box.astype(int))
    busy = make_canvases(CanvasParams(), 32, pool=digit_pool("train"), seed=4, masks=True)
    again = make_canvases(CanvasParams(), 32, pool=digit_pool("train"), seed=4)
    assert np.array_equal(busy.images, again.images) and busy.masks is not None  # masks change nothing else
    for i, slot in zip(*np.nonzero(busy.labels >= 0), strict=True):
        x1, y1, x2, y2 = busy.boxes[i, slot].astype(int)
        inside = np.zeros((96, 96), bool)
        inside[y1:y2, x1:x2] = True
        assert busy.masks[i, slot].any() and not (busy.masks[i, slot] & ~inside).any()


def test_the_forward_is_ultralytics_layout_and_the_server_reads_it() -> None:
    arch = get_architecture("digitseg")
    assert arch.task == "segment" and arch.spec.output_layout == "yolo-seg"
    torch.manual_seed(0)
    network = DigitSeg().eval()
    images = torch.from_numpy(make_canvases(CanvasParams(), 3, pool=digit_pool("heldout"), seed=5).images)
    with torch.inference_mode():
        head, protos = network((images.float()[:, None].expand(-1, 3, -1, -1) - 127.5) / 127.5)
    assert head.shape == (3, 4 + 10 + 16, 100) and protos.shape == (3, 16, 48, 48)
    scores = head[:, 4:14]
    assert ((scores > 0).sum(1) <= 1).all()  # a peak scores its own class alone
    post = Segment(arch.spec).postprocess(InferResult({"output0": head.numpy(), "output1": protos.numpy()},
                                                      [None] * 3), Want())  # fmt: skip
    assert len(post.predictions) == 3 and post.failed == {}


def test_cocoeval_scores_the_truth_itself_one() -> None:
    canvases = make_canvases(CanvasParams(), 8, pool=digit_pool("heldout"), seed=6, masks=True)
    truth = truth_coco(canvases, tuple("0123456789"))
    perfect = [{"image_id": a["image_id"], "category_id": a["category_id"], "segmentation": a["segmentation"],
                "bbox": a["bbox"], "score": 1.0} for a in truth["annotations"]]  # fmt: skip
    assert segm_ap(truth, perfect) == pytest.approx((1.0, 1.0, 1.0))
    assert segm_ap(truth, perfect[: len(perfect) // 2])[1] < 0.8


def test_a_segmenter_trains_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "seg.pt"
    args = ("train", "--arch", "digitseg", "--dataset", "canvases", "--epochs", "1", "--limit-batches", "2")
    proc = in_process(capsys, *args, "--batch-size", "4", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "masks (pycocotools COCOeval, segm)" in proc.stdout and ", mask " in proc.stderr
    rec = load_checkpoint(out).record
    assert rec is not None and rec.detection is not None
    det = rec.detection
    assert det.mask_ap is not None and 0 <= det.mask_ap <= 1 and det.mask_ap_50 is not None
    assert det.mask_evaluator and "COCOeval" in det.mask_evaluator and det.history[0].mask_loss is not None
