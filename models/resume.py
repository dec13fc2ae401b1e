"""What ``train --resume`` needs beyond the weights: optimizer, scheduler, scaler, random states, the epoch.

Stored in the checkpoint's ``resume`` entry as tensors, numbers and strings only, so the file still loads with
``torch.load(weights_only=True)``. Restoring it and running the remaining epochs gives what the uninterrupted
run would have given: the shuffling and the augmentation of an epoch depend only on (seed, epoch), and the
process-wide generators (dropout, the in-memory shuffle) are put back as they were.
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import torch

from models.checkpoint import Checkpoint, TrainRecord
from service.core.errors import ConfigError

RESUME_FORMAT = 1


def capture(
    *,
    epoch: int,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    generator: torch.Generator | None,
    skipped: dict[str, str],
) -> dict[str, Any]:
    version, mt_state, gauss = random.getstate()
    np_state: tuple[Any, ...] = tuple(np.random.get_state())
    state: dict[str, Any] = {
        "format": RESUME_FORMAT,
        "epoch": epoch,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "python_rng": [version, list(mt_state), gauss],
        "numpy_rng": [str(np_state[0]), torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)), *np_state[2:]],
        "skipped": msgspec.json.encode(skipped).decode(),
    }
    if torch.cuda.is_available():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    if generator is not None:
        state["generator"] = generator.get_state()
    return state


def check_compatible(
    ckpt: Checkpoint, *, arch: str, dataset: str, epochs: int, batch_size: int, lr: float, seed: int, world: int
) -> TrainRecord:
    """The run to resume must be this one: same architecture, data, schedule and seed."""
    record = ckpt.record
    assert record is not None
    wanted = {
        "arch": (ckpt.spec.architecture, arch),
        "dataset": (record.dataset, dataset),
        "epochs": (record.epochs, epochs),
        "batch-size": (record.batch_size, batch_size),
        "lr": (record.lr, lr),
        "seed": (record.seed, seed),
        "processes (world size)": (record.world_size, world),
    }
    differ = [f"--{k} {old!r} in the checkpoint, {new!r} now" for k, (old, new) in wanted.items() if old != new]
    if differ:
        raise ConfigError("--resume continues the same run, but " + "; ".join(differ))
    done = len(record.history)
    if done >= epochs:
        raise ConfigError(f"--resume: the checkpoint has finished all {epochs} epochs already; nothing to do")
    return record


def restore(
    state: dict[str, Any],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    generator: torch.Generator | None,
) -> tuple[int, dict[str, str]]:
    """Put the saved states back; returns the last completed epoch and the unreadable files seen so far."""
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    version, mt_state, gauss = state["python_rng"]
    random.setstate((version, tuple(mt_state), gauss))
    name, keys, *rest = state["numpy_rng"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if generator is not None and "generator" in state:
        generator.set_state(state["generator"])
    skipped = msgspec.json.decode(state.get("skipped", "{}"), type=dict[str, str])
    return int(state["epoch"]), skipped
