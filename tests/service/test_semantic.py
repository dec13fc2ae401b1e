"""Semantic segmentation served (issue 54): a graph built here labels each pixel of its input ``background``,
``bright`` (channel mean over 127.5) or ``never``, at a quarter of the input's resolution; the server answers each
class present with its mask in the image's own pixels, the masks a partition of the image, read back with
pycocotools. The rectangle's mask is the instance segmenter's (tests/service/test_segment.py): the class map's
edge is where the two classes' bilinearly sampled logits cross, the instance mask's logit's zero."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from pycocotools import mask as coco_mask

from service.core.boxes import Transform
from service.core.masks import class_masks
from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.service.test_segment import GRID, IN, assert_rounded_corners, picture

LABELS = ("background", "bright", "never")


def build_labeller(path: Path) -> None:
    import torch

    class BrightMap(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            bright = (x.float().mean(1, keepdim=True) > 127.5).float()
            share = torch.nn.functional.avg_pool2d(bright, IN // GRID)  # [N, 1, 16, 16]
            return torch.cat([(0.5 - share) * 20, (share - 0.5) * 20, share * 0 - 100], 1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            BrightMap().eval(), (torch.zeros(1, 3, IN, IN, dtype=torch.uint8),), str(path), input_names=["images"],
            output_names=["out"], opset_version=17, dynamo=False,
            dynamic_axes={"images": {0: "batch"}, "out": {0: "batch"}},
        )  # fmt: skip


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    root = tmp_path_factory.mktemp("semantic")
    version = root / "labeller" / "1"
    version.mkdir(parents=True)
    build_labeller(version / "model.onnx")
    spec = {
        "name": "labeller", "architecture": "bright-map", "task": "semantic", "resize": "letterbox",
        "input": {"height": IN, "width": IN}, "resize_size": IN, "mean": [0, 0, 0], "std": [1, 1, 1],
        "labels": list(LABELS),
    }  # fmt: skip
    (version / "spec.json").write_text(json.dumps(spec))
    (root / "labeller" / "config.toml").write_text("max_batch_size = 4\nmax_queue_delay_ms = 1.0\n")
    with InProcessServer(ServerSettings(repository=str(root), port=0, grpc_port=0)) as running:
        yield running


def decoded(mask: dict[str, object]) -> np.ndarray:
    return coco_mask.decode({"size": mask["size"], "counts": str(mask["counts"]).encode()})


@pytest.mark.parametrize(("width", "height", "box"), [(64, 64, (8, 12, 40, 36)), (128, 64, (16, 8, 80, 40))])
def test_each_class_present_has_its_mask_and_the_masks_partition_the_image(
    served: InProcessServer, width: int, height: int, box: tuple[int, int, int, int]
) -> None:
    with served.client() as client:
        r = client.post("/v1/models/labeller/semantic", content=picture(width, height, box),
                        headers={"content-type": "image/png"})  # fmt: skip
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (width, height)
    assert [(c["label"], c["index"]) for c in result["classes"]] == [("background", 0), ("bright", 1)]
    background, bright = (decoded(c["mask"]) for c in result["classes"])
    assert_rounded_corners(bright, width, height, box)
    assert ((background + bright) == 1).all()  # every pixel one class, none two
    assert [c["area"] for c in result["classes"]] == [int(background.sum()), int(bright.sum())]


def test_classes_and_mask_format_are_options_and_a_bad_one_is_a_400(served: InProcessServer) -> None:
    image = picture(64, 64, (8, 12, 40, 36))
    with served.client() as client:
        one = client.post("/v1/models/labeller/semantic", params={"classes": "bright", "mask_format": "polygon"},
                          content=image, headers={"content-type": "image/png"})  # fmt: skip
        bad = client.post("/v1/models/labeller/semantic", params={"classes": "cat"}, content=image,
                          headers={"content-type": "image/png"})  # fmt: skip
    assert one.status_code == 200, one.text
    [bright] = one.json()["results"][0]["classes"]
    assert bright["label"] == "bright" and len(bright["mask"]["polygons"]) == 1
    assert bad.status_code == 400 and "classes" in bad.json()["error"]


def test_v2_answers_each_class_s_rle_in_its_column(served: InProcessServer) -> None:
    client = httpclient.InferenceServerClient(served.url.removeprefix("http://"))
    image = httpclient.InferInput("IMAGE", [1], "BYTES")
    image.set_data_from_numpy(np.array([picture(64, 64, (8, 12, 40, 36))], dtype=object))
    masks = client.infer("labeller.image", [image]).as_numpy("MASKS")
    assert masks.shape == (1, 3) and masks[0, 2] == b""
    assert_rounded_corners(decoded(json.loads(masks[0, 1])), 64, 64, (8, 12, 40, 36))
    assert [o["name"] for o in client.get_model_metadata("labeller")["outputs"]] == ["MASKS"]


def test_a_large_image_is_mapped_in_strips_alike() -> None:
    logits = np.stack([np.zeros((GRID, GRID)), np.eye(GRID) * 10 - 5]).astype(np.float32)
    where = Transform(3000, 2000, IN / 3000, IN / 3000, 0.0, (IN - 2000 * IN / 3000) / 2)
    pairs = class_masks(logits, where, (IN, IN))
    assert [c for c, _ in pairs] == [0, 1]
    assert sum(m.area for _, m in pairs) == 3000 * 2000
    assert class_masks(logits, where, (IN, IN), (1,))[0][1].area == pairs[1][1].area


def test_nan_logits_fail_their_image_alone() -> None:
    import msgspec

    from service.core.spec import ModelSpec
    from service.core.status import InferResult
    from service.core.tasks import Semantic, Want

    spec = msgspec.convert({"name": "l", "architecture": "a", "task": "semantic", "input": {"height": IN, "width": IN},
                            "resize_size": IN, "labels": list(LABELS), "mean": [0, 0, 0], "std": [1, 1, 1]},
                           ModelSpec)  # fmt: skip
    logits = np.zeros((2, 3, GRID, GRID), dtype=np.float32)
    logits[1, 1, 3, 3] = np.nan
    post = Semantic(spec).postprocess(InferResult({"out": logits}, [None, None]), Want())
    assert list(post.failed) == [1] and "NaN" in post.failed[1]
    assert post.predictions[1] == [] and post.predictions[0][0]["label"] == "background"
