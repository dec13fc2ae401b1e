"""torchvision's segmenters in the zoo: LR-ASPP and DeepLabV3 exported to ONNX behind the pixel gate, Mask R-CNN to
TorchScript behind the mask gate (its ONNX refused with the reason), each on outputs random weights make meaningful;
the semantic logits answer torchvision's own classes, Mask R-CNN's ``yolo-seg`` answer torchvision's own detections,
and the served instances have masks of the image's size inside their boxes.

Kept short: the semantic models at a 64x64 input, Mask R-CNN at 64x64 with 8 detections and 32 proposals an image
(its registered 32 and torchvision's 1000 cost its box and mask heads a second an image on one core)."""

from __future__ import annotations

import copy
import io
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import torchvision.models.segmentation as tvs
from PIL import Image

from export.detect_parity import DetectParityResult, drop_refused
from export.exporter import ExportReport, ExportRequest, export_source, make_runtime
from export.parity import ParityResult
from export.sources import Source, from_architecture
from models.registry import get_architecture, with_input_size
from models.tv_detectors import ONNX_REFUSED, TorchvisionDetector, Uint8Detector, coco_categories
from models.tv_segmenters import MASK_RCNN, maskrcnn_resnet50_fpn_v2
from service.core.errors import ConfigError
from service.core.masks import decoded
from service.core.preprocess import decode_transformed, open_image
from service.core.settings import ServerSettings
from service.core.spec import load_spec
from service.core.status import InferResult
from service.core.tasks import Segment, Semantic
from service.core.tasks.base import Want
from service.inprocess import InProcessServer

SEMANTIC = {"lraspp_mobilenet_v3_large": tvs.lraspp_mobilenet_v3_large,
            "deeplabv3_mobilenet_v3_large": tvs.deeplabv3_mobilenet_v3_large}  # fmt: skip
SIZE, K = 64, 8


def test_the_registry_holds_them_with_their_labels() -> None:
    voc = tuple(tvs.LRASPP_MobileNet_V3_Large_Weights.DEFAULT.meta["categories"])
    assert len(voc) == 21 and voc[:2] == ("__background__", "aeroplane")
    for name in SEMANTIC:
        spec = get_architecture(name).spec
        assert (spec.task, spec.output_layout, spec.resize, spec.input.height) == ("semantic", None, "letterbox", 520)
        assert spec.labels == voc and spec.std == pytest.approx((0.229, 0.224, 0.225))  # the front normalises
    spec = get_architecture(MASK_RCNN).spec
    assert (spec.task, spec.output_layout, spec.resize, spec.input.height) == ("segment", "yolo-seg", "letterbox", 800)
    assert spec.labels == coco_categories() and spec.max_detections == 32 and spec.std == (1.0,) * 3
    for name in (*SEMANTIC, MASK_RCNN):  # counted as `visionserve models` counts them: built on no memory
        with torch.device("meta"):
            assert sum(p.numel() for p in get_architecture(name).build().parameters()) > 1e6


