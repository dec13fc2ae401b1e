"""Training: ``visionserve train``.

One process on the CPU or one GPU, or several GPUs with DistributedDataParallel when started by ``torchrun``
(only rank 0 reports and writes). On CUDA: automatic mixed precision and channels-last. Batches come from a
:class:`~models.feeds.Feed`: digits, synthetic data and small folders sit in memory as uint8; larger folders are
streamed through DataLoader workers (``models/folder.py``). After every epoch rank 0 writes the checkpoint
atomically, with the state that ``--resume`` needs, and keeps the best one by validation accuracy beside it.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from models import resume as resuming
from models.augment import augmentation_for
from models.checkpoint import (
    Checkpoint,
    EpochRecord,
    Extension,
    TrainRecord,
    apply_weights,
    load_resume_state,
    load_weights,
    save_checkpoint,
)
from models.config import TrainConfig
from models.datasets import Dataset, load_dataset
from models.feeds import Batch, Feed, MemoryFeed
from models.folder import StreamFeed, choose_mode, default_workers, memory_feed, scan_folder
from models.loop import evaluate_batches, train_epoch
from models.normalize import Uint8Classifier
from models.records import training_record
from models.registry import get_architecture, with_input_size
from service.core.errors import ConfigError
from service.core.spec import ModelSpec


@dataclass(frozen=True)
class TrainResult:
    spec: ModelSpec
    record: TrainRecord
    path: str | None
    rank: int = 0  # under torchrun, only rank 0 reports and writes
    best_path: str | None = None


class BatchProgress:
    """What the loop reports to: a bar per epoch (set up by the caller); these defaults do nothing."""

    def start_epoch(self, epoch: int, batches: int) -> None: ...
    def advance(self, loss: float, accuracy: float) -> None: ...
    def end_epoch(self, record: EpochRecord) -> None: ...


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when a usable GPU is present, else the CPU; other names are checked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}") from exc
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asked for, but no usable CUDA GPU is present")
    return device


def best_path_for(out: str | Path) -> Path:
    """Where the best epoch's checkpoint is kept: ``x.pt`` -> ``x.best.pt``."""
    out = Path(out)
    return out.with_name(f"{out.stem}.best{out.suffix or '.pt'}")


def spec_for(config: TrainConfig, dataset_labels: tuple[str, ...] | None = None) -> ModelSpec:
    """The architecture's spec at the run's input size, with the dataset's labels when given."""
    spec = get_architecture(config.arch).spec
    if config.input_size is not None:
        spec = with_input_size(spec, config.input_size)
    if dataset_labels is not None:
        spec = msgspec.structs.replace(spec, labels=dataset_labels)
    return spec


def validate(config: TrainConfig) -> None:
    """Refuse settings no run can take, naming the flag and the value."""
    if config.epochs < 1:
        raise ConfigError(f"--epochs must be an integer >= 1, got {config.epochs}")
    if config.batch_size < 1:
        raise ConfigError(f"--batch-size must be an integer >= 1, got {config.batch_size}")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise ConfigError(f"--lr must be a number > 0, got {config.lr}")
    if config.workers is not None and config.workers < 0:
        raise ConfigError(f"--workers must be an integer >= 0, got {config.workers}")
    if config.limit_batches is not None and config.limit_batches < 1:
        raise ConfigError(f"--limit-batches must be an integer >= 1, got {config.limit_batches}")
    if config.loader not in ("auto", "memory", "stream"):
        raise ConfigError(f"--loader must be auto, memory or stream, got {config.loader!r}")


