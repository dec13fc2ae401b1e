"""Segmentation served (issue 54's first step, and the proof that a task is one module): a ``yolo-seg`` graph built
here, served by the routes, v2 and the WebSocket stream that service/core/tasks/segment.py alone added, its masks
read back with pycocotools (the field's own decoder) in the image's own pixels.

The segmenter finds an image's bright rectangle (the pixels whose channel mean is over 127.5) and answers it as
ultralytics' segmentation export does: ``output0`` ``[N, 4 + 3 classes + 1 coefficient, 2 anchors]`` (the box as
class ``one`` at 0.9, and a decoy under the default threshold) and ``output1``, one prototype of 16 x 16: the bright
share of each 4 x 4 cell, as a logit. A rectangle on the cells' edges comes back exactly, whatever the letterbox,
but for its corners, which bilinear sampling rounds.
"""

from __future__ import annotations

import asyncio
import io
import json
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
import websockets
from PIL import Image
from pycocotools import mask as coco_mask

from service.client import Client
from service.core.boxes import Transform, identity
from service.core.masks import Mask, decoded, instance_masks, polygons, rle, rles
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer

IN = 64
GRID = 16
LABELS = ("zero", "one", "two")


def build_segmenter(path: Path, *, nan_when_dark: bool = False) -> None:
    """BrightSeg, or (``nan_when_dark``) one whose prototypes are NaN for an image with no bright pixel."""
    import torch

    class BrightSeg(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            bright = (x.float().mean(1) > 127.5).float()  # [N, H, W]
            cols, rows = bright.amax(1), bright.amax(2)
            ax = torch.arange(IN, dtype=torch.float32)
            x1 = (cols * ax + (1 - cols) * IN).amin(1)
            x2 = (cols * (ax + 1)).amax(1)
            y1 = (rows * ax + (1 - rows) * IN).amin(1)
            y2 = (rows * (ax + 1)).amax(1)
            one = torch.ones_like(x1)
            box = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], 1)  # [N, 4]
            found = torch.cat([box, (one * 0.0)[:, None], (one * 0.9)[:, None], (one * 0.0)[:, None], one[:, None]], 1)
            decoy = torch.cat([one[:, None] * torch.tensor([8.0, 8.0, 4.0, 4.0, 0.1, 0.0, 0.0, 1.0])], 1)
            head = torch.stack([found, decoy], 2)  # [N, 8, 2]
            share = torch.nn.functional.avg_pool2d(bright[:, None], IN // GRID)  # [N, 1, 16, 16]
            if nan_when_dark:
                share = share / bright.amax((1, 2)).reshape(-1, 1, 1, 1)  # 0 / 0 where nothing is bright
            return head, share * 20 - 10

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            BrightSeg().eval(), (torch.zeros(1, 3, IN, IN, dtype=torch.uint8),), str(path),
            input_names=["images"], output_names=["output0", "output1"], opset_version=17, dynamo=False,
            dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}, "output1": {0: "batch"}},
        )  # fmt: skip


def segmenter_repo(root: Path) -> Path:
    version = root / "seg" / "1"
    version.mkdir(parents=True)
    build_segmenter(version / "model.onnx")
    spec = {
        "name": "seg", "architecture": "bright-segmenter", "task": "segment", "resize": "letterbox",
        "output_layout": "yolo-seg", "input": {"height": IN, "width": IN}, "resize_size": IN,
        "mean": [0, 0, 0], "std": [1, 1, 1], "labels": list(LABELS),
    }  # fmt: skip
    (version / "spec.json").write_text(json.dumps(spec))
    (root / "seg" / "config.toml").write_text("max_batch_size = 4\nmax_queue_delay_ms = 1.0\n")
    return root


def picture(width: int, height: int, box: tuple[int, int, int, int]) -> bytes:
    pixels = np.full((height, width, 3), 20, dtype=np.uint8)
    x1, y1, x2, y2 = box
    pixels[y1:y2, x1:x2] = 255
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def truth(width: int, height: int, box: tuple[int, int, int, int]) -> np.ndarray:
    full = np.zeros((height, width), dtype=np.uint8)
    x1, y1, x2, y2 = box
    full[y1:y2, x1:x2] = 1
    return full


