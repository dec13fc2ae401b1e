"""torchvision's COCO detectors behind the uint8 front: ``[N, K, 6]`` rows, already suppressed ("end2end").

:class:`TorchvisionDetector` takes the float batch the uint8 front makes (x / 255: the detector applies its own mean
and std) and answers each image's K best rows ``x1, y1, x2, y2, score, class`` in input pixels, padded with zero
rows. Why the weightless detectors are built as they are (score threshold 0, batch-norm statistics from noise,
classification layers drawn again), and why ONNX is refused, with the measurements: docs/detection.md,
"torchvision's detectors from the zoo".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torchvision.models.detection as tvd
from torch import nn

from models.normalize import Uint8Classifier
from models.registry import register
from service.core.spec import InputSpec, ModelSpec

ONNX_REFUSED = (
    "torch.export (the ONNX exporter's first step) cannot trace torchvision's detection postprocessing: "
    "batched_nms branches on the number of boxes left after the score filter, a data-dependent size "
    "(GuardOnDataDependentSymNode, torchvision/ops/boxes.py), with a dynamic or a fixed batch alike; "
    "export torchscript"
)
# A redrawn classification layer's logit std: over a softmax of 91 classes (Faster R-CNN) 2 makes the best about
# 0.2, not 1/91; a sigmoid per anchor and class (RetinaNet, FCOS: 10^7 logits at 800x800) takes 0.5, since at 2 its
# best 300 all saturate within 0.001 of 1, which leaves the gate nothing beyond its margin (measured: 0 of 10,200).
SOFTMAX_LOGIT_STD = 2.0
SIGMOID_LOGIT_STD = 0.5
# FCOS's box distances pass a ReLU from a layer of std 0.01 and bias 0: many random boxes have no width or height,
# and an empty box matches only to 1e-3 pixel, closer than the runtime's channels-last float error moves it at
# 800x800 (measured: 240 of 3,400 rows unmatched). A bias of 1 makes them about a stride on each side.
BOX_BIAS = {"fcos_resnet50_fpn": ("head.regression_head.bbox_reg", 1.0)}
RECALIBRATION_SIZE = 160  # noise images for the batch-norm statistics: small, the statistics are per channel


class DetectionRows(nn.Module):
    """The scriptable core: float images ``[N, 3, H, W]`` in 0..1 -> ``[N, K, 6]`` rows in input pixels."""

    def __init__(self, detector: Any, k: int) -> None:  # Any: its parts are read by name
        super().__init__()
        self.detector = detector
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images = list(x.unbind(0))
        # An if statement, not an expression: TorchScript compiles only the branch is_scripting() picks.
        if torch.jit.is_scripting():  # noqa: SIM108
            detections = self.detector(images)[1]  # scripted, torchvision answers (losses, detections)
        else:
            detections = self.detector(images)
        rows = []
        for d in detections:
            found = torch.cat([d["boxes"], d["scores"][:, None], d["labels"][:, None].to(d["boxes"].dtype)], dim=1)
            found = found[: self.k]
            rows.append(nn.functional.pad(found, [0, 0, 0, self.k - found.shape[0]]))
        return torch.stack(rows)


class TorchvisionDetector(nn.Module):
    """A torchvision detector answering ``[N, K, 6]`` rows; traced (TorchScript export), it calls a scripted copy
    of its rows, so the trace keeps the per-image loops and the dynamic batch."""

    refused_formats: ClassVar[dict[str, str]] = {
        "onnx": ONNX_REFUSED,
        "aoti": ONNX_REFUSED.replace("; export torchscript", ""),
    }

    def __init__(self, detector: nn.Module, k: int, rows: type[DetectionRows] = DetectionRows) -> None:
        super().__init__()
        self.rows = rows(detector, k)
        self.scripted: nn.Module | None = None

    def script(self) -> None:
        """Script the rows for a TorchScript export (its trace calls them); after any weights are loaded. The
        scripted copy shares the parameters, and a trace only sees a module registered before it starts."""
        self.scripted = torch.jit.script(self.rows)

    @property
    def detector(self) -> Any:
        return self.rows.detector

    def fit_input(self, height: int, width: int) -> None:
        """Resize inside the model to the spec's input (``stretch`` brought the image there): no second resize."""
        transform = self.detector.transform
        if getattr(transform, "fixed_size", None) is not None:
            transform.fixed_size = (height, width)
        transform.min_size = (min(height, width),)
        transform.max_size = max(height, width)

    def forward(self, x: torch.Tensor) -> Any:  # rows, or a segmenter's (head, prototypes)
        if torch.jit.is_tracing():
            if self.scripted is None:
                raise RuntimeError("call script() before tracing a TorchvisionDetector")
            return self.scripted(x)
        return self.rows(x)


class Uint8Detector(Uint8Classifier):
    """The uint8 front over a :class:`TorchvisionDetector`; names the export formats it refuses and why."""

    @property
    def refused_formats(self) -> dict[str, str]:
        return dict(getattr(self.network, "refused_formats", {}))


