"""``visionserve detect`` through a real server process and in-process: a CSV row per box (and one for an image
with none), JSON Lines per image, errors, ``--resume``; and the Python client's ``detect``.

Two detectors: tests/http/test_detect.py's ``bright``, which finds an image's bright rectangle exactly (class
``one`` 0.9, ``zero`` 0.7 on the same box, ``two`` 0.5 at the input's centre), for boxes checked to about a pixel;
and the shipped ``digits-detect`` on a canvas of held-out digits at known boxes, and on a blank image, where it
finds nothing.
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.cli import main
from service.client import Client, DetectedImage
from service.launcher import RunningServer
from tests.conftest import copy_model
from tests.http.conftest import start_server, stop_server
from tests.http.test_detect import SHIPPED_DETECTOR, box_iou, canvas_image, detector_repo, encoded, tolerance, upright

# name -> (height, width, the bright rectangle as a viewer shows it, format, EXIF orientation)
BRIGHT = {
    "wide.png": (37, 201, (150, 5, 190, 30), "PNG", 1),
    "photo.jpg": (300, 400, (100, 50, 310, 220), "JPEG", 1),
    "turned.png": (120, 90, (5, 70, 60, 115), "PNG", 6),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    root = tmp_path_factory.mktemp("detect-cli")
    repo = copy_model(SHIPPED_DETECTOR.parent, detector_repo(root / "repo"), "digits-detect")
    server = start_server(repo, root / "server.log", "--max-images", "2", real_models=("bright", "digits-detect"))
    try:
        yield server
    finally:
        stop_server(server)


def csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_folder_through_the_server_a_row_per_box_then_resumed(
    served: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "images"
    (folder / "sub").mkdir(parents=True)
    for name, (height, width, box, fmt, orientation) in BRIGHT.items():
        (folder / "sub" / name if name == "turned.png" else folder / name).write_bytes(
            encoded(upright(height, width, box), fmt, orientation)
        )
    corrupt = folder / "corrupt.png"
    corrupt.write_bytes(encoded(upright(20, 20, (2, 2, 8, 8)))[:40])
    out = tmp_path / "boxes.csv"
    args = ["detect", "--url", served.url, "--model", "bright", str(folder), "--out", str(out), "--no-progress",
            "--score-threshold", "0.6", "--box-format", "xywh", "--images-per-request", "3"]  # fmt: skip
    assert main(args) == 1  # the corrupt file failed
    summary = capsys.readouterr().err
    assert "searched 4 images" in summary and "3 ok, 1 failed; 6 detections" in summary, summary
    with out.open(newline="") as f:
        header = next(csv.reader(f))
    assert header == ["path", "model", "version", "width", "height", "label", "index", "score", "x", "y", "w", "h",
                      "error"]  # fmt: skip
    rows = csv_rows(out)
    by_path: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        by_path.setdefault(Path(row["path"]).name, []).append(row)
    assert sorted(by_path) == sorted([*BRIGHT, "corrupt.png"])
    for name, (height, width, box, _, _) in BRIGHT.items():
        found = by_path[name]
        assert [(r["label"], r["index"]) for r in found] == [("one", "1"), ("zero", "0")], found  # best first
        assert all((r["width"], r["height"], r["model"], r["version"], r["error"]) == (str(width), str(height),
                   "bright", "1", "") for r in found)  # fmt: skip
        x, y, w, h = (float(found[0][c]) for c in "xywh")
        assert np.abs(np.array([x, y, x + w, y + h]) - box).max() <= tolerance(height, width), (name, found[0])
        assert float(found[0]["score"]) == pytest.approx(0.9)
    (bad,) = by_path["corrupt.png"]
    assert bad["error"] and bad["label"] == bad["width"] == bad["x"] == ""

    assert main([*args, "--resume", "--box-format", "xyxy"]) == 2  # another layout than the file's
    assert "not those of --box-format xyxy" in capsys.readouterr().err
    # Mend the corrupt file and go on: only it is sent again, and its rows replace its error's.
    corrupt.write_bytes(encoded(upright(20, 30, (2, 2, 8, 8))))
    assert main([*args, "--resume"]) == 0
    summary = capsys.readouterr().err
    assert "searched 1 images" in summary and "1 ok, 0 failed; 2 detections; 3 skipped" in summary, summary
    again = csv_rows(out)
    assert again[: len(rows) - 1] == [r for r in rows if r is not bad]  # the earlier rows, as they were
    assert [(r["label"], r["width"], r["error"]) for r in again[len(rows) - 1 :]] == [("one", "30", ""),
                                                                                     ("zero", "30", "")]  # fmt: skip


def blank_png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (150, 90), (0, 0, 0)).save(out, "PNG")
    return out.getvalue()


def test_the_shipped_detector_in_process_and_served_alike_an_empty_image_counted_done(
    served: RunningServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "canvases"
    folder.mkdir()
    data, boxes, labels = canvas_image(301, 187)
    (folder / "canvas.png").write_bytes(data)
    (folder / "blank.png").write_bytes(blank_png())
    local, remote = tmp_path / "local.csv", tmp_path / "served.jsonl"
    common = ["detect", "--model", "digits-detect", str(folder), "--no-progress"]
    assert main([*common, "--repository", str(SHIPPED_DETECTOR.parent), "--device", "cpu", "--out", str(local)]) == 0
    assert main([*common, "--url", served.url, "--out", str(remote)]) == 0
    capsys.readouterr()

    lines = {Path(line["path"]).name: line for line in map(json.loads, remote.read_text().splitlines())}
    assert sorted(lines) == ["blank.png", "canvas.png"]  # a JSON Lines line per image
    assert lines["blank.png"] == {"path": str(folder / "blank.png"), "model": "digits-detect", "version": 1,
                                  "width": 150, "height": 90, "detections": [], "error": None}  # fmt: skip
    served_found = lines["canvas.png"]["detections"]
    assert (lines["canvas.png"]["width"], lines["canvas.png"]["height"]) == (301, 187)
    for box, label in zip(boxes, labels, strict=True):  # each pasted digit found, with its label, at its box
        best = max((box_iou(d["box"], box) for d in served_found if d["label"] == str(label)), default=0.0)
        assert best >= 0.7, (label, box.round(1).tolist(), served_found)

    rows = csv_rows(local)
    (blank,) = [r for r in rows if r["path"].endswith("blank.png")]  # one row: read, nothing found
    assert (blank["width"], blank["height"], blank["label"], blank["x1"], blank["error"]) == ("150", "90", "", "", "")
    canvas = [r for r in rows if r["path"].endswith("canvas.png")]
    assert [r["label"] for r in canvas] == [d["label"] for d in served_found]  # in process: the server's answers
    for row, d in zip(canvas, served_found, strict=True):
        assert [float(row[c]) for c in ("x1", "y1", "x2", "y2")] == pytest.approx(d["box"], abs=1e-2)
        assert float(row["score"]) == pytest.approx(d["score"], abs=1e-4)

    # The image with no detections was done: --resume sends nothing again.
    before = local.read_text()
    assert main([*common, "--repository", str(SHIPPED_DETECTOR.parent), "--device", "cpu", "--out", str(local),
                 "--resume"]) == 0  # fmt: skip
    assert "searched 0 images" in capsys.readouterr().err and local.read_text() == before
    # The wrong command for the model says which one fits.
    assert main(["classify", "--model", "digits-detect", str(folder), "--no-progress", "--repository",
                 str(SHIPPED_DETECTOR.parent), "--device", "cpu"]) == 2  # fmt: skip
    assert "run visionserve detect instead" in capsys.readouterr().err


def test_the_python_client_detects(served: RunningServer) -> None:
    height, width, box, fmt, orientation = BRIGHT["turned.png"]
    image = encoded(upright(height, width, box), fmt, orientation)
    with Client(served.url, model="bright") as client:
        plain, cut, failed = client.detect([image, image, b"not an image"])  # split: the server takes 2 a request
        (only,) = client.detect(image, classes=["two"], box_format="cxcywh", normalized=True)
    assert isinstance(plain, DetectedImage) and plain.ok and (plain.width, plain.height) == (width, height)
    assert plain.model == "bright" and plain.version == 1 and plain.detections is not None
    assert [d.label for d in plain.detections] == ["one", "zero", "two"] and cut.detections == plain.detections
    assert np.abs(np.array(plain.detections[0].box) - box).max() <= tolerance(height, width)
    assert not failed.ok and failed.error and "recognised" in failed.error
    assert only.detections is not None and [d.label for d in only.detections] == ["two"]
    x1, y1, x2, y2 = plain.detections[2].box
    assert only.detections[0].box == pytest.approx([(x1 + x2) / 2 / width, (y1 + y2) / 2 / height,
                                                    (x2 - x1) / width, (y2 - y1) / height])  # fmt: skip


def test_the_readmes_detect_example_runs(served: RunningServer) -> None:
    """The README's Python example of ``detect``, run as it is but against the test server, prints what it shows."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    section = text.split("## Detect objects in a folder, or from Python", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    shown = re.findall(r"```text\n(.*?)```", section, re.S)[-1]
    code = code.replace("http://127.0.0.1:8000", served.url)
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == shown
