"""Detectors exported elsewhere, placed by ``export --onnx F --task detect --output-layout L`` and served: one graph
in each layout, built here from the exact bright-rectangle detector of tests/http/test_detect.py (the rectangle's
box at 0.9, a duplicate half a pixel off at 0.8, a fixed box at the input's centre at 0.5, a decoy at 0.1), taking
float input scaled to 0..1 as YOLO exports do. Each is gated by the detection parity gate on the rows the server
reads, then served; an image of odd size, EXIF-turned, comes back with the rectangle in its own pixels. A graph whose
outputs fit no layout is refused at export, naming what does not fit; a request's suppression options on a graph
that suppresses itself are a 400 that says why."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from service.core.repository import ModelRepository
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.http.test_detect import CENTRE, IN_H, IN_W, LABELS, encoded, tolerance, upright
from tests.test_cli import in_process

C = len(LABELS)


class BrightRows(torch.nn.Module):
    """The rows ``[N, 4, 6]`` (x1, y1, x2, y2, score, class) of the bright rectangle, from 0..1 float input; the
    decoy under the default threshold last."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bright = (x.mean(1) > 0.5).float()
        cols, rows = bright.amax(1), bright.amax(2)
        ax = torch.arange(IN_W, dtype=torch.float32)
        ay = torch.arange(IN_H, dtype=torch.float32)
        x1 = (cols * ax + (1 - cols) * IN_W).amin(1)
        x2 = (cols * (ax + 1)).amax(1)
        y1 = (rows * ay + (1 - rows) * IN_H).amin(1)
        y2 = (rows * (ay + 1)).amax(1)
        box = torch.stack([x1, y1, x2, y2], 1)
        one = torch.ones_like(x1)[:, None]

        def row(b: torch.Tensor, score: float, cls: float) -> torch.Tensor:
            return torch.cat([b, one * score, one * cls], 1)

        centre = one * torch.tensor(CENTRE)
        decoy = one * torch.tensor([0.0, 0.0, 4.0, 4.0])
        return torch.stack([row(box, 0.9, 1), row(box + 0.5, 0.8, 1), row(centre, 0.5, 2), row(decoy, 0.1, 0)], 1)


def _scores(rows: torch.Tensor) -> torch.Tensor:
    """``[N, A, C]``: each row's score at its class, 0 elsewhere."""
    classes = torch.nn.functional.one_hot(rows[..., 5].long(), C).float()
    return classes * rows[..., 4:5]


def _centre_size(rows: torch.Tensor) -> torch.Tensor:
    xy1, xy2 = rows[..., 0:2], rows[..., 2:4]
    return torch.cat([(xy1 + xy2) / 2, xy2 - xy1], -1)


class InLayout(torch.nn.Module):
    def __init__(self, layout: str, transposed: bool = False) -> None:
        super().__init__()
        self.rows, self.layout, self.transposed = BrightRows(), layout, transposed

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        rows = self.rows(x)
        if self.layout == "yolo":  # [N, 4 + C, A], ultralytics' default; [N, A, 4 + C] transposed
            out = torch.cat([_centre_size(rows), _scores(rows)], -1)
            return out if self.transposed else out.transpose(1, 2)
        if self.layout == "yolov5":  # [N, A, 5 + C]: objectness 1, the class's score
            return torch.cat([_centre_size(rows), torch.ones_like(rows[..., :1]), _scores(rows)], -1)
        kept = rows[:, [0, 2, 3]]  # what a graph that suppresses itself answers: the duplicate gone
        if self.layout == "end2end":
            return kept
        n = kept.shape[0]
        count = torch.full((n, 1), 3, dtype=torch.int32)
        return count, kept[..., :4], kept[..., 4], kept[..., 5].to(torch.int32)


def export_graph(path: Path, module: torch.nn.Module, layout: str) -> Path:
    names = ["num_dets", "det_boxes", "det_scores", "det_classes"] if layout == "efficientnms" else ["output0"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(), (torch.zeros(1, 3, IN_H, IN_W),), str(path), input_names=["images"], output_names=names,
            opset_version=17, dynamo=False, dynamic_axes={"images": {0: "batch"}, **{n: {0: "batch"} for n in names}},
        )  # fmt: skip
    return path


LAYOUTS = [("yolo", False), ("yolo", True), ("yolov5", False), ("end2end", False), ("efficientnms", False)]


@pytest.fixture(scope="module")
def placed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """Every layout placed into one repository (model name -> the export's output); the root."""
    root = tmp_path_factory.mktemp("outside-detectors")
    labels = root / "labels.txt"
    labels.write_text("\n".join(LABELS))
    repository = root / "repo"
    printed = {}
    capsys = _Capture()
    for layout, transposed in LAYOUTS:
        name = layout + ("-t" if transposed else "")
        graph = export_graph(root / f"{name}.onnx", InLayout(layout, transposed), layout)
        code, out = capsys.run(
            "export", "--onnx", str(graph), "--task", "detect", "--output-layout", layout, "--input-size",
            f"{IN_H}x{IN_W}", "--labels", str(labels), "--name", name, "--repository", str(repository),
            "--no-latency", "--no-progress",
        )  # fmt: skip
        assert code == 0, out
        printed[name] = out
    yield repository, printed