def assert_rounded_corners(mask: np.ndarray, width: int, height: int, box: tuple[int, int, int, int]) -> None:
    """``mask`` is the rectangle but for its corners, which bilinear sampling rounds (as upsampling ultralytics'
    masks does): nothing outside it, and every pixel missed within one prototype cell of a corner."""
    expected = truth(width, height, box)
    assert not (mask & ~expected).any()
    cell = (IN / GRID) / min(IN / width, IN / height)  # a prototype cell, in original pixels
    ys, xs = np.nonzero(expected & ~mask)
    x1, y1, x2, y2 = box
    near_x = np.minimum(np.abs(xs + 0.5 - x1), np.abs(xs + 0.5 - x2)) < cell
    near_y = np.minimum(np.abs(ys + 0.5 - y1), np.abs(ys + 0.5 - y2)) < cell
    assert (near_x & near_y).all(), list(zip(xs[~(near_x & near_y)], ys[~(near_x & near_y)], strict=True))
    assert len(xs) < (expected.sum() // 20)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = segmenter_repo(tmp_path_factory.mktemp("segment"))
    with InProcessServer(ServerSettings(repository=str(root), port=0, grpc_port=0)) as running:
        yield running


# (width, height, rectangle): square, then letterboxed wide (scale 0.5, 16 rows of padding above) and tall.
CASES = [(64, 64, (8, 12, 40, 36)), (128, 64, (16, 8, 80, 40)), (48, 96, (6, 12, 30, 60))]


@pytest.mark.parametrize(("width", "height", "box"), CASES)
def test_each_instance_s_mask_is_coco_rle_of_the_image_in_its_own_pixels(
    served: InProcessServer, width: int, height: int, box: tuple[int, int, int, int]
) -> None:
    with served.client() as client:
        r = client.post("/v1/models/seg/segment", content=picture(width, height, box),
                        headers={"content-type": "image/png"})  # fmt: skip
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (width, height)
    [instance] = result["instances"]  # the decoy scored under the default threshold
    assert (instance["label"], instance["index"]) == ("one", 1) and instance["score"] == pytest.approx(0.9)
    assert instance["box"] == pytest.approx(list(box), abs=1e-3)
    decoded = coco_mask.decode({"size": instance["mask"]["size"], "counts": instance["mask"]["counts"].encode()})
    assert decoded.shape == (height, width)
    assert_rounded_corners(decoded, width, height, box)
    assert instance["area"] == int(decoded.sum())


def test_png_masks_and_options_are_the_detect_routes(served: InProcessServer) -> None:
    image = picture(128, 64, (16, 8, 80, 40))
    with served.client() as client:
        r = client.post("/v1/models/seg/segment", params={"mask_format": "png", "score_threshold": 0.05},
                        content=image, headers={"content-type": "image/png"})  # fmt: skip
        bad = client.post("/v1/models/seg/segment", params={"mask_format": "polygons"}, content=image,
                          headers={"content-type": "image/png"})  # fmt: skip
        wrong_route = client.post("/v1/models/seg/detect", content=image, headers={"content-type": "image/png"})
        schema = client.get("/schema/openapi.json").json()
    instances = r.json()["results"][0]["instances"]
    assert len(instances) == 2  # the decoy too, at 0.05
    import base64

    shown = np.array(Image.open(io.BytesIO(base64.b64decode(instances[0]["mask"])))).astype(np.uint8)
    assert_rounded_corners(shown, 128, 64, (16, 8, 80, 40))
    assert bad.status_code == 400
    assert bad.json()["error"] == "mask_format must be one of rle, polygon, png, got 'polygons' (query parameter)"
    assert wrong_route.status_code == 400 and "POST /v1/models/seg/segment instead" in wrong_route.json()["error"]
    assert "mask_format" in {p["name"] for p in schema["paths"]["/v1/models/{model}/segment"]["post"]["parameters"]}


def drawn(rings: dict[str, list[list[float]]], width: int, height: int) -> np.ndarray:
    """The pixels whose centres lie inside an odd number of the rings (outer and holes alike): the mask they trace."""
    from matplotlib.path import Path as Outline

    ys, xs = np.mgrid[0:height, 0:width]
    centres = np.stack([xs.ravel() + 0.5, ys.ravel() + 0.5], 1)
    inside = np.zeros(width * height, dtype=bool)
    for ring in rings["polygons"] + rings["holes"]:
        inside ^= Outline(np.array(ring).reshape(-1, 2)).contains_points(centres)
    return inside.reshape(height, width)


def test_polygon_masks_are_the_outline_in_the_image_s_pixels(served: InProcessServer) -> None:
    with served.client() as client:
        r = client.post("/v1/models/seg/segment", params={"mask_format": "polygon"},
                        content=picture(128, 64, (16, 8, 80, 40)), headers={"content-type": "image/png"})  # fmt: skip
    assert r.status_code == 200, r.text
    [instance] = r.json()["results"][0]["instances"]
    assert len(instance["mask"]["polygons"]) == 1 and instance["mask"]["holes"] == []
    outline = drawn(instance["mask"], 128, 64)
    assert_rounded_corners(outline.astype(np.uint8), 128, 64, (16, 8, 80, 40))
    assert instance["area"] == int(outline.sum())


def test_polygons_trace_every_part_and_hole_exactly_on_random_masks() -> None:
    from scipy import ndimage

    rng = np.random.default_rng(11)
    for _ in range(200):
        h, w = (int(v) for v in rng.integers(1, 30, 2))
        region = rng.random((h, w)) < rng.uniform(0.2, 0.9)
        x1, y1 = int(rng.integers(0, 6)), int(rng.integers(0, 6))
        rings = polygons(Mask(region, x1, y1, 40, 40))
        full = np.zeros((40, 40), dtype=bool)
        full[y1 : y1 + h, x1 : x1 + w] = region
        assert (drawn(rings, 40, 40) == full).all()
        assert len(rings["polygons"]) == ndimage.label(region)[1]  # one outer ring a 4-connected part
    assert polygons(Mask(np.ones((3, 3), dtype=bool), 2, 1, 10, 10))["polygons"] == [
        [2.0, 1.0, 5.0, 1.0, 5.0, 4.0, 2.0, 4.0]
    ]
    ring = np.ones((5, 5), dtype=bool)
    ring[2, 2] = False
    assert polygons(Mask(ring, 0, 0, 5, 5))["holes"] == [
        [2.0, 3.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0]
    ]  # the other way round


def test_v2_answers_masks_as_rle_strings_beside_the_boxes(served: InProcessServer) -> None:
    client = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
    image = httpclient.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([picture(64, 64, (8, 12, 40, 36))], dtype=object))
    result = client.infer("seg.image", [image])
    assert result.as_numpy("NUM_DETECTIONS").tolist() == [1]
    masks = result.as_numpy("MASKS")
    assert masks.shape == (1, 100) and masks[0, 1] == b""
    first = json.loads(masks[0, 0])
    decoded = coco_mask.decode({"size": first["size"], "counts": first["counts"].encode()})
    assert_rounded_corners(decoded, 64, 64, (8, 12, 40, 36))
    assert {o["name"] for o in client.get_model_metadata("seg")["outputs"]} == {"DETECTIONS", "NUM_DETECTIONS", "MASKS"}


