"""One training epoch and one evaluation pass over a :class:`~models.feeds.Feed`, timed.

The time of an epoch is split in two: waiting for the next batch (``data_wait_s``: decoding, when the loader
cannot keep up) and the step itself (``compute_s``: the copy to the device, forward, backward, update, up to the
loss value, which waits for the device). Their ratio says which of the two limits training.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from models.feeds import Batch


class StepProgress(Protocol):
    def advance(self, loss: float, accuracy: float) -> None: ...


@dataclass
class EpochStats:
    seen: int = 0
    correct: int = 0
    loss_sum: float = 0.0
    data_wait_s: float = 0.0
    compute_s: float = 0.0
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def images_per_s(self) -> float:
        busy = self.data_wait_s + self.compute_s
        return self.seen / busy if busy > 0 else 0.0


def timed(batches: Iterable[Batch], stats: EpochStats) -> Iterator[Batch]:
    """``batches``, adding the time spent waiting for each to ``stats.data_wait_s``."""
    it = iter(batches)
    while True:
        started = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return
        stats.data_wait_s += time.perf_counter() - started
        stats.skipped += batch.skipped
        yield batch


def to_device(batch: Batch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = batch.images.to(device, non_blocking=True)
    y = batch.targets.to(device, non_blocking=True)
    if device.type == "cuda":
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def train_epoch(
    model: nn.Module,
    batches: Iterable[Batch],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    progress: StepProgress | None,
) -> EpochStats:
    stats = EpochStats()
    model.train()
    for batch in timed(batches, stats):
        started = time.perf_counter()
        if len(batch.targets) > 0:  # a batch whose every file was unreadable is skipped, not a step
            x, y = to_device(batch, device)
            with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                logits = model(x)
                loss = F.cross_entropy(logits, y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            stats.seen += len(y)
            stats.correct += int((logits.detach().argmax(1) == y).sum())
            stats.loss_sum += float(loss.detach()) * len(y)
        stats.compute_s += time.perf_counter() - started
        if progress is not None:
            progress.advance(stats.loss_sum / max(stats.seen, 1), stats.correct / max(stats.seen, 1))
    return stats


@torch.inference_mode()
def evaluate_batches(model: nn.Module, batches: Iterable[Batch], device: torch.device) -> tuple[float, EpochStats]:
    """Top-1 accuracy over ``batches`` (NaN when there are none), and what was read and skipped."""
    model.eval()
    stats = EpochStats()
    for batch in timed(batches, stats):
        if len(batch.targets) == 0:
            continue
        x, _ = to_device(batch, device)
        stats.correct += int((model(x).argmax(1).cpu() == batch.targets).sum())
        stats.seen += len(batch.targets)
    return (stats.correct / stats.seen if stats.seen else float("nan")), stats
