"""torchvision's detectors in the zoo: ssdlite320 exported (TorchScript, its ONNX refused with the reason) behind
the uint8 front, proved by the detection parity gate on rows that random weights make meaningful, and served; the
heavy ones' export path checked without a full export."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from export.detect_parity import DetectParityResult, drop_refused
from export.exporter import ExportReport, ExportRequest, export_source
from export.sources import from_architecture
from models.registry import get_architecture
from models.tv_detectors import ONNX_REFUSED, TV_DETECTORS, TorchvisionDetector, coco_categories
from service.core.errors import ConfigError
from service.core.settings import ServerSettings
from service.core.spec import load_spec
from service.inprocess import InProcessServer

SSD = "ssdlite320_mobilenet_v3_large"


def test_the_registry_holds_each_with_cocos_91_categories() -> None:
    labels = coco_categories()
    assert len(labels) == 91 and labels[:2] == ("__background__", "person") and labels[90] == "toothbrush"
    for name, (_, k, *_rest) in TV_DETECTORS.items():
        spec = get_architecture(name).spec
        assert (spec.task, spec.output_layout, spec.resize) == ("detect", "end2end", "stretch")
        assert spec.labels == labels and spec.max_detections == k
        assert (spec.mean, spec.std) == ((0.0,) * 3, (1.0,) * 3)  # x / 255: the detector normalises itself
    assert get_architecture(SSD).spec.input.height == 320


def test_onnx_is_refused_with_the_reason_and_torchscript_kept() -> None:
    front = from_architecture(SSD).eager
    kept, notes = drop_refused(front, ("onnx", "torchscript"))
    assert kept == ("torchscript",) and notes == [f"onnx refused: {ONNX_REFUSED}"]
    with pytest.raises(ConfigError, match="batched_nms"):
        drop_refused(front, ("onnx",))


@pytest.fixture(scope="module")
def ssdlite(tmp_path_factory: pytest.TempPathFactory) -> tuple[ExportReport, Path]:
    repo = tmp_path_factory.mktemp("tvdet")
    request = ExportRequest(name="ssdlite", repository=str(repo), max_batch_size=2, latency=False)
    return export_source(from_architecture(SSD), request), repo


def test_ssdlite_exports_as_torchscript_and_passes_a_meaningful_gate(ssdlite: tuple[ExportReport, Path]) -> None:
    report, _ = ssdlite
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    assert [(a.format, a.written) for a in report.artifacts] == [("torchscript", True)]
    assert any("onnx refused" in n for n in report.notes)
    parity = report.artifacts[0].parity
    assert isinstance(parity, DetectParityResult)
    # Random weights still answer rows above the gate's 0.05 (recalibrated statistics), so boxes are compared.
    assert parity.boxes > 100 * parity.images and parity.unmatched == 0
    spec = load_spec(report.path / "spec.json")
    assert spec.output_layout == "end2end" and spec.exports[0].detection_parity is not None


@pytest.fixture(scope="module")
def served(ssdlite: tuple[ExportReport, Path]) -> Iterator[InProcessServer]:
    _, repo = ssdlite
    settings = ServerSettings(repository=str(repo), port=0, grpc_port=0, max_images_per_request=8)
    with InProcessServer(settings) as running:
        yield running


def test_ssdlite_is_served_with_boxes_in_the_images_pixels(served: InProcessServer) -> None:
    rng = np.random.default_rng(0)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (240, 400, 3), dtype=np.uint8)).save(out, "PNG")
    with served.client() as client:
        r = client.post("/v1/models/ssdlite/detect?score_threshold=0.05", content=out.getvalue(),
                        headers={"content-type": "image/png"})  # fmt: skip
    assert r.status_code == 200, r.text
    found = r.json()["results"][0]["detections"]
    assert found, r.json()
    labels = set(coco_categories())
    for d in found:
        x1, y1, x2, y2 = d["box"]
        assert 0 <= x1 <= x2 <= 400 + 1e-3 and 0 <= y1 <= y2 <= 240 + 1e-3  # stretched back to 400x240
        assert d["label"] in labels and d["score"] >= 0.05


def test_weights_are_torchvisions_own_state_dict(tmp_path: Path) -> None:
    source = from_architecture(SSD)
    network = source.eager.network
    assert isinstance(network, TorchvisionDetector)
    state = {k: v * 1.01 if v.is_floating_point() else v for k, v in network.detector.state_dict().items()}
    torch.save(state, tmp_path / "w.pt")
    loaded = from_architecture(SSD, weights=str(tmp_path / "w.pt"))
    assert loaded.sha256 is not None
    weight = next(iter(state))
    assert torch.equal(loaded.eager.network.detector.state_dict()[weight], state[weight])


@pytest.mark.parametrize("name", ["fasterrcnn_mobilenet_v3_large_320_fpn", "retinanet_resnet50_fpn_v2",
                                  "fcos_resnet50_fpn"])  # fmt: skip
def test_the_heavy_ones_script_to_the_same_rows(name: str) -> None:
    """Their export path (the scripted rows the TorchScript trace calls) at a small input, not a full export."""
    source = from_architecture(name, input_size=128)
    network = source.eager.network
    assert isinstance(network, TorchvisionDetector) and network.scripted is not None
    x = torch.rand(2, 3, 128, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        eager, scripted = network(x), network.scripted(x)
    k = TV_DETECTORS[name][1]
    assert eager.shape == (2, k, 6)
    assert torch.allclose(eager, scripted, atol=1e-4)
    scores = eager[..., 4]
    # Scores a gate can check: above its 0.05, and spread (saturated ones tie, and ties leave it nothing to compare).
    assert (scores > 0.05).any() and ((scores.amax(1) - scores.amin(1)) > 1e-2).all() and (scores < 0.999).all()
    assert drop_refused(source.eager, ("onnx", "torchscript"))[0] == ("torchscript",)


def test_a_detector_of_fewer_rows_than_the_gates_300_exports(tmp_path: Path) -> None:
    """Faster R-CNN answers 100 rows an image: eager's are read as the artifact's (each image's best rows) first."""
    request = ExportRequest(name="frcnn", repository=str(tmp_path), max_batch_size=2, latency=False)
    report = export_source(from_architecture("fasterrcnn_mobilenet_v3_large_320_fpn", input_size=128), request)
    assert report.ok, [a.parity.describe() for a in report.artifacts]
    parity = report.artifacts[0].parity
    assert isinstance(parity, DetectParityResult) and parity.boxes > 0
