"""What ``train --resume`` needs beyond the weights: optimizer, scheduler, scaler, random states, the epoch.

Stored in the checkpoint's ``resume`` entry as tensors, numbers and strings only, so the file still loads with
``torch.load(weights_only=True)``. Restoring it and running the remaining epochs gives what the uninterrupted
run would have given: the shuffling and the augmentation of an epoch depend only on (seed, epoch), and the
process-wide generators (dropout, the in-memory shuffle) are put back as they were.

A larger ``--epochs`` extends the run on the one-cycle schedule rebuilt for the new total and fast-forwarded (README,
"Training on your own images"): what a user of torchvision's reference scripts gets from ``--resume`` with a larger
``--epochs`` on their step schedule, whose rate depends on the epoch alone. The other reading, a fresh segment from
the current rate, would go on at the rate a finished one-cycle ends on (the peak / 250 000) and learn next to
nothing; a second full cycle (warm-up to the peak again) would undo more of what the first converged to. (Their
cosine schedule reloads its old length, ``T_max``, with the scheduler's state and climbs again past it: not a
behaviour to copy.)
"""

from __future__ import annotations

import random
from typing import Any

import msgspec
import numpy as np
import torch

from models.checkpoint import Checkpoint, Extension, TrainRecord
from models.config import TrainConfig
from service.core.errors import ConfigError
from service.core.spec import ModelSpec

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


def check_compatible(ckpt: Checkpoint, config: TrainConfig, dataset: str, spec: ModelSpec, world: int) -> TrainRecord:
    """The run to resume (``config`` on ``dataset`` at ``spec``, in ``world`` processes) must be the checkpoint's:
    same architecture, data and classes, input size, batch size, peak learning rate, seed and number of processes;
    any of them changed is refused, naming the flag and both values. ``--epochs`` may grow past the checkpoint's
    (the run is extended, see :func:`extensions`), never shrink. Where and how the run goes on may change too:
    ``--out``, ``--device``, ``--workers``, ``--loader``."""
    record, epochs = ckpt.record, config.epochs
    assert record is not None
    wanted = {
        "arch": (ckpt.spec.architecture, config.arch),
        "dataset": (record.dataset, dataset),
        "input-size": (ckpt.spec.input.height, spec.input.height),
        "batch-size": (record.batch_size, config.batch_size),
        "lr": (record.lr, config.lr),
        "seed": (record.seed, config.seed),
        "processes (world size)": (record.world_size, world),
    }
    differ = [f"--{k} {old!r} in the checkpoint, {new!r} now" for k, (old, new) in wanted.items() if old != new]
    if ckpt.spec.labels != spec.labels:
        differ.append(f"the classes {_few(ckpt.spec.labels)} in the checkpoint, {_few(spec.labels)} now")
    if differ:
        raise ConfigError(
            "--resume continues the same run, but "
            + "; ".join(differ)
            + " (only a larger --epochs, to extend it, and --out, --device, --workers, --loader may change)"
        )
    done = len(record.history)
    if epochs < done:
        raise ConfigError(
            f"--epochs {epochs} now, but the checkpoint has finished {done} epochs already (of --epochs "
            f"{record.epochs}): --resume continues or extends a run, it cannot undo epochs"
        )
    if epochs < record.epochs:
        raise ConfigError(
            f"--epochs {epochs} now, but the checkpoint's run is planned for --epochs {record.epochs}: --resume "
            f"continues it to {record.epochs} or extends it past that, it does not shorten it"
        )
    if done >= epochs:
        raise ConfigError(
            f"--resume: the checkpoint has finished all {epochs} epochs already; nothing to do (a larger --epochs "
            "extends the run)"
        )
    return record


def _few(labels: tuple[str, ...], shown: int = 5) -> str:
    more = f", ... ({len(labels)} in all)" if len(labels) > shown else ""
    return "[" + ", ".join(labels[:shown]) + more + "]"


def extensions(previous: TrainRecord, epochs: int) -> tuple[Extension, ...]:
    """The record's extensions with this resume's added when it asks for more epochs than the run was planned for."""
    if epochs <= previous.epochs:
        return previous.extensions
    added = Extension(from_epochs=previous.epochs, to_epochs=epochs, at_epoch=len(previous.history))
    return (*previous.extensions, added)


def check_steps(state: dict[str, Any], *, epochs: int, steps_per_epoch: int) -> None:
    """The saved schedule must count the steps per epoch this run takes; another ``--limit-batches`` (or other
    data under the same name) would put the schedule's end elsewhere, or past it (OneCycleLR raises there)."""
    total = int(state["scheduler"]["total_steps"])
    if total != epochs * steps_per_epoch:
        raise ConfigError(
            f"--resume continues the same run, but it took {total // max(epochs, 1)} steps per epoch and would "
            f"take {steps_per_epoch} now (another --limit-batches, or other data)"
        )


def fast_forward(scheduler: torch.optim.lr_scheduler.LRScheduler, steps: int) -> None:
    """Move a freshly built schedule to where it would be after ``steps`` optimiser steps, setting the optimiser's
    learning rate (and OneCycleLR's momentum) to what step ``steps + 1`` uses. OneCycleLR computes both from the
    step count alone, so one step from ``steps - 1`` gives what ``steps`` calls of ``step()`` would have."""
    if steps <= 0:
        return
    # _step_count only feeds step()'s warning about being called before optimizer.step() (when it is 1); an
    # uninterrupted run would have it at steps + 1 after this step.
    scheduler.load_state_dict({**scheduler.state_dict(), "last_epoch": steps - 1, "_step_count": max(steps, 2)})
    scheduler.step()


def restore(
    state: dict[str, Any],
    *,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    scaler: torch.amp.GradScaler,
    generator: torch.Generator | None,
    extend: bool = False,
) -> tuple[int, dict[str, str]]:
    """Put the saved states back; returns the last completed epoch and the unreadable files seen so far.

    ``extend``: ``scheduler`` was built for more epochs than the saved one; it is fast-forwarded to the steps done
    instead of replaced by the saved schedule (see the module's docstring)."""
    optimizer.load_state_dict(state["optimizer"])
    if extend:
        fast_forward(scheduler, int(state["scheduler"]["last_epoch"]))
    else:
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
