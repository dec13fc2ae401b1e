"""Training: ``visionserve train``.

One process on the CPU or one GPU, or several GPUs with DistributedDataParallel when started by ``torchrun``
(only rank 0 reports and writes). On CUDA: automatic mixed precision and channels-last. The whole dataset sits in
memory as uint8, so an epoch is a shuffled index over it: no data-loader workers to start on a 2-core machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn

from models.checkpoint import EpochRecord, TrainRecord, apply_weights, load_weights, save_checkpoint
from models.datasets import Dataset, load_dataset
from models.normalize import Uint8Classifier
from models.registry import get_architecture, with_input_size
from service.core.errors import ConfigError
from service.core.spec import ModelSpec


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


@dataclass(frozen=True)
class TrainResult:
    spec: ModelSpec
    record: TrainRecord
    path: str | None
    rank: int = 0  # under torchrun, only rank 0 reports and writes


EpochHook = Callable[[EpochRecord], None]


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


def _spec_for(config: TrainConfig, dataset_labels: tuple[str, ...] | None = None) -> ModelSpec:
    spec = get_architecture(config.arch).spec
    if config.input_size is not None:
        spec = with_input_size(spec, config.input_size)
    if dataset_labels is not None:
        spec = msgspec.structs.replace(spec, labels=dataset_labels)
    return spec


def _validate(config: TrainConfig) -> None:
    if config.epochs < 1:
        raise ConfigError(f"--epochs must be an integer >= 1, got {config.epochs}")
    if config.batch_size < 1:
        raise ConfigError(f"--batch-size must be an integer >= 1, got {config.batch_size}")
    if not (config.lr > 0 and math.isfinite(config.lr)):
        raise ConfigError(f"--lr must be a number > 0, got {config.lr}")


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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


@torch.inference_mode()
def evaluate(model: nn.Module, images: torch.Tensor, targets: torch.Tensor, device: torch.device) -> float:
    """Top-1 accuracy of ``model`` on uint8 ``images``."""
    if len(images) == 0:
        return float("nan")
    model.eval()
    correct = 0
    for start in range(0, len(images), 256):
        x = images[start : start + 256].to(device, non_blocking=True)
        if device.type == "cuda":
            x = x.contiguous(memory_format=torch.channels_last)
        correct += int((model(x).argmax(1).cpu() == targets[start : start + 256]).sum())
    return correct / len(images)


def _amp_dtype(device: torch.device) -> torch.dtype | None:
    if device.type != "cuda":
        return None
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def train(
    config: TrainConfig,
    *,
    progress: BatchProgress | None = None,
    dataset: Dataset | None = None,
) -> TrainResult:
    """Train ``config.arch`` on ``config.dataset``; rank 0 writes ``config.out`` (unless it is empty)."""
    _validate(config)
    progress = progress or BatchProgress()
    device = resolve_device(config.device)
    spec = _spec_for(config)
    data = dataset or load_dataset(config.dataset, spec)
    spec = _spec_for(config, data.labels)
    if len(data.train_images) == 0:
        raise ConfigError(f"dataset {config.dataset} has no training images")

    with _distributed(device) as (rank, world, device):
        _seed_everything(config.seed)
        network = get_architecture(config.arch).build(num_classes=data.num_classes)
        if config.weights:
            state = load_weights(config.weights)
            # A classifier head of another width (ImageNet weights fine-tuned on a folder) is re-initialised.
            own = network.state_dict()
            state = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
            apply_weights(network, {**own, **state}, source=config.weights)
        model: nn.Module = Uint8Classifier(network, spec.mean, spec.std).to(device)
        if device.type == "cuda":
            model = model.to(memory_format=torch.channels_last)
        train_model: nn.Module = model
        if world > 1:
            train_model = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )

        steps_per_epoch = math.ceil(len(data.train_images) / world / config.batch_size)
        optimizer = torch.optim.SGD(
            model.parameters(), lr=config.lr, momentum=0.9, nesterov=True, weight_decay=config.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=config.lr, total_steps=config.epochs * steps_per_epoch, pct_start=0.2
        )
        amp_dtype = _amp_dtype(device)
        scaler = torch.amp.GradScaler("cuda", enabled=amp_dtype == torch.float16)
        generator = torch.Generator().manual_seed(config.seed)
        history: list[EpochRecord] = []
        started = time.perf_counter()
        for epoch in range(1, config.epochs + 1):
            epoch_start = time.perf_counter()
            train_model.train()
            order = torch.randperm(len(data.train_images), generator=generator)[rank::world]
            if rank == 0:
                progress.start_epoch(epoch, steps_per_epoch)
            seen = correct = 0
            loss_sum = 0.0
            for step in range(steps_per_epoch):
                idx = order[step * config.batch_size : (step + 1) * config.batch_size]
                if len(idx) == 0:
                    break
                x = data.train_images[idx].to(device, non_blocking=True)
                y = data.train_targets[idx].to(device, non_blocking=True)
                if device.type == "cuda":
                    x = x.contiguous(memory_format=torch.channels_last)
                with torch.autocast(device.type, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                    logits = train_model(x)
                    loss = F.cross_entropy(logits, y)
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                scheduler.step()
                batch_loss = float(loss.detach())
                batch_correct = int((logits.detach().argmax(1) == y).sum())
                seen += len(idx)
                correct += batch_correct
                loss_sum += batch_loss * len(idx)
                if rank == 0:
                    progress.advance(loss_sum / seen, correct / seen)
            val_acc = evaluate(model, data.val_images, data.val_targets, device)
            record = EpochRecord(
                epoch=epoch,
                train_loss=loss_sum / max(seen, 1),
                train_accuracy=correct / max(seen, 1),
                val_accuracy=None if math.isnan(val_acc) else val_acc,
                duration_s=time.perf_counter() - epoch_start,
            )
            history.append(record)
            if rank == 0:
                progress.end_epoch(record)

        record_all = TrainRecord(
            dataset=data.name,
            epochs=config.epochs,
            batch_size=config.batch_size,
            lr=config.lr,
            seed=config.seed,
            device=str(device),
            world_size=world,
            train_size=len(data.train_images),
            val_size=len(data.val_images),
            val_accuracy=history[-1].val_accuracy,
            duration_s=time.perf_counter() - started,
            history=tuple(history),
            versions={
                "torch": str(torch.__version__),
                "torchvision": str(torchvision.__version__),
                "python": platform.python_version(),
            },
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        spec = msgspec.structs.replace(spec, name=f"{config.arch}-{data.name.split(':')[0]}")
        path = None
        if rank == 0 and config.out:
            save_checkpoint(config.out, state_dict=network.state_dict(), spec=spec, record=record_all)
            path = config.out
        return TrainResult(spec=spec, record=record_all, path=path, rank=rank)