@contextlib.contextmanager
def _distributed(device: torch.device) -> Iterator[tuple[int, int, torch.device]]:
    """(rank, world_size, device); sets up a process group when started by torchrun with several processes."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        yield 0, 1, device
        return
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    try:
        yield dist.get_rank(), world, device
    finally:
        dist.destroy_process_group()


def evaluate(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, device: torch.device) -> float:
    """Top-1 accuracy of ``model`` on uint8 ``images``."""
    batches = (Batch(images[i : i + 256], targets[i : i + 256], []) for i in range(0, len(images), 256))
    return evaluate_batches(model, batches, device)[0]


def _compute_threads(device: torch.device, feed: Feed, threads: int) -> int:
    """On the CPU, streaming workers decode on cores of their own: the loop's intra-op threads keep off them.
    Measured on a busy 2-core VM: mobilenet_v3_small trained at 80 images/s on one thread and at 11 on two, its
    threads spinning against everything else on the cores (docs/performance.md)."""
    if device.type != "cpu" or feed.mode != "stream" or feed.workers == 0:
        return threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(threads, cores - feed.workers))


def _make_feed(
    config: TrainConfig, spec: ModelSpec, dataset: Dataset | None, rank: int, world: int, device: torch.device
) -> tuple[Feed, list[tuple[str, str]]]:
    """The batches of this run, and the files found unreadable while loading them."""
    if dataset is None and config.dataset.startswith("folder:"):
        index = scan_folder(config.dataset.removeprefix("folder:"))  # an empty class is refused here
        workers = default_workers() if config.workers is None else config.workers
        augmentation = augmentation_for(config.arch) if config.augment else None
        common: dict[str, Any] = dict(
            batch_size=config.batch_size,
            seed=config.seed,
            workers=workers,
            rank=rank,
            world=world,
            augmentation=augmentation,
        )
        if choose_mode(config.loader, index, spec, workers) == "memory":
            return memory_feed(index, spec, **common)
        return StreamFeed(index, spec, pin_memory=device.type == "cuda", **common), []
    data = dataset or load_dataset(config.dataset, spec)
    feed = MemoryFeed(
        name=data.name,
        labels=data.labels,
        train=(data.train_images, data.train_targets),
        val=(data.val_images, data.val_targets),
        batch_size=config.batch_size,
        seed=config.seed,
        rank=rank,
        world=world,
    )
    return feed, []


@dataclass
class _Run:
    """One run's state as its epochs go: what each epoch trains with, and what its checkpoints record."""

    config: TrainConfig
    feed: Feed
    device: torch.device
    rank: int
    world: int
    spec: ModelSpec  # named after the architecture and the dataset: what the checkpoints carry
    network: nn.Module
    model: nn.Module  # the uint8 classifier around ``network``, on the device
    train_model: nn.Module  # ``model``, or DistributedDataParallel around it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    steps_per_epoch: int
    skipped: dict[str, str]
    history: list[EpochRecord] = field(default_factory=list)
    best: tuple[int, float] | None = None
    first_epoch: int = 1
    resumed_from: int | None = None
    extensions: tuple[Extension, ...] = ()  # how often, and from where, ``--resume --epochs M`` extended the run
    started: float = 0.0

    @property
    def generator(self) -> torch.Generator | None:
        return self.feed.generator if isinstance(self.feed, MemoryFeed) else None

    @property
    def best_path(self) -> Path | None:
        return best_path_for(self.config.out) if self.config.out else None

    def summary(self) -> TrainRecord:
        return training_record(
            self.config, self.feed, self.device, self.world, self.history, self.best, self.skipped, self.started,
            self.resumed_from, self.extensions,
        )  # fmt: skip


