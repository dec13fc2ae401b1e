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
    return TrainRecord(
        dataset=feed.name,
        epochs=config.epochs,
        batch_size=config.batch_size,
        lr=config.lr,
        seed=config.seed,
        device=str(device),
        world_size=world,
        train_size=feed.train_size,
        val_size=feed.val_size,
        val_accuracy=history[-1].val_accuracy,
        duration_s=time.perf_counter() - started,
        history=tuple(history),
        versions={
            "torch": str(torch.__version__),
            "torchvision": str(torchvision.__version__),
            "python": platform.python_version(),
        },
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
    )