def test_a_websocket_stream_answers_each_frame_s_instances(served: InProcessServer) -> None:
    url = served.url.replace("http://", "ws://") + "/v1/models/seg/stream?max_age_ms=10000"

    async def one() -> dict[str, Any]:
        async with websockets.connect(url) as ws:
            header = json.dumps({"id": 1, "ts": 0}).encode()
            await ws.send(struct.pack(">I", len(header)) + header + picture(64, 64, (8, 12, 40, 36)))
            answer: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), 30))
            return answer

    answer = asyncio.run(one())
    assert answer["status"] == "result" and answer["width"] == 64
    assert answer["instances"][0]["mask"]["size"] == [64, 64]


def test_a_mask_never_leaves_its_box_nor_the_image() -> None:
    logits = np.full((GRID, GRID), 10.0, dtype=np.float32)  # "everywhere"
    where = Transform(100, 50, 0.64, 0.64, 0.0, 16.0)  # 100 x 50 letterboxed into 64
    (mask,) = instance_masks(np.ones((1, 1)), logits[None, None], np.array([[-20.0, 10, 30, 80]]), [where], (IN, IN))
    nan_logits = np.full((1, 1, GRID, GRID), np.nan, np.float32)
    (nan,) = instance_masks(np.ones((1, 1)), nan_logits, np.array([[0.0, 0, 10, 10]]), [where], (IN, IN))
    full = coco_mask.decode({"size": [50, 100], "counts": str(rle(mask)["counts"]).encode()})
    assert full.sum() == 30 * 40 and full[10:50, 0:30].all()  # the box, clipped to the image
    assert nan.area == 0