def train(
    config: TrainConfig,
    *,
    progress: BatchProgress | None = None,
    dataset: Dataset | None = None,
) -> TrainResult:
    """Train ``config.arch`` on ``config.dataset``; rank 0 writes ``config.out`` each epoch (unless it is empty)."""
    validate(config)
    progress = progress or BatchProgress()
    device = resolve_device(config.device)
    resume_from = load_resume_state(config.resume) if config.resume else None

    with _distributed(device) as (rank, world, device):
        run = _prepare(config, dataset, resume_from, rank, world, device)
        threads = torch.get_num_threads()
        torch.set_num_threads(_compute_threads(device, run.feed, threads))
        try:
            for epoch in range(run.first_epoch, config.epochs + 1):
                summary = _train_epoch(run, epoch, progress)
        finally:
            torch.set_num_threads(threads)
            run.feed.close()
        if world > 1:  # each rank saw its own share of the files: the record names them all
            summary = _gather_skipped(run)
        path = config.out if rank == 0 and config.out else None
        best_path = run.best_path
        best_written = str(best_path) if path and best_path is not None and best_path.exists() else None
        return TrainResult(spec=run.spec, record=summary, path=path, rank=rank, best_path=best_written)


def _prepare(
    config: TrainConfig,
    dataset: Dataset | None,
    resume_from: tuple[Checkpoint, dict[str, Any]] | None,
    rank: int,
    world: int,
    device: torch.device,
) -> _Run:
    """The feed, the network (resumed, or from ``--weights``) on the device, its optimiser, and the state so far."""
    feed, skipped_list = _make_feed(config, spec_for(config), dataset, rank, world, device)
    spec = spec_for(config, feed.labels)
    if feed.train_size == 0:
        raise ConfigError(f"dataset {config.dataset} has no training images")
    random.seed(config.seed)
    np.random.seed(config.seed)
    torch.manual_seed(config.seed)
    network = get_architecture(config.arch).build(num_classes=len(feed.labels))
    previous = _load_start(config, network, feed.name, spec, world, resume_from)
    model, train_model = _place(network, spec, device, world)
    steps_per_epoch = min(feed.steps_per_epoch(), config.limit_batches or feed.steps_per_epoch())
    optimizer, scheduler, scaler, amp_dtype = _optimiser(config, model, steps_per_epoch, device)
    run = _Run(
        config=config, feed=feed, device=device, rank=rank, world=world,
        spec=msgspec.structs.replace(spec, name=f"{config.arch}-{feed.name.split(':')[0]}"),
        network=network, model=model, train_model=train_model, optimizer=optimizer, scheduler=scheduler,
        scaler=scaler, amp_dtype=amp_dtype, steps_per_epoch=steps_per_epoch, skipped=dict(skipped_list),
    )  # fmt: skip
    if resume_from is not None and previous is not None:
        _restore(run, resume_from[1], previous)
    run.started = time.perf_counter() - (sum(h.duration_s for h in run.history))
    return run


def _load_start(
    config: TrainConfig,
    network: nn.Module,
    dataset: str,
    spec: ModelSpec,
    world: int,
    resume_from: tuple[Checkpoint, dict[str, Any]] | None,
) -> TrainRecord | None:
    """Load the weights the run starts from; the interrupted run's record when resuming."""
    if resume_from is not None:
        previous = resuming.check_compatible(resume_from[0], config, dataset, spec, world)
        apply_weights(network, resume_from[0].state_dict, source=str(config.resume))
        return previous
    if config.weights:
        state = load_weights(config.weights)
        # A classifier head of another width (ImageNet weights fine-tuned on a folder) is re-initialised.
        own = network.state_dict()
        state = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
        apply_weights(network, {**own, **state}, source=config.weights)
    return None


def _place(network: nn.Module, spec: ModelSpec, device: torch.device, world: int) -> tuple[nn.Module, nn.Module]:
    """(the uint8 classifier on the device, what the optimiser steps: it, or DDP around it)."""
    model: nn.Module = Uint8Classifier(network, spec.mean, spec.std).to(device)
    if device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    if world <= 1:
        return model, model
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model, ddp


def _optimiser(
    config: TrainConfig, model: nn.Module, steps_per_epoch: int, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler, torch.dtype | None]:
    """SGD with Nesterov momentum on a one-cycle schedule, and AMP's scaler (on only for float16)."""
    optimizer = torch.optim.SGD(
        model.parameters(), lr=config.lr, momentum=0.9, nesterov=True, weight_decay=config.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=config.lr, total_steps=config.epochs * steps_per_epoch, pct_start=0.2
    )
    amp_dtype = None if device.type != "cuda" else torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
    return optimizer, scheduler, scaler, amp_dtype


