"""``visionserve segment`` as a user runs it on a folder: COCO's results JSON that pycocotools' ``COCO.loadRes`` and
``COCOeval`` (iouType ``segm``) read against the folder's own annotations, JSON Lines with the masks, and overlays
with each mask drawn; through a server and in this process alike. The segmenter is tests/service/test_segment.py's
(it outlines an image's bright rectangle)."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as coco_mask
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from service.cli import main
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.service.test_segment import picture, segmenter_repo

SHAPES = {
    "139.png": (64, 64, (8, 12, 40, 36)),
    "285.png": (128, 64, (16, 8, 80, 40)),
    "tall.png": (48, 96, (6, 12, 30, 60)),
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return segmenter_repo(tmp_path_factory.mktemp("segment-cli"))


@pytest.fixture(scope="module")
def served(repo: Path) -> Iterator[InProcessServer]:
    with InProcessServer(ServerSettings(repository=str(repo), port=0, grpc_port=0)) as running:
        yield running


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pictures")
    for name, (width, height, box) in SHAPES.items():
        (root / name).write_bytes(picture(width, height, box))
    return root


def annotations(path: Path) -> Path:
    """The folder's ground truth in COCO's form: each picture's rectangle, class ``one`` (id 7)."""
    images, annotated = [], []
    for n, (name, (width, height, (x1, y1, x2, y2))) in enumerate(sorted(SHAPES.items()), start=1):
        images.append({"id": 100 + n, "file_name": name, "width": width, "height": height})
        full = np.zeros((height, width), dtype=np.uint8, order="F")
        full[y1:y2, x1:x2] = 1
        rle = coco_mask.encode(full)
        rle["counts"] = rle["counts"].decode()
        annotated.append({"id": n, "image_id": 100 + n, "category_id": 7, "segmentation": rle, "iscrowd": 0,
                          "area": float(full.sum()), "bbox": [x1, y1, x2 - x1, y2 - y1]})  # fmt: skip
    categories = [{"id": 7, "name": "one"}, {"id": 8, "name": "two"}]
    path.write_text(json.dumps({"images": images, "annotations": annotated, "categories": categories}))
    return path


def segm_ap(truth: Path, results: Path) -> tuple[float, float]:
    """(mask AP@[.5:.95], AP@0.5) by pycocotools' COCOeval."""
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(truth))
        found = gt.loadRes(str(results))
        evaluation = COCOeval(gt, found, iouType="segm")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    return float(evaluation.stats[0]), float(evaluation.stats[1])


def test_coco_results_json_scored_by_cocoeval_with_the_folder_s_ids_and_overlays(
    served: InProcessServer, folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = annotations(tmp_path / "truth.json")
    out, drawn = tmp_path / "results.json", tmp_path / "overlays"
    assert main(["segment", "--url", served.url, "--model", "seg", str(folder), "--no-progress", "--out", str(out),
                 "--annotations", str(truth), "--overlays", str(drawn)]) == 0  # fmt: skip
    assert "segmented 3 images" in (summary := capsys.readouterr().err) and "3 detections" in summary, summary
    results = json.loads(out.read_text())
    assert sorted(r["image_id"] for r in results) == [101, 102, 103] and {r["category_id"] for r in results} == {7}
    ap, ap_50 = segm_ap(truth, out)
    assert ap_50 == pytest.approx(1.0) and ap > 0.6  # every mask found; its corners rounded
    shown = np.asarray(Image.open(drawn / "285.png"))
    assert shown.shape == (64, 128, 3)
    assert tuple(shown[20, 40]) != (255, 255, 255) and tuple(shown[50, 100]) == (20, 20, 20)  # tinted inside only


def test_default_ids_jsonl_with_masks_and_the_in_process_mode(
    repo: Path, folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    coco, lines = tmp_path / "results.json", tmp_path / "results.jsonl"
    common = ["segment", "--model", "seg", str(folder), "--no-progress", "--repository", str(repo), "--device", "cpu"]
    assert main([*common, "--out", str(coco)]) == 0
    assert main([*common, "--out", str(lines), "--mask-format", "polygon"]) == 0
    capsys.readouterr()
    ids = {r["image_id"] for r in json.loads(coco.read_text())}
    assert {139, 285} <= ids and len(ids) == 3  # a number's stem is its id; tall.png its place
    rows = {Path(r["path"]).name: r for r in map(json.loads, lines.read_text().splitlines())}
    [instance] = rows["285.png"]["instances"]
    assert instance["label"] == "one" and len(instance["mask"]["polygons"]) == 1
    assert main([*common, "--out", str(tmp_path / "again.json"), "--mask-format", "png"]) == 2
    assert "RLE" in capsys.readouterr().err
