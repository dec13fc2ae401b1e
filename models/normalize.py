"""The uint8 front of every model: uint8 NCHW in, normalised float into the network.

Training wraps the network in it, and export bakes it into the graph, so the wire and the host-to-device copy
carry uint8 (four times fewer bytes than float32) and no client has to know the mean and std.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class Uint8Normalize(nn.Module):
    """``x -> (x / 255 - mean) / std`` per channel, folded into one multiply-add."""

    scale: torch.Tensor
    shift: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        mean_t = torch.tensor(list(mean), dtype=torch.float32).view(1, -1, 1, 1)
        std_t = torch.tensor(list(std), dtype=torch.float32).view(1, -1, 1, 1)
        self.register_buffer("scale", 1.0 / (255.0 * std_t))
        self.register_buffer("shift", -mean_t / std_t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.scale.dtype) * self.scale + self.shift


class Uint8Classifier(nn.Module):
    """A classifier that takes uint8 NCHW images and returns logits ``[N, num_classes]``."""

    def __init__(self, network: nn.Module, mean: Sequence[float], std: Sequence[float]) -> None:
        super().__init__()
        self.normalize = Uint8Normalize(mean, std)
        self.network = network

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(self.normalize(x))