class _Capture:
    """``visionserve`` in process with its output captured, for a module-scoped fixture (capsys is per test)."""

    def run(self, *args: str) -> tuple[int, str]:
        import contextlib
        import io

        from service.cli import main

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                code = main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        return code, out.getvalue()


@pytest.fixture(scope="module")
def served(placed: tuple[Path, dict[str, str]]) -> Iterator[InProcessServer]:
    settings = ServerSettings(repository=str(placed[0]), port=0, grpc_port=0, max_images_per_request=8)
    with InProcessServer(settings) as running:
        yield running


@pytest.mark.parametrize(("layout", "transposed"), LAYOUTS)
def test_each_layout_is_placed_with_its_parity_and_served_in_the_images_own_pixels(
    placed: tuple[Path, dict[str, str]], served: InProcessServer, layout: str, transposed: bool
) -> None:
    name = layout + ("-t" if transposed else "")
    spec = ModelRepository(placed[0]).model(name).latest.spec
    assert (spec.task, spec.output_layout, spec.resize, spec.pad_value) == ("detect", layout, "letterbox", 114)
    assert spec.mean == (0.0, 0.0, 0.0) and spec.std == (1.0, 1.0, 1.0)  # x / 255, as YOLO exports take it
    record = spec.exports[0].detection_parity
    assert record is not None and record.unmatched == 0 and record.boxes > 0, placed[1][name]
    box = (60, 40, 200, 110)
    data = encoded(upright(120, 260, box), "JPEG", 6)  # stored turned; shown 260 wide, 120 high
    with served.client() as client:
        r = client.post(f"/v1/models/{name}/detect", content=data, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (260, 120)
    found = result["detections"]
    assert [d["label"] for d in found] == ["one", "two"]  # the duplicate suppressed (by the server or the graph)
    assert np.abs(np.array(found[0]["box"]) - box).max() <= tolerance(120, 260)
    assert found[0]["score"] == pytest.approx(0.9)


def test_a_graph_that_suppresses_itself_refuses_suppression_options(served: InProcessServer) -> None:
    data = encoded(upright(50, 50, (10, 10, 30, 30)))
    with served.client() as client:
        for query in ("iou_threshold=0.5", "class_agnostic=true"):
            r = client.post(f"/v1/models/end2end/detect?{query}", content=data, headers={"content-type": "image/png"})
            assert r.status_code == 400 and "suppresses its own boxes (output_layout end2end)" in r.text, r.text
        kept = client.post("/v1/models/efficientnms/detect?score_threshold=0.6&classes=one", content=data,
                           headers={"content-type": "image/png"})  # fmt: skip
        assert kept.status_code == 200 and [d["label"] for d in kept.json()["results"][0]["detections"]] == ["one"]
        yolo = client.post("/v1/models/yolo/detect?iou_threshold=0.99", content=data,
                           headers={"content-type": "image/png"})  # fmt: skip
        assert yolo.status_code == 200 and len(yolo.json()["results"][0]["detections"]) == 3  # the duplicate kept


@pytest.mark.parametrize(
    ("layout", "labels", "message"),
    [
        ("yolo", 5, "neither axis 1 nor axis 2 of its output [1, 7, 4] is 9 values per anchor"),
        ("efficientnms", 3, "outputs num_dets, det_boxes, det_scores, det_classes are needed"),
        ("end2end", 3, "rows of 6"),
    ],
)
def test_a_graph_whose_outputs_fit_no_layout_is_refused_naming_what(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], layout: str, labels: int, message: str
) -> None:
    graph = export_graph(tmp_path / "g.onnx", InLayout("yolo"), "yolo")  # [N, 7, 4]: yolo with 3 classes
    names = tmp_path / "labels.txt"
    names.write_text("\n".join(f"c{i}" for i in range(labels)))
    proc = in_process(
        capsys, "export", "--onnx", str(graph), "--task", "detect", "--output-layout", layout, "--input-size",
        f"{IN_H}x{IN_W}", "--labels", str(names), "--name", "g", "--repository", str(tmp_path / "repo"),
        "--no-latency", "--no-progress",
    )  # fmt: skip
    assert proc.returncode != 0 and f"do not fit output_layout {layout}" in proc.stderr + proc.stdout
    assert message in proc.stderr + proc.stdout
    assert not (tmp_path / "repo" / "g").exists()  # nothing written


def test_the_layout_flags_are_checked_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = [
        "--onnx",
        "x.onnx",
        "--labels",
        "l.txt",
        "--input-size",
        "64",
        "--name",
        "x",
        "--repository",
        str(tmp_path),
    ]
    missing = in_process(capsys, "export", *common, "--task", "detect")
    assert missing.returncode != 0 and "--task detect needs --output-layout" in missing.stderr + missing.stdout
    stray = in_process(capsys, "export", *common, "--output-layout", "yolo")
    assert stray.returncode != 0 and "--output-layout is for detectors" in stray.stderr + stray.stdout
    assert json.dumps(sorted(p.name for p in tmp_path.iterdir())) == "[]"
