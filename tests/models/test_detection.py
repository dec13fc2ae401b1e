"""The detector's model side: canvases and their boxes, the held-out split, AP, the export forward and its ONNX
graph, and a tiny ``visionserve train --arch digitdet`` run. Each at the smallest size that reaches its path; the
full 3-minute training is run by hand (its figures are in the checkpoint's record and docs)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from models.canvases import INK_THRESHOLD, CanvasParams, digit_pool, digit_split, make_canvases
from models.checkpoint import load_checkpoint
from models.detection_eval import Detections, average_precision
from models.detector import DigitDet
from models.normalize import Uint8Classifier
from models.registry import get_architecture
from tests.test_cli import in_process

# One digit a canvas on a flat ground at full contrast: a pixel is ink exactly when it rose at least INK_THRESHOLD
# of the way from the ground to white, which the test can read back from the image alone.
PLAIN = CanvasParams(
    min_digits=1, max_digits=1, min_contrast=1.0, max_contrast=1.0, max_blobs=0, max_lines=0, noise_std=0.0
)


def _box_above(image: np.ndarray, level: float) -> tuple[int, int, int, int]:
    rows = np.flatnonzero((image >= level).any(axis=1))
    cols = np.flatnonzero((image >= level).any(axis=0))
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1


def test_boxes_are_the_inks_tight_boxes_clipped_to_the_canvas() -> None:
    canvases = make_canvases(PLAIN, 60, pool=digit_pool("train"), seed=3)
    size = PLAIN.canvas_size
    touching = 0
    for i, image in enumerate(canvases.images.astype(np.float32)):
        boxes, labels = canvases.objects(i)
        assert len(boxes) == 1 and 0 <= labels[0] <= 9
        ground = float(np.median(image))
        # Within rounding to uint8: the box of slightly stronger ink lies inside it, that of slightly fainter around.
        inner = _box_above(image, ground + (INK_THRESHOLD + 0.03) * (255 - ground))
        outer = _box_above(image, ground + (INK_THRESHOLD - 0.03) * (255 - ground))
        x1, y1, x2, y2 = boxes[0]
        assert outer[0] <= x1 <= inner[0] and outer[1] <= y1 <= inner[1], (i, boxes[0], inner, outer)
        assert inner[2] <= x2 <= outer[2] and inner[3] <= y2 <= outer[3], (i, boxes[0], inner, outer)
        touching += int(x1 == 0 or y1 == 0 or x2 == size or y2 == size)
    assert canvases.boxes.min() >= 0 and canvases.boxes.max() <= size
    assert touching > 0  # some digits are cut by the border, and their boxes clipped to it


def test_canvases_have_the_promised_mix() -> None:
    params = CanvasParams()
    canvases = make_canvases(params, 64, pool=digit_pool("train"), seed=0)
    counts = (canvases.labels >= 0).sum(axis=1)
    assert canvases.images.shape == (64, 96, 96) and canvases.images.dtype == np.uint8
    assert counts.min() >= 1 and counts.max() <= 5 and len(set(counts.tolist())) > 2
    for i in range(len(canvases)):
        boxes, _ = canvases.objects(i)
        ious = _iou_matrix(boxes)
        assert (ious[~np.eye(len(boxes), dtype=bool)] <= params.max_overlap_iou + 1e-6).all()


def _iou_matrix(boxes: np.ndarray) -> np.ndarray:
    from models.detection_eval import box_iou

    return box_iou(boxes, boxes)


def test_heldout_canvases_use_only_heldout_digits() -> None:
    train, heldout = digit_split()
    assert len(train) + len(heldout) == 1797 and not set(train.tolist()) & set(heldout.tolist())
    seen = make_canvases(CanvasParams(), 40, pool=digit_pool("heldout"), seed=1).digit_ids
    assert set(seen[seen >= 0].tolist()) <= set(heldout.tolist())
    taught = make_canvases(CanvasParams(), 40, pool=digit_pool("train"), seed=1).digit_ids
    assert set(taught[taught >= 0].tolist()) <= set(train.tolist())


def test_the_same_seed_makes_the_same_canvases() -> None:
    pool = digit_pool("train")
    a, b = (make_canvases(CanvasParams(), 8, pool=pool, seed=(7, 2)) for _ in range(2))
    c = make_canvases(CanvasParams(), 8, pool=pool, seed=(7, 3))
    assert np.array_equal(a.images, b.images) and np.array_equal(a.boxes, b.boxes)
    assert np.array_equal(a.labels, b.labels) and np.array_equal(a.digit_ids, b.digit_ids)
    assert not np.array_equal(a.images, c.images)


# ---- AP on hand-made cases ---------------------------------------------------------------------------------------

A = np.array([[10, 10, 30, 30]], np.float32)
B = np.array([[50, 50, 70, 80]], np.float32)


def _found(*rows: tuple[np.ndarray, float, int]) -> Detections:
    return Detections(
        boxes=np.concatenate([r[0] for r in rows]).astype(np.float32),
        scores=np.array([r[1] for r in rows], np.float32),
        classes=np.array([r[2] for r in rows], np.int64),
    )


TRUTH = [(np.concatenate([A, B]), np.array([3, 3]))]


def test_perfect_detections_score_one() -> None:
    report = average_precision([_found((A, 0.9, 3), (B, 0.8, 3))], TRUTH, num_classes=10)
    assert report.per_class[3] == pytest.approx(1.0) and report.mean == pytest.approx(1.0)
    assert np.isnan(report.per_class[0])  # no box of that class: no AP, and not in the mean


def test_a_missed_box_halves_recall() -> None:
    report = average_precision([_found((A, 0.9, 3))], TRUTH, num_classes=10)
    assert report.mean == pytest.approx(0.5)


def test_a_duplicate_is_a_false_positive() -> None:
    # TP, then the same box again (FP), then B (TP): precision 1, 1/2, 2/3 at recall 1/2, 1/2, 1.
    report = average_precision([_found((A, 0.9, 3), (A + 1, 0.8, 3), (B, 0.7, 3))], TRUTH, num_classes=10)
    assert report.mean == pytest.approx(0.5 * 1.0 + 0.5 * 2 / 3)
    wrong_class = average_precision([_found((A, 0.9, 3), (B, 0.8, 4))], TRUTH, num_classes=10)
    assert wrong_class.per_class[3] == pytest.approx(0.5) and np.isnan(wrong_class.per_class[4])  # B missed


def test_a_loose_box_counts_at_050_but_not_at_075() -> None:
    loose = np.array([[10, 10, 30, 36]], np.float32)  # IoU 400/520 = 0.77 with A (20x26 against 20x20)
    tighter = average_precision([_found((loose, 0.9, 3))], [(A, np.array([3]))], num_classes=10, iou=0.75)
    assert tighter.mean == pytest.approx(1.0)
    looser = np.array([[10, 10, 30, 40]], np.float32)  # IoU 400/600 = 0.67
    assert average_precision([_found((looser, 0.9, 3))], [(A, np.array([3]))], num_classes=10).mean == 1.0
    assert average_precision([_found((looser, 0.9, 3))], [(A, np.array([3]))], num_classes=10, iou=0.75).mean == 0


# ---- the model -------------------------------------------------------------------------------------------------


def _eager(size: int = 96) -> Uint8Classifier:
    arch = get_architecture("digitdet")
    torch.manual_seed(0)
    return Uint8Classifier(arch.build(), arch.spec.mean, arch.spec.std).eval()


def _canvas_batch(n: int, size: int = 96) -> torch.Tensor:
    images = make_canvases(CanvasParams(canvas_size=size), n, pool=digit_pool("heldout"), seed=5).images
    return torch.from_numpy(images).unsqueeze(1).expand(-1, 3, -1, -1).contiguous()


def test_the_export_forward_gives_k_candidates_in_input_pixels() -> None:
    arch = get_architecture("digitdet")
    assert arch.task == "detect" and arch.spec.labels == tuple("0123456789")
    assert 0.2e6 < sum(p.numel() for p in arch.build().parameters()) < 0.4e6
    with torch.inference_mode():
        out = _eager()(_canvas_batch(3))
        tiny = _eager()(torch.zeros(1, 3, 8, 8, dtype=torch.uint8))
    assert out.shape == (3, 100, 6) and out.dtype == torch.float32
    x1, y1, x2, y2, score, cls = out.unbind(2)
    assert (x1 >= 0).all() and (y1 >= 0).all() and (x2 <= 96).all() and (y2 <= 96).all()
    assert (x1 <= x2).all() and (y1 <= y2).all()
    assert ((score >= 0) & (score <= 1)).all() and (score[:, :-1] >= score[:, 1:]).all()
    assert torch.equal(cls, cls.round()) and cls.min() >= 0 and cls.max() <= 9
    assert tiny.shape == (1, 10 * 2 * 2, 6)  # fewer positions than K: every one


def test_onnx_export_matches_eager(tmp_path: Path) -> None:
    import onnxruntime as ort

    model = _eager()
    path = tmp_path / "digitdet.onnx"
    batch = torch.export.Dim("batch", min=1, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model, (_canvas_batch(2),), str(path), input_names=["input"], output_names=["detections"],
            dynamic_shapes={"x": {0: batch}}, opset_version=17, dynamo=True, external_data=False, verbose=False,
        )  # fmt: skip
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for n in (1, 5):
        x = _canvas_batch(n)
        with torch.inference_mode():
            expected = model(x).numpy()
        (got,) = session.run(None, {"input": x.numpy()})
        assert got.shape == (n, 100, 6)
        _assert_same_candidates(got, expected, atol=1e-4)
    assert path.stat().st_size < 5e6


def _assert_same_candidates(got: np.ndarray, expected: np.ndarray, *, atol: float) -> None:
    """The same scores in order, and each candidate clearly inside the top K found among the other's rows with the
    same class, box and score. Untrained, every score sits near the 0.1 prior: candidates whose scores differ by
    less than float error may swap places between runtimes, and the K-th may be another, equally scored one."""
    for mine, theirs in zip(got, expected, strict=True):
        np.testing.assert_allclose(mine[:, 4], theirs[:, 4], atol=atol, rtol=0)
        for row in theirs[theirs[:, 4] > theirs[-1, 4] + atol]:
            same = (mine[:, 5] == row[5]) & (np.abs(mine[:, :5] - row[:5]).max(axis=1) <= atol)
            assert same.any(), row


def test_a_detector_trains_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "det.pt"
    args = ("train", "--arch", "digitdet", "--dataset", "canvases", "--epochs", "2", "--limit-batches", "1")
    proc = in_process(capsys, *args, "--batch-size", "4", "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "mAP@0.5" in proc.stdout and "AP@0.5 per class" in proc.stdout and "epoch   2/2" in proc.stderr
    ckpt = load_checkpoint(out)
    assert ckpt.spec.architecture == "digitdet" and ckpt.spec.labels == tuple("0123456789")
    assert (ckpt.spec.input.height, ckpt.spec.input.width) == (96, 96)
    network = DigitDet()
    network.load_state_dict(ckpt.state_dict)
    rec = ckpt.record
    assert rec is not None and rec.detection is not None and rec.dataset == "canvases" and rec.duration_s > 0
    det = rec.detection
    assert det.generator == CanvasParams(seed=0) and det.steps == 2 and det.canvases_seen == 8
    assert set(det.heldout_digits) == set(digit_split()[1].tolist()) and det.heldout_canvases == 4
    assert 0 <= det.map_50 <= 1 and 0 <= det.map_75 <= 1 and set(det.ap_50) == set("0123456789")
    assert "all-point" in det.ap_definition and len(det.history) == 2
    refused = in_process(capsys, "train", "--arch", "smallcnn", "--dataset", "canvases", "--out", str(out))
    assert refused.returncode != 0 and "--arch digitdet" in refused.stderr
    for dataset in ("digits", "canvases"):  # torchvision's detectors: refused first, whatever the dataset
        other = in_process(capsys, "train", "--arch", "ssdlite320_mobilenet_v3_large", "--dataset", dataset)
        assert other.returncode != 0
        assert "is a detector this loop does not train (output_layout end2end)" in other.stderr
