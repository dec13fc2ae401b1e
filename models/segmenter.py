"""``digitseg``: the embedded detector (``models/detector.py``) with a mask branch in the YOLACT style (Bolya et
al., "YOLACT: Real-time Instance Segmentation"): prototypes at stride 2 and, at every head cell, one coefficient a
prototype; an object's mask is its peak cell's coefficients times the prototypes.

Its ``forward`` (what export traces) answers as ultralytics' segmentation export does (the ``yolo-seg`` layout the
server reads, ``service/core/layouts.py``): ``output0`` ``[N, 4 + C + P, K]``, each of the top K heatmap peaks a
column of centre x, centre y, width and height (input pixels), a score per class (the peak's own class only) and
its P coefficients; ``output1`` ``[N, P, H / 2, W / 2]``, the prototypes. The server suppresses, multiplies, crops
to the box, resamples into the image's pixels and thresholds at 0.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.detector import DigitDet, _conv, _lateral, decode, decode_cells

PROTOTYPES = 16
PROTO_STRIDE = 2


class DigitSeg(DigitDet):
    """``DigitDet`` plus prototypes and coefficients; ``heads`` gives the raw training outputs."""

    def __init__(self, *, num_classes: int = 10, max_detections: int = 100, prototypes: int = PROTOTYPES) -> None:
        super().__init__(num_classes=num_classes, max_detections=max_detections)
        self.prototypes = prototypes
        self.coefficients = nn.Conv2d(48, prototypes, 1)
        self.up2, self.lat2 = _lateral(48, 32), _lateral(16, 32)
        self.merge2 = _conv(32, 32)
        self.proto = nn.Conv2d(32, prototypes, 1)
        for m in (self.proto, *self.up2.modules(), *self.lat2.modules(), *self.merge2.modules()):
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        nn.init.normal_(self.coefficients.weight, std=0.01)  # the masks' logits small at first: a gentle start

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        """(class logits ``[N, C, h, w]``, width and height in cells, offset, coefficients ``[N, P, h, w]``) at
        stride 4 and the prototypes ``[N, P, H / 2, W / 2]``, for a normalised float input ``[N, 1 or 3, H, W]``."""
        x = x.sum(dim=1, keepdim=True) / x.shape[1]  # ReduceSum: see DigitDet.heads
        c2 = self.s2(x)
        c4 = self.s4(c2)
        c8 = self.s8(c4)
        c16 = self.s16(c8)
        p8 = self.merge8(F.relu(F.interpolate(self.lat16(c16), size=c8.shape[-2:]) + self.lat8(c8)))
        p4 = self.merge4(F.relu(F.interpolate(self.up8(p8), size=c4.shape[-2:]) + self.lat4(c4)))
        head = self.head(p4)
        out = self.out(head)
        c = self.num_classes
        # The mask branch learns on the detector's features without moving them: trained through them, its loss cost
        # the boxes a third of their mAP@0.5 in 700 steps (0.68 against the detector's 0.95 alone).
        p2 = self.merge2(F.relu(F.interpolate(self.up2(p4.detach()), size=c2.shape[-2:]) + self.lat2(c2.detach())))
        return out[:, :c], out[:, c : c + 2], out[:, c + 2 :], self.coefficients(head.detach()), self.proto(p2)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits, size, offset, coefficients, protos = self.heads(x)
        rows, cells = decode_cells(logits, size, offset, max_detections=self.max_detections, input_hw=x.shape[-2:])
        x1, y1, x2, y2, score, cls = rows.unbind(2)
        box = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], 1)  # [N, 4, K]
        classes = torch.arange(self.num_classes, device=x.device, dtype=cls.dtype)
        scores = (cls[:, None, :] == classes[None, :, None]).to(score.dtype) * score[:, None]  # [N, C, K]
        picked = coefficients.flatten(2).gather(2, cells.unsqueeze(1).expand(-1, self.prototypes, -1))
        return torch.cat([box, scores, picked], 1), protos

    def candidates(self, x: torch.Tensor) -> torch.Tensor:
        """The detector's rows ``[N, K, 6]`` (its boxes judged as the detector's are)."""
        return decode(*self.heads(x)[:3], max_detections=self.max_detections, input_hw=x.shape[-2:])
