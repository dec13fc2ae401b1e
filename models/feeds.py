"""Where training batches come from: a :class:`Feed` per epoch, in memory or streamed from a folder.

The loop in ``models/train.py`` sees only this seam: ``set_epoch``, ``train_batches``, ``val_batches``. The
in-memory feed (digits, synthetic, small folders) indexes one uint8 tensor; the streaming feed
(``models/folder.py``) decodes files in DataLoader workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from typing import NamedTuple, Protocol

import torch

from models.augment import Augmentation, augment_tensor
from service.core.spec import ModelSpec


class Batch(NamedTuple):
    """uint8 images [N, C, H, W], int64 targets [N], and the images that could not be read: (path, reason)."""

    images: torch.Tensor
    targets: torch.Tensor
    skipped: list[tuple[str, str]]


def even_batches(count: int, batch_size: int) -> list[tuple[int, int]]:
    """``count`` items cut into ``ceil(count / batch_size)`` batches whose sizes differ by at most one, as
    ``(start, stop)`` spans: every item is seen every epoch, with as many steps as plain slicing, and no batch is a
    small remainder. A last batch of one image (193 images at batch 32) trained BatchNorm on one image's statistics
    at the peak learning rate every epoch: validation swung from 100% to 74.5% and a resumed run exported a model
    that answered one class for everything (issue 41)."""
    if count <= 0:
        return []
    batches = -(-count // batch_size)
    base, extra = divmod(count, batches)
    return list(pairwise(b * base + min(b, extra) for b in range(batches + 1)))  # the first ``extra`` take one more


class Feed(Protocol):
    name: str
    labels: tuple[str, ...]
    mode: str  # "memory" or "stream"
    workers: int
    train_size: int
    val_size: int

    def steps_per_epoch(self) -> int: ...
    def readable_sizes(self, skipped: dict[str, str]) -> tuple[int, int]: ...
    def set_epoch(self, epoch: int) -> None: ...
    def train_batches(self) -> Iterator[Batch]: ...
    def val_batches(self) -> Iterator[Batch]: ...
    def close(self) -> None: ...


class MemoryFeed:
    """Shuffled batches of a uint8 tensor held in memory; each rank takes every ``world``-th image.

    With ``augmentation``, each image of a batch is cropped and flipped (:func:`models.augment.augment_tensor`).
    """

    mode = "memory"
    workers = 0

    def __init__(
        self,
        *,
        name: str,
        labels: tuple[str, ...],
        train: tuple[torch.Tensor, torch.Tensor],
        val: tuple[torch.Tensor, torch.Tensor],
        batch_size: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        spec: ModelSpec | None = None,
        augmentation: Augmentation | None = None,
    ) -> None:
        self.name, self.labels = name, labels
        self.train_images, self.train_targets = train
        self.val_images, self.val_targets = val
        self.train_size, self.val_size = len(self.train_images), len(self.val_images)
        self.batch_size, self.seed, self.rank, self.world = batch_size, seed, rank, world
        self.spec, self.augmentation = spec, augmentation
        # One generator across epochs, as before streaming existed: its state is part of a resumable checkpoint.
        self.generator = torch.Generator().manual_seed(seed)
        self.epoch = 0

    def steps_per_epoch(self) -> int:
        per_rank = -(-self.train_size // self.world)
        return -(-per_rank // self.batch_size)

    def readable_sizes(self, skipped: dict[str, str]) -> tuple[int, int]:
        """(train, val) images: held decoded, so the unreadable ones were left out before."""
        return self.train_size, self.val_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def train_batches(self) -> Iterator[Batch]:
        order = torch.randperm(self.train_size, generator=self.generator)[self.rank :: self.world]
        for start, stop in even_batches(len(order), self.batch_size):
            idx = order[start:stop]
            images = self.train_images[idx]
            if self.augmentation is not None and self.spec is not None:
                images = augment_tensor(images, idx, self.spec, self.augmentation, self.seed, self.epoch)
            yield Batch(images, self.train_targets[idx], [])

    def val_batches(self) -> Iterator[Batch]:
        for start in range(0, self.val_size, 256):
            yield Batch(self.val_images[start : start + 256], self.val_targets[start : start + 256], [])

    def close(self) -> None:
        pass
