"""``digitdet``: a small one-stage, anchor-free detector in the CenterNet style (Zhou et al., "Objects as Points").

A body of conv-BN-ReLU pairs down to 1/16 of the input, a neck that climbs back to 1/4 adding each finer level
(U-Net-like), and one stride-4 head: a heatmap per class whose peaks are object centres, and at each position the
box's width and height and the centre's sub-cell offset. About 0.3 M parameters.

Its ``forward`` (what export traces) ends before suppression: sigmoid, a 3x3 max-pool peak mask, the top K peaks
over every class and position, and their boxes, as one float32 ``[N, K, 6]`` tensor of x1, y1, x2, y2 (input
pixels, clipped to the input), score, class index. K is fixed when the graph is built; the server suppresses.
Training reads the raw heads (:meth:`DigitDet.heads`).

The three input channels are averaged into one first: digits are grey, and a colour photo served to it is then
seen as the grey canvases it was trained on, whatever its colours.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

STRIDE = 4  # input pixels per head cell
_PRIOR = 0.1  # the heatmap's initial probability everywhere (CenterNet's -2.19 bias): a stable start for focal loss


def _conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)
    )


def _lateral(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 1, bias=False), nn.BatchNorm2d(cout))


class DigitDet(nn.Module):
    """CenterNet-style detector; ``forward`` gives ``[N, K, 6]`` candidates, ``heads`` the raw training outputs."""

    def __init__(self, *, num_classes: int = 10, max_detections: int = 100) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.max_detections = max_detections
        self.s2 = nn.Sequential(_conv(1, 16, 2), _conv(16, 16))
        self.s4 = nn.Sequential(_conv(16, 32, 2), _conv(32, 32))
        self.s8 = nn.Sequential(_conv(32, 64, 2), _conv(64, 64))
        self.s16 = nn.Sequential(_conv(64, 96, 2), _conv(96, 96))
        self.lat16, self.lat8 = _lateral(96, 64), _lateral(64, 64)
        self.merge8 = _conv(64, 64)
        self.up8, self.lat4 = _lateral(64, 48), _lateral(32, 48)
        self.merge4 = _conv(48, 48)
        self.head = _conv(48, 48)
        self.out = nn.Conv2d(48, num_classes + 4, 1)  # class heatmaps, then width and height, then x and y offset
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self.out.weight, std=0.01)
        assert self.out.bias is not None
        nn.init.zeros_(self.out.bias)
        nn.init.constant_(self.out.bias[:num_classes], -math.log((1 - _PRIOR) / _PRIOR))

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(class logits ``[N, C, h, w]``, width and height in cells ``[N, 2, h, w]``, offset ``[N, 2, h, w]``)
        at stride 4, for a normalised float input ``[N, 1 or 3, H, W]``."""
        # ReduceSum, not ReduceMean: ReduceMean's axes became an input in opset 18 and torch's exporter could not
        # convert the graph down to opset 17 (onnx's version converter found no constant axes).
        x = x.sum(dim=1, keepdim=True) / x.shape[1]
        c4 = self.s4(self.s2(x))
        c8 = self.s8(c4)
        c16 = self.s16(c8)
        p8 = self.merge8(F.relu(F.interpolate(self.lat16(c16), size=c8.shape[-2:]) + self.lat8(c8)))
        p4 = self.merge4(F.relu(F.interpolate(self.up8(p8), size=c4.shape[-2:]) + self.lat4(c4)))
        out = self.out(self.head(p4))
        c = self.num_classes
        return out[:, :c], out[:, c : c + 2], out[:, c + 2 :]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, size, offset = self.heads(x)
        return decode(logits, size, offset, max_detections=self.max_detections, input_hw=x.shape[-2:])

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """The rows ``[N, K, 6]`` its boxes are judged on (a detector's forward; a segmenter's boxes alone)."""
        return self(x)


def decode(
    logits: torch.Tensor,
    size: torch.Tensor,
    offset: torch.Tensor,
    *,
    max_detections: int,
    input_hw: tuple[int, int] | torch.Size,
) -> torch.Tensor:
    """The top ``max_detections`` heatmap peaks as ``[N, K, 6]`` rows: x1, y1, x2, y2, score, class.

    K is ``max_detections``, or every position when the map has fewer (a tiny input). Only ops that torch.export
    and ONNX (opset 17) take with a dynamic batch: Sigmoid, MaxPool, Equal, TopK, integer Div, GatherElements.
    """
    return decode_cells(logits, size, offset, max_detections=max_detections, input_hw=input_hw)[0]


def decode_cells(
    logits: torch.Tensor,
    size: torch.Tensor,
    offset: torch.Tensor,
    *,
    max_detections: int,
    input_hw: tuple[int, int] | torch.Size,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode`'s rows, and each one's head cell (flattened, ``[N, K]``: a segmenter's coefficients' place)."""
    _, classes, h, w = logits.shape
    heat = torch.sigmoid(logits)
    peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat).to(heat.dtype)
    k = min(max_detections, classes * h * w)
    scores, index = peaks.flatten(1).topk(k, dim=1)
    cls = torch.div(index, h * w, rounding_mode="floor")
    pixel = index - cls * (h * w)
    ys = torch.div(pixel, w, rounding_mode="floor")
    xs = pixel - ys * w
    gather = pixel.unsqueeze(1).expand(-1, 2, -1)
    wh = size.flatten(2).gather(2, gather).clamp(min=0) * STRIDE
    off = offset.flatten(2).gather(2, gather)
    cx = (xs.to(heat.dtype) + off[:, 0]) * STRIDE
    cy = (ys.to(heat.dtype) + off[:, 1]) * STRIDE
    height, width = float(input_hw[0]), float(input_hw[1])
    x1 = (cx - wh[:, 0] / 2).clamp(0.0, width)
    y1 = (cy - wh[:, 1] / 2).clamp(0.0, height)
    x2 = (cx + wh[:, 0] / 2).clamp(0.0, width)
    y2 = (cy + wh[:, 1] / 2).clamp(0.0, height)
    return torch.stack([x1, y1, x2, y2, scores, cls.to(heat.dtype)], dim=2), pixel
