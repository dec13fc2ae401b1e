"""torchvision's segmenters behind the uint8 front: Mask R-CNN answering ultralytics' segmentation layout
(:class:`MaskRows`), LR-ASPP and DeepLabV3 their classes' logits (:class:`SemanticLogits`). What each answers, and
why: docs/detection.md, "torchvision's segmenters from the zoo"."""

from __future__ import annotations

from typing import Any

import msgspec
import torch
import torchvision.models as tvm
import torchvision.models.detection as tvd
import torchvision.models.segmentation as tvs
from torch import nn

from models.normalize import Uint8Classifier
from models.registry import register
from models.tv_detectors import SOFTMAX_LOGIT_STD, DetectionRows, build, detector_spec, recalibrate
from service.core.spec import InputSpec, ModelSpec

MASK_RCNN = "maskrcnn_resnet50_fpn_v2"
MASK_K = 32  # detections an image: 32 prototypes of 200 x 200 at 800 are 5 MB an image (100: 16 MB)
PROTO_STRIDE = 4  # the prototypes' cell, in input pixels
MASK_SIZE = 800  # torchvision's min_size


def torchvision_spec(name: str, **changes: Any) -> ModelSpec:
    """The spec of torchvision's default weights for ``name``, read from their metadata (no download): its input the
    transform's crop (a classifier's), else its resize."""
    weights = tvm.get_model_weights(name).DEFAULT
    transform = weights.transforms()
    resize = int(transform.resize_size[0])
    side = int(getattr(transform, "crop_size", [resize])[0])
    return ModelSpec(
        name=name,
        architecture=name,
        input=InputSpec(channels=3, height=side, width=side),
        resize_size=resize,
        interpolation=transform.interpolation.value,
        mean=tuple(float(m) for m in transform.mean),
        std=tuple(float(s) for s in transform.std),
        labels=tuple(weights.meta["categories"]),
        **changes,
    )


class MaskRows(DetectionRows):
    """Mask R-CNN's scriptable core: float images ``[N, 3, H, W]`` in 0..1 -> the ``yolo-seg`` head and prototypes
    (see the module). torchvision's own steps, but each 28 x 28 mask is sampled at the prototypes' cell centres,
    bilinearly, 0 past its box: torchvision's paste would round each box to whole cells (4 pixels) at that size."""

    def __init__(self, detector: Any, k: int) -> None:
        super().__init__(detector, k)
        self.stride = PROTO_STRIDE  # attributes: TorchScript reads no module's globals
        self.classes = int(detector.roi_heads.box_predictor.cls_score.out_features)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        d = self.detector  # (unpacked with another name, TorchScript loses its type)
        height, width = x.shape[-2], x.shape[-1]
        images, _ = d.transform(list(x.unbind(0)))
        features = d.backbone(images.tensors)
        found, _ = d.roi_heads(features, d.rpn(images, features)[0], images.image_sizes)
        masks = [f.pop("masks") for f in found]  # [n, 1, 28, 28] probabilities, each over its box
        found = d.transform.postprocess(found, images.image_sizes, [(height, width)] * x.shape[0])
        xs = (torch.arange(width // self.stride, device=x.device, dtype=x.dtype) + 0.5) * self.stride
        ys = (torch.arange(height // self.stride, device=x.device, dtype=x.dtype) + 0.5) * self.stride
        heads, protos = [], []
        for f, mask in zip(found, masks):  # noqa: B905  (TorchScript's zip takes no strict)
            box, n = f["boxes"], f["boxes"].shape[0]
            size = (box[:, 2:] - box[:, :2]).clamp(min=1e-3)
            u = ((xs[None, :] - box[:, :1]) / size[:, :1] * 2 - 1)[:, None, :].expand(-1, len(ys), -1)
            v = ((ys[None, :] - box[:, 1:2]) / size[:, 1:] * 2 - 1)[:, :, None].expand(-1, -1, len(xs))
            cells = nn.functional.grid_sample(mask, torch.stack([u, v], dim=3), align_corners=False)[:, 0]
            protos.append(nn.functional.pad(cells - 0.5, [0, 0, 0, 0, 0, self.k - n], value=-0.5))
            scores = nn.functional.one_hot(f["labels"], self.classes).to(x.dtype) * f["scores"][:, None]
            rows = torch.cat([(box[:, :2] + box[:, 2:]) / 2, size, scores], dim=1)
            select = torch.eye(self.k, dtype=x.dtype, device=x.device)  # anchor k's coefficients pick prototype k
            heads.append(torch.cat([nn.functional.pad(rows, [0, 0, 0, self.k - n]).T, select]))
        return torch.stack(heads), torch.stack(protos)


class SemanticLogits(nn.Module):
    """LR-ASPP or DeepLabV3 answering its logits ``[N, C, h, w]`` before torchvision upsamples them to the input;
    its modules keep torchvision's names, so torchvision's state dict loads as it is."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.backbone, self.classifier = model.get_submodule("backbone"), model.get_submodule("classifier")
        self.aux_classifier = getattr(model, "aux_classifier", None)  # DeepLabV3's weights hold it; never run
        self.lraspp = isinstance(model, tvs.LRASPP)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = self.backbone(x)
        return self.classifier(features if self.lraspp else features["out"])


def _register_semantic(name: str, description: str, **kwargs: Any) -> None:
    """LR-ASPP or DeepLabV3, no weights (batch-norm statistics from noise through its front), its spec from
    torchvision's VOC weights' metadata (no download)."""
    # torchvision's training pads its crops with black
    spec = torchvision_spec(name, task="semantic", resize="letterbox", pad_value=0)

    def builder(*, num_classes: int = 21) -> nn.Module:
        factory = tvm.get_model_builder(name)
        model = SemanticLogits(factory(weights=None, weights_backbone=None, num_classes=num_classes, **kwargs)).eval()
        if not next(model.parameters()).is_meta:  # built only to be counted otherwise
            recalibrate(Uint8Classifier(model, spec.mean, spec.std), front=True)
        return model

    builder.__name__ = name
    register(name, spec=spec, description=description, task="semantic")(builder)


_register_semantic("lraspp_mobilenet_v3_large", "torchvision LR-ASPP MobileNetV3-Large (VOC): logits [N, 21, H/8, W/8]")
_register_semantic("deeplabv3_mobilenet_v3_large", "torchvision DeepLabV3 MobileNetV3-Large (VOC): logits [N, 21, "
                   "H/16, W/16]", aux_loss=True)  # fmt: skip


@register(
    MASK_RCNN,
    spec=msgspec.structs.replace(
        detector_spec(MASK_RCNN, MASK_SIZE, MASK_K), task="segment", output_layout="yolo-seg", resize="letterbox"
    ),
    description="torchvision Mask R-CNN ResNet-50 FPN v2 (COCO): its 32 best detections and masks as yolo-seg",
    task="segment",
)
def maskrcnn_resnet50_fpn_v2(*, num_classes: int = 91, k: int = MASK_K, **kwargs: Any) -> nn.Module:
    """``k`` detections an image; ``kwargs`` reach torchvision's builder (fewer proposals for a quicker test)."""
    return build(tvd.maskrcnn_resnet50_fpn_v2, k=k, size=MASK_SIZE, rows=MaskRows, num_classes=num_classes,
                 score_layer=("roi_heads.box_predictor.cls_score", SOFTMAX_LOGIT_STD), box_score_thresh=0.0,
                 **kwargs)  # fmt: skip
