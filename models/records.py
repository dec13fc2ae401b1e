"""The training record of a run so far: what ``train`` writes into each checkpoint."""

from __future__ import annotations

import platform
import time
from datetime import UTC, datetime

import torch
import torchvision

from models.checkpoint import EpochRecord, Extension, SkippedImage, TrainRecord
from models.config import TrainConfig
from models.feeds import Feed
from models.folder import MAX_LISTED_SKIPS

# Validation this far below training accuracy in each of the last ``GAP_EPOCHS`` epochs is named in the record and
# the summary: a model that answers one class for everything (a BatchNorm broken by one-image batches, issue 41)
# trained at 95% and validated at 23%, and nothing said so.
GAP = 0.25
GAP_EPOCHS = 2


def accuracy_warnings(history: list[EpochRecord]) -> tuple[str, ...]:
    """Words for a run whose validation accuracy fell far below its training accuracy in its last epochs."""
    last = history[-GAP_EPOCHS:]
    if len(last) < GAP_EPOCHS or any(h.val_accuracy is None for h in last):
        return ()
    if not all(h.train_accuracy - (h.val_accuracy or 0.0) > GAP for h in last):
        return ()
    shown = ", ".join(f"epoch {h.epoch} {h.train_accuracy:.1%} / {h.val_accuracy:.1%}" for h in last)
    return (
        f"validation accuracy far below training accuracy in the last {GAP_EPOCHS} epochs (train / val: {shown}): "
        "the model may not generalise, or validation images may differ from training ones; check before serving",
    )


def library_versions() -> dict[str, str]:
    """The versions a training record names."""
    return {
        "torch": str(torch.__version__),
        "torchvision": str(torchvision.__version__),
        "python": platform.python_version(),
    }


def training_record(
    config: TrainConfig,
    feed: Feed,
    device: torch.device,
    world: int,
    history: list[EpochRecord],
    best: tuple[int, float] | None,
    skipped: dict[str, str],
    started: float,
    resumed_from: int | None,
    extensions: tuple[Extension, ...] = (),
) -> TrainRecord:
    listed = sorted(skipped.items())[:MAX_LISTED_SKIPS]
    train_size, val_size = feed.readable_sizes(skipped)
    return TrainRecord(
        dataset=feed.name,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        seed=config.seed,
        device=str(device),
        world_size=world,
        train_size=train_size,
        val_size=val_size,
        val_accuracy=history[-1].val_accuracy,
        duration_s=time.perf_counter() - started,
        history=tuple(history),
        versions=library_versions(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        loader=feed.mode,
        workers=feed.workers,
        augment=config.augment and config.dataset.startswith("folder:"),
        skipped_images=len(skipped),
        skipped=tuple(SkippedImage(path, reason) for path, reason in listed),
        best_epoch=best[0] if best else None,
        best_val_accuracy=best[1] if best else None,
        resumed_from_epoch=resumed_from,
        extensions=extensions,
        warnings=accuracy_warnings(history),
    )