def _feed(model: nn.Module, seed: int, front: bool) -> None:
    """Two seeded noise images through ``model``: a list of 0..1 (a detector's), or a batch of 0..255 (``front``)."""
    noise = torch.rand(2, 3, RECALIBRATION_SIZE, RECALIBRATION_SIZE, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(noise * 255 if front else list(noise.unbind(0)))


def recalibrate(model: nn.Module, *, front: bool = False) -> None:
    """Batch-norm statistics from seeded noise (cumulative over two passes), the model in eval mode around."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
    for seed in (0, 1):
        _feed(model, seed, front)
    for norm in norms:
        norm.eval()


def spread(model: nn.Module, name: str, logit_std: float) -> None:
    """Draw layer ``name`` again for logits of std ``logit_std`` on noise: weights of std
    ``logit_std / (sqrt(fan in) * rms of its input)``, no bias."""
    layer = model.get_submodule(name)
    seen: list[float] = []

    def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        seen.append(float(args[0].detach().pow(2).mean().sqrt()))

    handle = layer.register_forward_pre_hook(hook)
    try:
        _feed(model, 2, front=False)
    finally:
        handle.remove()
    rms = max(sum(seen) / max(len(seen), 1), 1e-12)
    weight, bias = layer.weight, layer.bias
    assert isinstance(weight, torch.Tensor)
    with torch.no_grad():
        weight.normal_(0.0, logit_std / (weight[0].numel() ** 0.5 * rms), generator=torch.Generator().manual_seed(3))
        if isinstance(bias, torch.Tensor):
            bias.zero_()


def build(
    factory: Callable[..., nn.Module],
    *,
    k: int,
    size: int,
    score_layer: tuple[str, float] | None,
    box_bias: tuple[str, float] | None = None,
    rows: type[DetectionRows] = DetectionRows,
    **kwargs: Any,
) -> TorchvisionDetector:
    """A torchvision detector from ``factory`` with no weights, answering its ``k`` best rows of a ``size`` square
    input (see the module), or what ``rows`` makes of them."""
    # The R-CNNs read box_detections_per_img, the others detections_per_img (and their transforms ignore the other).
    detector = factory(weights=None, weights_backbone=None, detections_per_img=k, box_detections_per_img=k, **kwargs)
    detector.eval()
    wrapper = TorchvisionDetector(detector, k, rows)
    if next(detector.parameters()).is_meta:  # built only to be counted (``visionserve models``): nothing to run
        return wrapper
    wrapper.fit_input(RECALIBRATION_SIZE, RECALIBRATION_SIZE)
    recalibrate(detector)
    if box_bias is not None:
        bias = detector.get_submodule(box_bias[0]).bias
        assert isinstance(bias, torch.Tensor)
        with torch.no_grad():
            bias.fill_(box_bias[1])
    if score_layer is not None:
        spread(detector, *score_layer)
    wrapper.fit_input(size, size)
    return wrapper.eval()


# name -> (factory, K, the classification layer drawn again and its logit std, the score threshold's keyword, input
# size, what it is)
TV_DETECTORS: dict[str, tuple[Callable[..., nn.Module], int, tuple[str, float] | None, str, int, str]] = {
    "ssdlite320_mobilenet_v3_large": (
        tvd.ssdlite320_mobilenet_v3_large, 300, None, "score_thresh", 320,
        "torchvision SSDlite320 MobileNetV3-Large (COCO, 91 categories): [N, 300, 6] rows, suppressed in the graph",
    ),
    "fasterrcnn_mobilenet_v3_large_320_fpn": (
        tvd.fasterrcnn_mobilenet_v3_large_320_fpn, 100, ("roi_heads.box_predictor.cls_score", SOFTMAX_LOGIT_STD),
        "box_score_thresh",
        320, "torchvision Faster R-CNN MobileNetV3-Large 320 FPN (COCO): [N, 100, 6] rows, suppressed in the graph",
    ),
    "retinanet_resnet50_fpn_v2": (
        tvd.retinanet_resnet50_fpn_v2, 300, ("head.classification_head.cls_logits", SIGMOID_LOGIT_STD),
        "score_thresh", 800,
        "torchvision RetinaNet ResNet-50 FPN v2 (COCO): [N, 300, 6] rows, suppressed in the graph",
    ),
    "fcos_resnet50_fpn": (
        tvd.fcos_resnet50_fpn, 100, ("head.classification_head.cls_logits", SIGMOID_LOGIT_STD), "score_thresh",
        800,
        "torchvision FCOS ResNet-50 FPN (COCO): [N, 100, 6] rows, suppressed in the graph",
    ),
}  # fmt: skip


def coco_categories() -> tuple[str, ...]:
    """COCO's categories as torchvision numbers them (91, ``__background__`` at 0 and ``N/A`` gaps), from its
    weights' metadata (no download)."""
    return tuple(tvd.SSDLite320_MobileNet_V3_Large_Weights.DEFAULT.meta["categories"])


def _register(name: str) -> None:
    factory, k, score_layer, threshold, size, description = TV_DETECTORS[name]

    def builder(*, num_classes: int = 91) -> nn.Module:
        unthresholded: dict[str, Any] = {threshold: 0.0}
        return build(factory, k=k, size=size, score_layer=score_layer, box_bias=BOX_BIAS.get(name),
                     num_classes=num_classes, **unthresholded)  # fmt: skip

    builder.__name__ = name
    register(name, spec=detector_spec(name, size, k), description=description, task="detect")(builder)


def detector_spec(name: str, size: int, k: int) -> ModelSpec:
    """The spec of torchvision's COCO detector ``name`` at a ``size`` square input, answering ``k`` rows."""
    return ModelSpec(
        name=name,
        architecture=name,
        input=InputSpec(channels=3, height=size, width=size),
        resize_size=size,
        mean=(0.0, 0.0, 0.0),  # x / 255 only: the detector normalises with its own mean and std
        std=(1.0, 1.0, 1.0),
        labels=coco_categories(),
        task="detect",
        resize="stretch",  # ssdlite stretches to 320x320 itself; the others keep the aspect of a square input
        output_layout="end2end",
        max_detections=k,
    )


for _name in TV_DETECTORS:
    _register(_name)
