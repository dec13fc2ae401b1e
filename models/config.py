"""The settings of one training run: what ``train`` is asked for and what its training record repeats."""

from __future__ import annotations

import msgspec


class TrainConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Settings of one training run; the defaults train the embedded digits model."""

    arch: str = "smallcnn"
    dataset: str = "digits"
    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.01
    weight_decay: float = 5e-4
    seed: int = 0
    device: str = "auto"
    input_size: int | None = None
    weights: str | None = None
    out: str = "checkpoints/digits.pt"
    workers: int | None = None  # DataLoader workers for folders; None: models.folder.default_workers()
    loader: str = "auto"  # folders: auto | memory | stream
    augment: bool = True  # folders: random resized crop and flip (models/augment.py)
    resume: str | None = None  # a checkpoint of an earlier run of this config: continued, or extended to more epochs
    limit_batches: int | None = None  # benchmarks and smoke runs: at most this many batches per epoch and pass
