"""The architectures visionserve ships: ``smallcnn``, the ``digitdet`` detector and torchvision's ImageNet classifiers.

No weights are ever downloaded: torchvision builders are called with ``weights=None``; a user's own state dict is
loaded afterwards (``visionserve train/export --weights PATH``).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import torch
import torchvision.models as tvm
from torch import nn

from models.detector import DigitDet
from models.registry import get_architecture, register
from models.segmenter import DigitSeg
from models.tv_segmenters import torchvision_spec  # (importing it registers torchvision's segmenters)
from service.core.spec import InputSpec, ModelSpec

DIGIT_LABELS = tuple(str(d) for d in range(10))


class SmallCNN(nn.Module):
    """A compact conv-bn-relu-pool network for small inputs, in the spirit of the classic CIFAR-10 ConvNet.

    Three stages of conv3x3-BN-ReLU-maxpool (32, 64, 128 channels), global average pooling, dropout and a
    linear classifier: about 0.1 M parameters, any input of at least 8x8.
    """

    def __init__(self, *, num_classes: int = 10, in_channels: int = 3, dropout: float = 0.2) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for width in (32, 64, 128):
            layers += [
                nn.Conv2d(channels, width, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
            ]
            channels = width
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(channels, num_classes))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(self.features(x)))


@register(
    "smallcnn",
    spec=ModelSpec(
        name="smallcnn",
        architecture="smallcnn",
        input=InputSpec(channels=3, height=32, width=32),
        resize_size=32,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        labels=DIGIT_LABELS,
    ),
    description="compact conv-bn-relu-pool CNN for small inputs (the embedded digits model)",
)
def smallcnn(*, num_classes: int = 10) -> nn.Module:
    return SmallCNN(num_classes=num_classes)


@register(
    "digitdet",
    spec=ModelSpec(
        name="digitdet",
        architecture="digitdet",
        input=InputSpec(channels=3, height=96, width=96),
        resize_size=96,
        mean=(0.5, 0.5, 0.5),
        std=(0.5, 0.5, 0.5),
        labels=DIGIT_LABELS,
        task="detect",
        resize="letterbox",
        pad_value=0,  # the canvases' ground is dark: grey padding would look like clutter to it
        output_layout="candidates",
        max_detections=100,
    ),
    description="CenterNet-style digit detector: [N, 100, 6] boxes before suppression (the embedded detector)",
    task="detect",
)
def digitdet(*, num_classes: int = 10) -> nn.Module:
    return DigitDet(num_classes=num_classes)


@register(
    "digitseg",
    spec=msgspec.structs.replace(  # digitdet's input and preprocessing; ultralytics' segmentation layout out
        get_architecture("digitdet").spec,
        name="digitseg",
        architecture="digitseg",
        task="segment",
        output_layout="yolo-seg",
    ),
    description="digitdet with YOLACT-style masks: ultralytics' segmentation layout (the embedded segmenter)",
    task="segment",
)
def digitseg(*, num_classes: int = 10) -> nn.Module:
    return DigitSeg(num_classes=num_classes)


def _register_torchvision(name: str, factory: Callable[..., nn.Module], description: str) -> None:
    def builder(*, num_classes: int = 1000) -> nn.Module:
        return factory(weights=None, num_classes=num_classes)

    builder.__name__ = name
    register(name, spec=torchvision_spec(name), description=description)(builder)


_register_torchvision("resnet18", tvm.resnet18, "torchvision ResNet-18")
_register_torchvision("resnet50", tvm.resnet50, "torchvision ResNet-50")
_register_torchvision("mobilenet_v3_small", tvm.mobilenet_v3_small, "torchvision MobileNetV3-Small")
_register_torchvision("mobilenet_v3_large", tvm.mobilenet_v3_large, "torchvision MobileNetV3-Large")
_register_torchvision("efficientnet_b0", tvm.efficientnet_b0, "torchvision EfficientNet-B0")
_register_torchvision("convnext_tiny", tvm.convnext_tiny, "torchvision ConvNeXt-Tiny")