def random_logits(name: str) -> torch.Tensor:
    source = from_architecture(name, input_size=SIZE)
    with torch.inference_mode():
        return source.eager(torch.randint(0, 256, (4, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(1),
                                          dtype=torch.uint8))  # fmt: skip


@pytest.mark.parametrize("name", list(SEMANTIC))
def test_random_weights_label_pixels_with_many_classes(name: str) -> None:
    """What makes the pixel gate meaningful on random weights: batch-norm statistics from noise, without which every
    pixel of every image is one class (the features fade: a logit's spread over the image 5e-12 for DeepLabV3)."""
    logits = random_logits(name)
    stride = 8 if name.startswith("lraspp") else 16
    assert logits.shape == (4, 21, SIZE // stride, SIZE // stride)
    assert len(logits.argmax(1).unique()) >= 4 and (logits.std((2, 3)) > 0.1).all()
    top = logits.topk(2, dim=1).values
    assert ((top[:, 0] - top[:, 1]) / logits.abs().amax(1)).min() > 1e-5  # no pixel a tie float error decides


@pytest.fixture(scope="module", params=list(SEMANTIC))
def semantic_export(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[ExportReport, Path]:
    repo = tmp_path_factory.mktemp("voc")
    ask = ExportRequest(name="voc", repository=str(repo), formats=("onnx",), max_batch_size=2, latency=False)
    return export_source(from_architecture(request.param, input_size=SIZE), ask), repo


@pytest.mark.slow
def test_a_semantic_model_exports_to_onnx_behind_the_pixel_gate(semantic_export: tuple[ExportReport, Path]) -> None:
    report, _ = semantic_export
    assert report.ok and [(a.format, a.written) for a in report.artifacts] == [("onnx", True)], report.notes
    parity = report.artifacts[0].parity
    assert isinstance(parity, ParityResult) and parity.images == 17
    assert parity.max_rel_error <= 1e-4 and parity.top1_agreement == 1.0  # a share of pixels, at most 1
    spec = load_spec(report.path / "spec.json")
    assert spec.task == "semantic" and spec.exports[0].parity_top1_agreement == 1.0


@pytest.mark.slow
def test_a_semantic_model_is_served_a_class_a_pixel(semantic_export: tuple[ExportReport, Path]) -> None:
    _, repo = semantic_export
    with (
        InProcessServer(ServerSettings(repository=str(repo), port=0, grpc_port=0)) as served,
        served.client() as client,
    ):
        r = client.post("/v1/models/voc/semantic", content=picture(), headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    result = r.json()["results"][0]
    assert (result["width"], result["height"]) == (100, 60) and len(result["classes"]) >= 2
    seen = np.zeros((60, 100), dtype=int)
    for c in result["classes"]:
        seen += decoded(c["mask"])
    assert (seen == 1).all()  # a partition of the image: every pixel one class


@pytest.mark.parametrize("name", list(SEMANTIC))
def test_the_logits_answer_torchvisions_own_classes(name: str, tmp_path: Path) -> None:
    """The zoo's weights saved are torchvision's own state dict (its keys; ``--weights`` loads them back), and
    torchvision's model holding them answers ``out`` (upsampled to the input) giving each pixel the class the server
    gives it from the wrapper's logits (sampled at each pixel's centre, once)."""
    torch.save(from_architecture(name, input_size=SIZE).eager.network.state_dict(), tmp_path / "w.pt")
    original = SEMANTIC[name](weights=None, weights_backbone=None, num_classes=21,
                              **({"aux_loss": True} if name.startswith("deeplab") else {})).eval()  # fmt: skip
    original.load_state_dict(torch.load(tmp_path / "w.pt"))
    source = from_architecture(name, weights=str(tmp_path / "w.pt"), input_size=SIZE)
    assert source.sha256 is not None
    image = torch.randint(0, 256, (1, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    with torch.inference_mode():
        expected = original(source.eager.normalize(image))["out"].argmax(1)[0].numpy()
        logits = source.eager(image).numpy()
    task = Semantic(source.spec)
    got = np.full((SIZE, SIZE), -1)
    for c, mask in task.masks(InferResult({"masks": logits}, [None]), task.default, None)[0]:
        got[mask.y1 : mask.y1 + mask.region.shape[0], mask.x1 : mask.x1 + mask.region.shape[1]][mask.region] = c
    # Not every pixel: the server weighs only the classes that win a cell of the logits' grid, and between cells
    # another class can win the bilinear mix (1.1% of LR-ASPP's pixels here: 20 classes on 8 x 8 cells).
    assert len(np.unique(expected)) >= 4 and (got == expected).mean() >= 0.98


@pytest.fixture(scope="module")
def mask_rcnn() -> Source:
    """The zoo's Mask R-CNN (its builder, its wrapper and front) with fewer detections and proposals."""
    spec = msgspec.structs.replace(with_input_size(get_architecture(MASK_RCNN).spec, SIZE), max_detections=K)
    torch.manual_seed(0)
    network = maskrcnn_resnet50_fpn_v2(k=K, rpn_post_nms_top_n_test=32)
    assert isinstance(network, TorchvisionDetector)
    network.fit_input(SIZE, SIZE)
    network.script()
    return Source(Uint8Detector(network, spec.mean, spec.std).eval(), spec, None, None, "random uint8 batches only")


def noise(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (1, 3, SIZE, SIZE), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def instances(source: Source, head: torch.Tensor, protos: torch.Tensor) -> tuple[np.ndarray, list[Any]]:
    """One image's instances as the server reads them, every row (no threshold, IoU 1), best first, in input
    pixels."""
    task = Segment(source.spec)
    options = msgspec.structs.replace(task.default, score_threshold=1e-6, iou_threshold=1.0)
    [rows], [masks], _ = task.instances(InferResult({"output0": head.numpy(), "output1": protos.numpy()}, [None]),
                                        options)  # fmt: skip
    order = np.argsort(-rows[:, 4], kind="stable")
    return rows[order], [masks[i] for i in order]


def test_mask_rcnn_answers_torchvisions_detections_as_yolo_seg(mask_rcnn: Source) -> None:
    """The head read as the server reads it (nothing left out, nothing suppressed: IoU 1) gives torchvision's own
    K detections: boxes, scores and classes. The random masks are neither empty nor their boxes, what makes the mask
    gate's IoU meaningful (they are not compared with torchvision's pasted ones here: near 0.5 everywhere and
    patterned 2 x 2 by the head's transposed convolution, they change with any resampling)."""
    network = mask_rcnn.eager.network
    assert isinstance(network, TorchvisionDetector)
    image = mask_rcnn.eager.normalize(noise(3))
    with torch.inference_mode():
        head, protos = network.rows(image)
        own = network.detector(list(image.unbind(0)))[0]
    assert head.shape == (1, 4 + 91 + K, K) and protos.shape == (1, K, SIZE // 4, SIZE // 4)
    rows, masks = instances(mask_rcnn, head, protos)
    assert np.allclose(rows[:, :4], own["boxes"].numpy(), atol=1e-3)
    assert np.allclose(rows[:, 4], own["scores"].numpy(), atol=1e-6) and (rows[:, 5] == own["labels"].numpy()).all()
    filled = [m.area / max(m.region.size, 1) for m in masks]
    assert min(filled) < 0.1 and max(filled) > 0.5 and 0.05 < np.median(filled) < 0.9, filled


def test_mask_rcnn_masks_are_torchvisions_own(mask_rcnn: Source) -> None:
    """A mask head answering a disk in each box: the server's masks (prototypes at a quarter of the input, sampled
    at each pixel) are the disks torchvision pastes into the input itself: IoU 0.85 where the box is 20 pixels or
    more on each side (measured 0.87 to 0.96; 0.91 to 0.97 with prototypes at the input's resolution, torchvision's
    paste rounding each box to whole pixels), 0.7 on a thinner one (0.73 on a box 12 pixels wide: 3 cells)."""

    class Disk(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            t = (torch.arange(28, dtype=x.dtype) + 0.5) / 14 - 1
            return (10 * (0.5 - t[None, :] ** 2 - t[:, None] ** 2)).expand(x.shape[0], 91, 28, 28)

    network = mask_rcnn.eager.network
    assert isinstance(network, TorchvisionDetector)
    rows = copy.deepcopy(network.rows)
    rows.detector.roi_heads.mask_predictor = Disk()
    image = mask_rcnn.eager.normalize(noise(4))
    with torch.inference_mode():
        head, protos = rows(image)
        own = rows.detector(list(image.unbind(0)))[0]["masks"][:, 0].numpy() >= 0.5
    _, masks = instances(mask_rcnn, head, protos)
    for mask, theirs in zip(masks, own, strict=True):
        mine = np.zeros_like(theirs)
        mine[mask.y1 : mask.y1 + mask.region.shape[0], mask.x1 : mask.x1 + mask.region.shape[1]] = mask.region
        overlap = (mine & theirs).sum() / (mine | theirs).sum()
        assert overlap >= (0.85 if min(mask.region.shape) >= 20 else 0.7), (mask.region.shape, overlap)


@pytest.fixture(scope="module")
def exported(mask_rcnn: Source, tmp_path_factory: pytest.TempPathFactory) -> tuple[ExportReport, Path]:
    repo = tmp_path_factory.mktemp("tvseg")
    request = ExportRequest(name="mrcnn", repository=str(repo), max_batch_size=2, latency=False)
    return export_source(mask_rcnn, request), repo


@pytest.mark.slow
def test_mask_rcnn_exports_as_torchscript_behind_the_mask_gate(exported: tuple[ExportReport, Path]) -> None:
    report, _ = exported
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    assert [(a.format, a.written) for a in report.artifacts] == [("torchscript", True)]
    assert report.notes == [f"onnx refused: {ONNX_REFUSED}"]
    parity = report.artifacts[0].parity
    assert isinstance(parity, DetectParityResult) and parity.masks is not None
    # Every image's K detections score above the gate's 0.05 (the classifier drawn again), so all are compared.
    assert parity.boxes >= K * parity.images and parity.masks >= K * parity.images and parity.masks_unmatched == 0
    spec = load_spec(report.path / "spec.json")
    assert spec.output_layout == "yolo-seg" and spec.exports[0].detection_parity is not None


def test_mask_rcnn_onnx_alone_is_refused_with_the_reason(mask_rcnn: Source) -> None:
    with pytest.raises(ConfigError, match="batched_nms"):
        drop_refused(mask_rcnn.eager, ("onnx",))


def picture() -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 100, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.slow
def test_mask_rcnn_answers_masks_inside_their_boxes(exported: tuple[ExportReport, Path]) -> None:
    """The artifact through the serving runtime and the segment task's answer, for an image of 100 x 60 (letterboxed
    into the input): each instance's mask, COCO's RLE of the whole image, lies inside its box."""
    report, _ = exported
    spec = load_spec(report.path / "spec.json")
    batch, where = decode_transformed(open_image(picture()), spec)
    runtime = make_runtime("torchscript", spec, report.path / "model.pt", "cpu", 2)
    try:
        outputs = runtime.submit_outputs(batch[None]).result()
    finally:
        runtime.close()
    task = Segment(spec)
    options = msgspec.structs.replace(task.default, score_threshold=0.05, iou_threshold=0.5)
    [found] = task.postprocess(InferResult(outputs, [None]), Want(options=options), [where]).predictions
    assert found and any(i["area"] > 0 for i in found)
    for instance in found:
        mask = decoded(instance["mask"])
        assert mask.shape == (60, 100) and mask.sum() == instance["area"]
        x1, y1, x2, y2 = instance["box"]
        ys, xs = np.nonzero(mask)
        assert len(xs) == 0 or (x1 - 1 <= xs.min() and xs.max() <= x2 and y1 - 1 <= ys.min() and ys.max() <= y2)


@pytest.mark.slow
def test_mask_rcnn_is_served_over_http(exported: tuple[ExportReport, Path]) -> None:
    _, repo = exported
    settings = ServerSettings(repository=str(repo), port=0, grpc_port=0)
    with InProcessServer(settings) as served, served.client() as client:
        r = client.post("/v1/models/mrcnn/segment?score_threshold=0.05", content=picture(),
                        headers={"content-type": "image/png"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["instances"]