def test_rle_matches_pycocotools_encoder_on_random_masks() -> None:
    rng = np.random.default_rng(7)
    masks, fulls = [], []
    for _ in range(500):  # images of many sizes, written all at once
        h, w = (int(v) for v in rng.integers(1, 30, 2))
        x1, y1 = int(rng.integers(0, w)), int(rng.integers(0, h))
        x2, y2 = int(rng.integers(x1 + 1, w + 1)), int(rng.integers(y1 + 1, h + 1))
        region = rng.random((y2 - y1, x2 - x1)) < rng.random()
        fulls.append(np.zeros((h, w), dtype=np.uint8))
        fulls[-1][y1:y2, x1:x2] = region
        masks.append(Mask(region, x1, y1, w, h))
    for mask, written, full in zip(masks, rles(masks), fulls, strict=True):
        assert written == rle(mask)
        assert written["counts"] == coco_mask.encode(np.asfortranarray(full))["counts"].decode()
        assert (decoded(written) == full.astype(bool)).all()  # and read back as it was


def test_the_masks_of_many_instances_of_several_images_are_each_sampled_from_its_own_logits() -> None:
    from scipy.ndimage import map_coordinates

    rng = np.random.default_rng(3)
    images = [Transform(100, 50, 0.64, 0.64, 0.0, 16.0), Transform(40, 90, 0.7, 0.7, 18.0, 0.0), identity(IN, IN)]
    image = rng.integers(0, 3, 24)
    where = [images[i] for i in image]
    protos = rng.normal(0.3, 2.0, (3, 8, GRID, GRID)).astype(np.float32)  # each image's prototypes
    coefficients = rng.normal(0, 1, (24, 8)).astype(np.float32)
    logits = np.einsum("mp,mpyx->myx", coefficients, protos[image])
    corners = rng.uniform(-10, 100, (24, 2, 2))
    boxes = np.concatenate([corners.min(axis=1), corners.max(axis=1)], axis=1)
    found = instance_masks(coefficients, protos, boxes, where, (IN, IN), image)
    for m, logit, box, t in zip(found, logits, boxes, where, strict=True):
        x1, y1 = int(np.floor(max(box[0], 0))), int(np.floor(max(box[1], 0)))
        x2, y2 = int(np.ceil(min(box[2], t.width))), int(np.ceil(min(box[3], t.height)))
        assert (m.x1, m.y1, m.width, m.height) == (x1, y1, t.width, t.height)
        if x2 <= x1 or y2 <= y1:
            assert m.area == 0
            continue
        assert m.region.shape == (y2 - y1, x2 - x1) and m.area == m.region.sum()
        # Each pixel's centre in the grid's cells, sampled bilinearly (the edge cell beyond the edges).
        ys, xs = np.meshgrid(np.arange(y1, y2) + 0.5, np.arange(x1, x2) + 0.5, indexing="ij")
        cy, cx = (ys * t.scale_y + t.pad_y) * GRID / IN - 0.5, (xs * t.scale_x + t.pad_x) * GRID / IN - 0.5
        expected = map_coordinates(logit.astype(np.float64), [cy, cx], order=1, mode="nearest") >= 0
        assert (m.region != expected).mean() < 1e-3  # float32 against float64 at the threshold alone


def test_the_python_client_segments(served: InProcessServer) -> None:
    with Client(served.url, model="seg") as client:
        [found] = client.segment([picture(64, 64, (8, 12, 40, 36))], score_threshold=0.05)
    assert found.ok and (found.model, found.width) == ("seg", 64) and len(found.instances or []) == 2
    first = (found.instances or [])[0]
    decoded = coco_mask.decode({"size": first.mask["size"], "counts": first.mask["counts"].encode()})
    assert_rounded_corners(decoded, 64, 64, (8, 12, 40, 36))


