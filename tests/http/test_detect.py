"""Detection served: boxes in the image's own pixels over the image API, v2 (HTTP and gRPC) and a real server.

The detector is built here: a graph that finds an image's bright rectangle exactly (the pixels whose channel mean is
over 127.5; its first and last bright column and row) and answers it as ``[N, 5, 6]`` candidates in input pixels:
the box (class ``one``, 0.9), a duplicate half a pixel off (``one``, 0.8: suppressed), the same box as ``zero``
(0.7: suppressed only across classes), a fixed box at the input's centre (``two``, 0.5) and a decoy under the
default score threshold (``zero``, 0.1). Letterboxed into 64x48, so the answer is exact to about one input pixel:
``1 / scale`` original pixels.
"""

from __future__ import annotations

import io
import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.core.boxes import letterbox_transform
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.conftest import copy_model
from tests.http.conftest import start_server
from tests.http.test_image_api import digit_png

IN_W, IN_H = 64, 48
LABELS = ("zero", "one", "two")
CENTRE = (IN_W / 2 - 4, IN_H / 2 - 4, IN_W / 2 + 4, IN_H / 2 + 4)


def build_detector(path: Path) -> None:
    import torch

    class Bright(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bright = (x.float().mean(1) > 127.5).float()  # [N, H, W]
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
            rows_ = [row(box, 0.9, 1), row(box + 0.5, 0.8, 1), row(box, 0.7, 0), row(centre, 0.5, 2)]
            return torch.stack([*rows_, row(decoy, 0.1, 0)], 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            Bright().eval(), (torch.zeros(1, 3, IN_H, IN_W, dtype=torch.uint8),), str(path),
            input_names=["input"], output_names=["candidates"], opset_version=17, dynamo=False,
            dynamic_axes={"input": {0: "batch"}, "candidates": {0: "batch"}},
        )  # fmt: skip


def detector_repo(root: Path) -> Path:
    version = root / "bright" / "1"
    version.mkdir(parents=True)
    build_detector(version / "model.onnx")
    spec = {
        "name": "bright", "architecture": "bright-rectangle", "task": "detect", "resize": "letterbox",
        "output_layout": "candidates", "input": {"height": IN_H, "width": IN_W}, "resize_size": IN_W,
        "mean": [0, 0, 0], "std": [1, 1, 1], "labels": list(LABELS),
    }  # fmt: skip
    (version / "spec.json").write_text(json.dumps(spec))
    (root / "bright" / "config.toml").write_text("max_batch_size = 8\nmax_queue_delay_ms = 1.0\n")
    return root


@pytest.fixture(scope="module")
def repo(digits_export: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = detector_repo(tmp_path_factory.mktemp("detect"))
    return copy_model(digits_export, root)


@pytest.fixture(scope="module")
def detector(repo: Path) -> Iterator[InProcessServer]:
    settings = ServerSettings(repository=str(repo), port=0, grpc_port=0, max_images_per_request=8)
    with InProcessServer(settings, grpc=True) as running:
        yield running


def upright(height: int, width: int, box: tuple[int, int, int, int]) -> np.ndarray:
    """A dark image with a white rectangle at ``box`` (x1, y1, x2, y2; x2 and y2 exclusive)."""
    pixels = np.full((height, width, 3), 20, dtype=np.uint8)
    x1, y1, x2, y2 = box
    pixels[y1:y2, x1:x2] = 255
    return pixels


# EXIF orientation -> how the upright image is stored so that a viewer turning it by that orientation shows it.
STORED = {3: Image.Transpose.ROTATE_180, 6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}


def encoded(pixels: np.ndarray, fmt: str = "PNG", orientation: int = 1) -> bytes:
    img = Image.fromarray(pixels)
    out = io.BytesIO()
    if orientation == 1:
        img.save(out, fmt)
    else:
        exif = Image.Exif()
        exif[0x0112] = orientation
        img.transpose(STORED[orientation]).save(out, fmt, exif=exif.tobytes())
    return out.getvalue()


# (height, width, box, format, orientation): wide, tall, tiny, 4000 px (a JPEG: draft decoding), EXIF-turned.
CASES = [
    (37, 201, (150, 5, 190, 30), "PNG", 1),
    (301, 53, (10, 200, 40, 290), "PNG", 1),
    (7, 9, (2, 1, 6, 5), "PNG", 1),
    (3000, 4000, (1000, 500, 3100, 2200), "JPEG", 1),
    (120, 90, (5, 70, 60, 115), "PNG", 6),
    (90, 120, (70, 5, 115, 60), "JPEG", 8),
    (90, 120, (10, 20, 50, 70), "PNG", 3),
]


def tolerance(height: int, width: int) -> float:
    """About one input pixel, in the original's pixels (the rectangle's edge is found to a pixel after resizing)."""
    t = letterbox_transform(width, height, IN_W, IN_H)
    return 1.0 / min(t.scale_x, t.scale_y) + 0.5


@pytest.mark.parametrize(("height", "width", "box", "fmt", "orientation"), CASES)
def test_boxes_come_back_in_the_images_own_pixels(
    detector: InProcessServer, height: int, width: int, box: tuple[int, int, int, int], fmt: str, orientation: int
) -> None:
    data = encoded(upright(height, width, box), fmt, orientation)
    with detector.client() as client:
        r = client.post("/v1/models/bright/detect", content=data, headers={"content-type": f"image/{fmt.lower()}"})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (width, height)  # as a viewer shows it
    found = result["detections"]
    assert [d["label"] for d in found] == ["one", "zero", "two"]  # the duplicate and the decoy are gone
    assert found[0]["score"] == pytest.approx(0.9) and found[0]["index"] == 1
    assert np.abs(np.array(found[0]["box"]) - np.array(box)).max() <= tolerance(height, width)
    t = letterbox_transform(width, height, IN_W, IN_H)
    centre = [(CENTRE[0] - t.pad_x) / t.scale_x, (CENTRE[1] - t.pad_y) / t.scale_y]
    clipped = [min(max(c, 0), side) for c, side in zip(centre, (width, height), strict=True)]
    assert found[2]["box"][:2] == pytest.approx(clipped, abs=1e-3)


def test_thresholds_classes_agnostic_and_formats(detector: InProcessServer) -> None:
    box = (20, 10, 60, 40)
    data = encoded(upright(80, 100, box))

    def detect(query: str) -> list[dict[str, object]]:
        with detector.client() as client:
            r = client.post(f"/v1/models/bright/detect?{query}", content=data, headers={"content-type": "image/png"})
        assert r.status_code == 200, r.text
        return r.json()["results"][0]["detections"]  # type: ignore[no-any-return]

    assert [d["label"] for d in detect("score_threshold=0.6")] == ["one", "zero"]
    assert [d["label"] for d in detect("score_threshold=0.05")] == ["one", "zero", "two", "zero"]
    assert [d["label"] for d in detect("iou_threshold=0.99")] == ["one", "one", "zero", "two"]
    assert [d["label"] for d in detect("class_agnostic=true")] == ["one", "two"]
    assert [d["label"] for d in detect("classes=two&classes=0")] == ["zero", "two"]
    assert [d["label"] for d in detect("max_detections=1")] == ["one"]
    xyxy = np.array(detect("")[0]["box"])
    assert detect("box_format=xywh")[0]["box"] == pytest.approx([*xyxy[:2], *(xyxy[2:] - xyxy[:2])])
    centre = [(xyxy[0] + xyxy[2]) / 2, (xyxy[1] + xyxy[3]) / 2, *(xyxy[2:] - xyxy[:2])]
    assert detect("box_format=cxcywh")[0]["box"] == pytest.approx(centre)
    assert detect("normalized=true")[0]["box"] == pytest.approx(xyxy / [100, 80, 100, 80])


@pytest.mark.parametrize(
    ("route", "query", "message"),
    [
        ("bright/detect", "classes=seven", "unknown class 'seven'"),
        ("bright/detect", "classes=3", "unknown class '3'"),
        ("bright/detect", "score_threshold=2", "score_threshold"),
        ("bright/detect", "box_format=xxyy", "box_format"),
        ("bright/classify", "", "POST /v1/models/bright/detect instead"),
        ("digits/detect", "", "POST /v1/models/digits/classify instead"),
    ],
)
def test_refusals_name_what_fits(detector: InProcessServer, route: str, query: str, message: str) -> None:
    with detector.client() as client:
        r = client.post(f"/v1/models/{route}?{query}", content=encoded(upright(20, 20, (2, 2, 8, 8))),
                        headers={"content-type": "image/png"})  # fmt: skip
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_a_corrupt_file_in_a_multipart_request_fails_alone(detector: InProcessServer) -> None:
    good = encoded(upright(50, 70, (10, 10, 30, 40)))
    files = [("a", ("a.png", good, "image/png")), ("b", ("b.png", b"no image", "image/png")),
             ("c", ("c.png", good, "image/png"))]  # fmt: skip
    with detector.client() as client:
        r = client.post("/v1/models/bright/detect", files=files)
    assert r.status_code == 200, r.text
    a, b, c = r.json()["results"]
    assert "error" in b and b["filename"] == "b.png" and "width" not in b
    assert a["filename"] == "a.png" and a["width"] == 70 and a["detections"] == c["detections"]
    assert a["detections"][0]["label"] == "one"


def test_a_heavy_answer_is_streamed_in_pieces_as_the_same_json(
    detector: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past ENCODED_HERE boxes the route writes its JSON itself, a piece an image (tests/http/test_event_loop.py:
    the heaviest answer off the event loop): the bytes a client reads are the ones litestar would have written."""
    from service.frontend.http import image_api

    good = encoded(upright(50, 70, (10, 10, 30, 40)))
    files = [("a", ("a.png", good, "image/png")), ("b", ("b.png", b"no image", "image/png")),
             ("c", ("c.png", good, "image/png"))]  # fmt: skip
    with detector.client() as client:
        whole = client.post("/v1/models/bright/detect?score_threshold=0.05", files=files)
        monkeypatch.setattr(image_api, "ENCODED_HERE", 0)  # every answer with a box is "heavy"
        pieces = client.post("/v1/models/bright/detect?score_threshold=0.05", files=files)
    assert whole.status_code == pieces.status_code == 200, pieces.text
    assert pieces.content == whole.content and pieces.json()["results"][0]["detections"], pieces.text
    assert pieces.headers["content-type"] == whole.headers["content-type"] == "application/json"
    assert "content-length" not in pieces.headers and pieces.headers["transfer-encoding"] == "chunked"


def test_v2_answers_detections_in_original_pixels_for_image_and_input_pixels_for_input(
    detector: InProcessServer,
) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    box = (40, 20, 90, 60)
    data = encoded(upright(100, 160, box))
    client = httpclient.InferenceServerClient(detector.url.removeprefix("http://"))
    meta = client.get_model_metadata("bright")
    assert [(o["name"], o["datatype"], o["shape"]) for o in meta["outputs"]] == [
        ("DETECTIONS", "FP32", [-1, 100, 6]), ("NUM_DETECTIONS", "INT32", [-1])
    ]  # fmt: skip
    image = httpclient.InferInput("IMAGE", [2], "BYTES")
    image.set_data_from_numpy(np.array([data, data], dtype=object))
    result = client.infer("bright.image", [image], parameters={"score_threshold": 0.6, "max_detections": 5})
    boxes, counts = result.as_numpy("DETECTIONS"), result.as_numpy("NUM_DETECTIONS")
    assert boxes.shape == (2, 5, 6) and counts.tolist() == [2, 2]
    assert np.abs(boxes[0, 0, :4] - box).max() <= tolerance(100, 160) and boxes[0, 0, 5] == 1
    assert not boxes[:, 2:].any()  # padding past each image's count

    pixels = np.zeros((1, 3, IN_H, IN_W), dtype=np.uint8)
    pixels[:, :, 10:20, 5:30] = 255
    tensor = grpcclient.InferInput("INPUT", [1, 3, IN_H, IN_W], "UINT8")
    tensor.set_data_from_numpy(pixels)
    grpc = grpcclient.InferenceServerClient(detector.grpc_target)
    answer = grpc.infer("bright", [tensor], parameters={"classes": "one,two"})
    assert answer.as_numpy("NUM_DETECTIONS").tolist() == [2]
    assert answer.as_numpy("DETECTIONS")[0, 0].tolist() == [5, 10, 30, 20, pytest.approx(0.9), 1]
    assert answer.as_numpy("DETECTIONS")[0, 1, 5] == 2


def test_metrics_count_detections_per_image(detector: InProcessServer) -> None:
    with detector.client() as client:
        client.post("/v1/models/bright/detect", content=encoded(upright(30, 30, (1, 1, 9, 9))),
                    headers={"content-type": "image/png"})  # fmt: skip
        text = client.get("/metrics").text
    counts = [line for line in text.splitlines() if line.startswith("visionserve_detections_per_image_count{")]
    assert counts and all('model="bright"' in line for line in counts)


def test_a_real_server_detects(repo: Path, tmp_path: Path) -> None:
    running = start_server(repo, tmp_path / "server.log", real_models=("bright", "digits"))
    import httpx

    data = encoded(upright(333, 517, (100, 50, 400, 300)), "JPEG", 6)
    r = httpx.post(f"{running.url}/v1/models/bright/detect", content=data, headers={"content-type": "image/jpeg"})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (517, 333)
    found = np.array(result["detections"][0]["box"])
    assert np.abs(found - (100, 50, 400, 300)).max() <= tolerance(333, 517)


SHIPPED_DETECTOR = Path(__file__).parents[2] / "examples" / "model_repository" / "digits-detect"


def canvas_image(width: int, height: int, strip: int = 60) -> tuple[bytes, np.ndarray, np.ndarray]:
    """A generated canvas of held-out digits (2-3, none cut by the border), a ``strip`` rows high band of it holding
    every digit, resized to ``width`` x ``height``: (its PNG, the digits' boxes in its pixels, their labels). The
    first seed whose digits fit the band: the same image every run."""
    from models.canvases import CanvasParams, digit_pool, make_canvases

    params = CanvasParams(min_digits=2, max_digits=3, min_scale_px=16, max_scale_px=32, max_off_border=0.0)
    for seed in range(200):
        canvases = make_canvases(params, 1, pool=digit_pool("heldout"), seed=seed)
        boxes, labels = canvases.objects(0)
        top = max(0, min(int(boxes[:, 1].min()) - 3, params.canvas_size - strip))
        if len(boxes) >= 2 and boxes[:, 3].max() <= top + strip - 3:
            break
    else:
        raise AssertionError("no canvas's digits fit the band")
    band = canvases.images[0, top : top + strip]
    image = Image.fromarray(band).convert("RGB").resize((width, height), Image.Resampling.BILINEAR)
    out = io.BytesIO()
    image.save(out, "PNG")
    scale = np.array([width / band.shape[1], height / strip] * 2)
    return out.getvalue(), (boxes - [0, top, 0, top]) * scale, labels


def box_iou(a: list[float], b: np.ndarray) -> float:
    iw = min(a[2], b[2]) - max(a[0], b[0])
    ih = min(a[3], b[3]) - max(a[1], b[1])
    inter = max(iw, 0) * max(ih, 0)
    return float(inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter))


def test_the_shipped_detector_finds_a_canvas_digits_in_the_images_own_pixels(tmp_path: Path) -> None:
    """The detector `make serve` serves (examples/model_repository/digits-detect), served for real: a canvas of
    held-out digits resized to an odd 301x187 (letterboxed to 96x60 inside the server) comes back with each digit's
    label and its box, in the 301x187 image's pixels, at IoU >= 0.7."""
    import httpx

    repo = copy_model(SHIPPED_DETECTOR.parent, tmp_path / "repo", "digits-detect")
    running = start_server(repo, tmp_path / "server.log", real_models=("digits-detect",))
    data, boxes, labels = canvas_image(301, 187)
    r = httpx.post(f"{running.url}/v1/models/digits-detect/detect", content=data,
                   headers={"content-type": "image/png"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (301, 187)
    found = result["detections"]
    for box, label in zip(boxes, labels, strict=True):
        best = max((box_iou(d["box"], box) for d in found if d["label"] == str(label)), default=0.0)
        assert best >= 0.7, (label, box.round(1).tolist(), found)


def test_a_detector_and_a_classifier_share_one_memory_budget(repo: Path, tmp_path: Path) -> None:
    """Both on demand, 100 MB each (their config's ``[faults] resident_bytes``) under a 150 MB budget: each request
    to the other task's model evicts the idle one and loads its own, and each answers as its task does."""
    import httpx

    root = tmp_path / "repo"
    for name in ("bright", "digits"):
        shutil.copytree(repo / name, root / name)
        (root / name / "config.toml").write_text(
            'residency = "on_demand"\nmax_batch_size = 8\nmax_queue_delay_ms = 1.0\n'
            "[faults]\nresident_bytes = 100000000\n"
        )
    running = start_server(root, tmp_path / "server.log", "--memory-budget", "cpu=150MB",
                           real_models=("bright", "digits"))  # fmt: skip
    box = (30, 20, 70, 50)
    png = encoded(upright(80, 100, box))
    digit, label = digit_png(0)
    for _ in range(2):  # detector, classifier, detector, classifier: each load evicts the other
        found = httpx.post(f"{running.url}/v1/models/bright/detect", content=png,
                           headers={"content-type": "image/png"}, timeout=60)  # fmt: skip
        assert found.status_code == 200, found.text
        assert np.abs(np.array(found.json()["results"][0]["detections"][0]["box"]) - box).max() <= tolerance(80, 100)
        classified = httpx.post(f"{running.url}/v1/models/digits/classify", content=digit,
                                headers={"content-type": "image/png"}, timeout=60)  # fmt: skip
        assert classified.status_code == 200, classified.text
        assert classified.json()["results"][0]["predictions"][0]["label"] == str(label)
    resident = httpx.get(f"{running.url}/v1/models").json()
    assert [m["name"] for m in resident if m["resident"]] == ["digits"]  # the detector went to make room