def _restore(run: _Run, state: dict[str, Any], previous: TrainRecord) -> None:
    """Put an interrupted run's optimiser, random states, history and best epoch back into ``run``; with a larger
    ``--epochs`` than the checkpoint's, the schedule is the one for the new total, fast-forwarded."""
    resuming.check_steps(state, epochs=previous.epochs, steps_per_epoch=run.steps_per_epoch)
    done, seen_bad = resuming.restore(
        state, optimizer=run.optimizer, scheduler=run.scheduler, scaler=run.scaler, generator=run.generator,
        extend=run.config.epochs > previous.epochs,
    )  # fmt: skip
    run.extensions = resuming.extensions(previous, run.config.epochs)
    run.skipped |= seen_bad
    run.history = list(previous.history)
    if previous.best_epoch is not None and previous.best_val_accuracy is not None:
        run.best = (previous.best_epoch, previous.best_val_accuracy)
    run.first_epoch, run.resumed_from = done + 1, done


def _train_epoch(run: _Run, epoch: int, progress: BatchProgress) -> TrainRecord:
    """Train and validate one epoch, record it, and (rank 0) write the checkpoints; the training record so far."""
    epoch_start = time.perf_counter()
    run.feed.set_epoch(epoch)
    if run.rank == 0:
        progress.start_epoch(epoch, run.steps_per_epoch)
    stats = train_epoch(
        run.train_model,
        islice(run.feed.train_batches(), run.steps_per_epoch),
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        scaler=run.scaler,
        device=run.device,
        amp_dtype=run.amp_dtype,
        progress=progress if run.rank == 0 else None,
    )
    val_acc, val_stats = evaluate_batches(
        run.model, islice(run.feed.val_batches(), run.config.limit_batches), run.device
    )
    run.skipped |= dict(stats.skipped) | dict(val_stats.skipped)
    record = EpochRecord(
        epoch=epoch,
        train_loss=stats.loss_sum / max(stats.seen, 1),
        train_accuracy=stats.correct / max(stats.seen, 1),
        val_accuracy=None if math.isnan(val_acc) else val_acc,
        duration_s=time.perf_counter() - epoch_start,
        images_per_s=stats.images_per_s,
        data_wait_s=stats.data_wait_s,
        compute_s=stats.compute_s,
        skipped_images=len(stats.skipped) + len(val_stats.skipped),
    )
    run.history.append(record)
    improved = record.val_accuracy is not None and (run.best is None or record.val_accuracy > run.best[1])
    if improved and record.val_accuracy is not None:
        run.best = (epoch, record.val_accuracy)
    summary = run.summary()
    if run.rank == 0 and run.config.out:
        _save(run, epoch, summary, improved)
    if run.rank == 0:
        progress.end_epoch(record)
    return summary


def _save(run: _Run, epoch: int, summary: TrainRecord, improved: bool) -> None:
    """The checkpoint with the state ``--resume`` needs, and the best epoch's beside it when this one is."""
    state = resuming.capture(
        epoch=epoch,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        scaler=run.scaler,
        generator=run.generator,
        skipped=run.skipped,
    )
    weights = run.network.state_dict()
    save_checkpoint(run.config.out, state_dict=weights, spec=run.spec, record=summary, resume=state)
    best_path = run.best_path
    if improved and best_path is not None:
        save_checkpoint(best_path, state_dict=weights, spec=run.spec, record=summary)


def _gather_skipped(run: _Run) -> TrainRecord:
    """The unreadable files every rank saw, in this rank's record."""
    gathered: list[dict[str, str] | None] = [None] * run.world
    dist.all_gather_object(gathered, run.skipped)
    for part in gathered:
        run.skipped |= part or {}
    return run.summary()