def test_a_rollout_judges_a_segmenter_on_its_masks() -> None:
    """Two versions whose boxes agree but whose masks do not: the boxes' comparison would pass the candidate, the
    masks' does not; the same masks agree."""
    import msgspec

    from service.core.config import RolloutConfig
    from service.core.spec import ModelSpec
    from service.core.status import InferResult
    from service.core.tasks import Segment

    spec = msgspec.convert({"name": "seg", "architecture": "a", "task": "segment", "resize": "letterbox",
                            "output_layout": "yolo-seg", "input": {"height": IN, "width": IN}, "resize_size": IN,
                            "labels": list(LABELS), "mean": [0, 0, 0], "std": [1, 1, 1]}, ModelSpec)  # fmt: skip
    comparison = Segment(spec).comparison(RolloutConfig())
    head = np.zeros((1, 8, 1), dtype=np.float32)
    head[0, :, 0] = [32, 32, 32, 32, 0, 0.9, 0, 1]  # one box, the middle half, class one, coefficient 1
    left = np.full((1, 1, GRID, GRID), -10.0, dtype=np.float32)
    left[..., 8 : 24 // 2 + 4, 4:8] = 10.0  # a strip in its left quarter
    right = np.full((1, 1, GRID, GRID), -10.0, dtype=np.float32)
    right[..., 4:12, 8:12] = 10.0  # its right half

    def rows(protos: np.ndarray) -> object:
        return comparison.rows(InferResult({"output0": head, "output1": protos}, [None]), [0])

    comparison.record(rows(left), rows(right), 0.01, 0.01)
    comparison.record(rows(left), rows(left), 0.01, 0.01)
    summary = comparison.summary()
    assert (comparison.samples, comparison.agreed) == (2, 1)
    assert summary["measure"].startswith("images whose masks' F1")


def test_an_image_whose_masks_are_nan_fails_alone(tmp_path: Path) -> None:
    version = segmenter_repo(tmp_path) / "seg" / "1"
    build_segmenter(version / "model.onnx", nan_when_dark=True)
    with InProcessServer(ServerSettings(repository=str(tmp_path), port=0, grpc_port=0)) as server:
        dark = picture(64, 64, (0, 0, 0, 0))
        with Client(server.url, model="seg") as client:
            good, spoilt = client.segment([picture(64, 64, (8, 12, 40, 36)), dark])
        with server.client() as http:
            alone = http.post("/v1/models/seg/segment", content=dark, headers={"content-type": "image/png"})
    assert good.ok and len(good.instances or []) == 1
    assert not spoilt.ok and "NaN" in (spoilt.error or "")
    assert alone.status_code == 500 and "NaN" in alone.json()["error"]  # one image sent: the request is that image


def test_an_outside_yolo_seg_onnx_is_exported_behind_the_mask_gate_and_served(tmp_path: Path) -> None:
    """`export --onnx F --task segment --output-layout yolo-seg`: ultralytics' layout from a file of the user's,
    proved on its boxes and its masks, then served by the segment route."""
    import contextlib

    from service.cli import main

    build_segmenter(tmp_path / "seg.onnx")
    (tmp_path / "labels.txt").write_text("\n".join(LABELS) + "\n")
    with contextlib.redirect_stdout(io.StringIO()) as said:
        code = main(["export", "--onnx", str(tmp_path / "seg.onnx"), "--task", "segment", "--output-layout",
                     "yolo-seg", "--name", "mine", "--repository", str(tmp_path / "repo"), "--labels",
                     str(tmp_path / "labels.txt"), "--input-size", str(IN), "--no-progress"])  # fmt: skip
    assert code == 0, said.getvalue()
    spec = json.loads((tmp_path / "repo" / "mine" / "1" / "spec.json").read_text())
    gate = spec["exports"][0]["detection_parity"]
    assert spec["task"] == "segment" and gate["masks"] > 0 and gate["masks_unmatched"] == 0
    settings = ServerSettings(repository=str(tmp_path / "repo"), port=0, grpc_port=0)
    with InProcessServer(settings) as server, server.client() as client:
        r = client.post("/v1/models/mine/segment", content=picture(64, 64, (8, 12, 40, 36)),
                        headers={"content-type": "image/png"})  # fmt: skip
    [instance] = r.json()["results"][0]["instances"]
    assert_rounded_corners(decoded(instance["mask"]).astype(np.uint8), 64, 64, (8, 12, 40, 36))


def test_the_yolo_seg_benchmark_head_answers_30_ellipses_in_under_20_kb() -> None:
    from service.bench.detect import time_yolo_seg, yolo_seg_head

    figures = time_yolo_seg(0.0, heads=1)
    assert figures["instances_per_image"] == 30 and figures["answer_kb_per_image"] < 20
    outputs = yolo_seg_head(0)
    assert outputs["output0"].shape == (1, 4 + 80 + 32, 8400) and outputs["output1"].shape == (1, 32, 160, 160)
