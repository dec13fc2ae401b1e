"""Training a detector (``visionserve train --arch digitdet --dataset canvases``).

Every step draws a fresh batch of canvases (``models/canvases.py``) from training digits only, so no canvas is
seen twice; after the last epoch the detector is judged on held-out canvases made of held-out digits (mAP at IoU
0.5 and 0.75, ``models/detection_eval.py``) and the checkpoint is written once, with the generator's parameters and
the figures in its training record. CenterNet's losses: a penalty-reduced focal loss on Gaussian-splatted class
heatmaps, L1 on size and offset at object centres. AdamW, a linear warm-up then a cosine decay to zero.

One process, CPU or one GPU; ``--resume`` and several processes are classifier-only for now (refused).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import msgspec
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.canvases import Canvases, CanvasParams, digit_pool, digit_split, make_canvases
from models.checkpoint import DetectionEpoch, DetectionRecord, TrainRecord, apply_weights, load_weights, save_checkpoint
from models.config import TrainConfig
from models.detection_eval import AP_DEFINITION, NMS_IOU, SCORE_THRESHOLD, average_precision, suppress
from models.detector import STRIDE, DigitDet
from models.normalize import Uint8Normalize
from models.records import library_versions
from models.registry import get_architecture
from models.segment_train import MASK_EVALUATOR, MASK_WEIGHT, evaluate_masks, mask_loss, mask_targets
from models.segmenter import DigitSeg
from models.train import TrainResult, resolve_device, spec_for, validate
from service.core.errors import ConfigError
from service.core.spec import ModelSpec

DATASET = "canvases"
STEPS_PER_EPOCH = 50  # an epoch is this many steps of fresh canvases: 14 epochs x 50 steps x 64 = 44,800 canvases
HELDOUT_CANVASES = 1000
WARMUP_SHARE = 0.05
SIZE_WEIGHT = 0.1  # CenterNet's weights: the size L1 is in cells and large beside the other two
MIN_OVERLAP = 0.7  # CenterNet's Gaussian radius: a corner this far off still overlaps the box this much


class DetectProgress(Protocol):
    def start_epoch(self, epoch: int, batches: int) -> None: ...
    def advance(self, loss: float, accuracy: float) -> None: ...
    def note(self, line: str) -> None: ...


@dataclass(frozen=True)
class Targets:
    heatmap: torch.Tensor  # [B, C, h, w]: 1 at each centre cell, a Gaussian around it
    index: torch.Tensor  # [B, M] int64: each object's centre cell, flattened (0 for padding)
    mask: torch.Tensor  # [B, M] bool: a real object
    size: torch.Tensor  # [B, M, 2]: width and height in cells
    offset: torch.Tensor  # [B, M, 2]: the centre's position in its cell, 0 to 1


def _radius(w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """CenterNet's ``gaussian_radius`` (its reference formula, kept as published) for boxes of ``w`` x ``h`` cells."""
    mo = MIN_OVERLAP
    b1, c1 = h + w, w * h * (1 - mo) / (1 + mo)
    r1 = (b1 + torch.sqrt(b1**2 - 4 * c1)) / 2
    b2, c2 = 2 * (h + w), (1 - mo) * w * h
    r2 = (b2 + torch.sqrt(b2**2 - 16 * c2)) / 2
    b3, c3 = -2 * mo * (h + w), (mo - 1) * w * h
    r3 = (b3 + torch.sqrt(b3**2 - 16 * mo * c3)) / 2
    return torch.minimum(torch.minimum(r1, r2), r3).floor().clamp(min=0)


def make_targets(canvases: Canvases, num_classes: int, device: torch.device) -> Targets:
    """The training targets of ``canvases`` at stride 4 (one vectorised pass; a loop over the few object slots)."""
    boxes = torch.from_numpy(canvases.boxes).to(device) / STRIDE
    labels = torch.from_numpy(canvases.labels).to(device)
    mask = labels >= 0
    b, m = labels.shape
    h = w = math.ceil(canvases.images.shape[1] / STRIDE)
    centre = (boxes[..., :2] + boxes[..., 2:]) / 2
    size = boxes[..., 2:] - boxes[..., :2]
    cell = centre.floor().clamp(min=0, max=w - 1)
    sigma = (2 * _radius(size[..., 0], size[..., 1]) + 1) / 6
    grid = torch.arange(w, device=device, dtype=torch.float32)
    gx = torch.exp(-((grid - cell[..., :1]) ** 2) / (2 * sigma[..., None] ** 2))  # [B, M, w]
    gy = torch.exp(-((grid - cell[..., 1:]) ** 2) / (2 * sigma[..., None] ** 2))
    blobs = gy[..., :, None] * gx[..., None, :] * mask[..., None, None]  # [B, M, h, w]
    heat = torch.zeros(b, num_classes + 1, h, w, device=device)  # the extra class takes the padding slots
    rows = torch.arange(b, device=device)
    slot_class = torch.where(mask, labels, num_classes)
    for j in range(m):
        heat[rows, slot_class[:, j]] = torch.maximum(heat[rows, slot_class[:, j]], blobs[:, j])
    index = (cell[..., 1] * w + cell[..., 0]).long() * mask
    return Targets(heat[:, :num_classes], index, mask, size, centre - cell)


def losses(heads: tuple[torch.Tensor, ...], t: Targets) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(focal heatmap loss, size L1, offset L1), each per object, of the detector's heads (a segmenter's first
    three)."""
    logits, size, offset = heads[:3]
    p = torch.sigmoid(logits)
    pos = t.heatmap == 1.0
    pos_term = F.logsigmoid(logits) * (1 - p) ** 2 * pos
    neg_term = F.logsigmoid(-logits) * p**2 * (1 - t.heatmap) ** 4 * ~pos
    objects = t.mask.sum().clamp(min=1)
    focal = -(pos_term.sum() + neg_term.sum()) / pos.sum().clamp(min=1)
    gather = t.index.unsqueeze(1).expand(-1, 2, -1)
    mask = t.mask.unsqueeze(2)
    size_l1 = (F.l1_loss(size.flatten(2).gather(2, gather).transpose(1, 2), t.size, reduction="none") * mask).sum()
    off_l1 = (F.l1_loss(offset.flatten(2).gather(2, gather).transpose(1, 2), t.offset, reduction="none") * mask).sum()
    return focal, size_l1 / objects, off_l1 / objects


def to_input(images: np.ndarray, device: torch.device) -> torch.Tensor:
    """Grey uint8 canvases ``[N, H, W]`` as the three-channel uint8 batch ``[N, 3, H, W]`` a server sends."""
    return torch.from_numpy(images).to(device).unsqueeze(1).expand(-1, 3, -1, -1)


def _schedule(optimizer: torch.optim.Optimizer, total: int) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = max(1, round(total * WARMUP_SHARE))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class _Run:
    config: TrainConfig
    params: CanvasParams
    device: torch.device
    network: DigitDet
    normalize: Uint8Normalize
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    steps_per_epoch: int
    step: int = 0
    generate_s: float = 0.0

    @property
    def segments(self) -> bool:
        return isinstance(self.network, DigitSeg)


def _epoch(run: _Run, epoch: int, progress: DetectProgress) -> DetectionEpoch:
    """``steps_per_epoch`` steps, each on ``batch_size`` new canvases."""
    started, generate = time.perf_counter(), 0.0
    sums = np.zeros(5)
    pool = digit_pool("train")
    run.network.train()
    progress.start_epoch(epoch, run.steps_per_epoch)
    for done in range(1, run.steps_per_epoch + 1):
        t0 = time.perf_counter()
        canvases = make_canvases(run.params, run.config.batch_size, pool=pool, seed=(run.params.seed, run.step),
                                 masks=run.segments)  # fmt: skip
        targets = make_targets(canvases, run.network.num_classes, run.device)
        masks = mask_targets(canvases, run.device) if run.segments else None
        generate += time.perf_counter() - t0
        heads: tuple[torch.Tensor, ...] = run.network.heads(run.normalize(to_input(canvases.images, run.device)))
        focal, size_l1, off_l1 = losses(heads, targets)
        mask = torch.zeros(())
        if masks is not None:
            mask = mask_loss(heads[3], heads[4], targets.index, targets.mask, masks[0], masks[1])
        loss = focal + SIZE_WEIGHT * size_l1 + off_l1 + MASK_WEIGHT * mask
        run.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        run.step += 1
        sums += [float(v.detach()) for v in (loss, focal, size_l1, off_l1, mask)]
        progress.advance(sums[0] / done, 0.0)
    duration = time.perf_counter() - started
    run.generate_s += generate
    mean = (sums / run.steps_per_epoch).tolist()
    return DetectionEpoch(
        epoch=epoch, steps=run.steps_per_epoch, loss=mean[0], heatmap_loss=mean[1], size_loss=mean[2],
        offset_loss=mean[3], mask_loss=mean[4] if run.segments else None, duration_s=duration, generate_s=generate,
        canvases_per_s=run.steps_per_epoch * run.config.batch_size / duration,
    )  # fmt: skip


@torch.inference_mode()
def evaluate(
    network: DigitDet, normalize: nn.Module, canvases: Canvases, device: torch.device, batch: int = 200
) -> tuple[float, tuple[float, ...], float, tuple[float, ...]]:
    """(mAP@0.5, AP@0.5 per class, mAP@0.75, AP@0.75 per class) of ``network`` on ``canvases``."""
    network.eval()
    found = []
    for i in range(0, len(canvases), batch):
        found += suppress(network.candidates(normalize(to_input(canvases.images[i : i + batch], device))))
    truth = [canvases.objects(i) for i in range(len(canvases))]
    at_50 = average_precision(found, truth, num_classes=network.num_classes, iou=0.5)
    at_75 = average_precision(found, truth, num_classes=network.num_classes, iou=0.75)
    return at_50.mean, at_50.per_class, at_75.mean, at_75.per_class


def _check(config: TrainConfig) -> None:
    layout = get_architecture(config.arch).spec.output_layout
    # torchvision's detectors (models/tv_detectors.py): suppressed rows, another loss
    if layout not in ("candidates", "yolo-seg"):
        raise ConfigError(
            f"--arch {config.arch} is a detector this loop does not train (output_layout {layout}): train digitdet "
            "here, or train it elsewhere and export it with --weights W.pt (its torchvision state dict)"
        )
    if config.dataset != DATASET:
        raise ConfigError(
            f"--dataset for a detector must be {DATASET} (generated digit canvases), got {config.dataset!r}"
        )
    if config.resume:
        raise ConfigError("--resume is for classifiers for now: a detector's run is short, start it again")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ConfigError("a detector trains in one process: start it without torchrun")
    validate(config)


def _prepare(config: TrainConfig, spec: ModelSpec, device: torch.device, generator: CanvasParams | None) -> _Run:
    torch.manual_seed(config.seed)
    network = get_architecture(config.arch).build(num_classes=len(spec.labels))
    if not isinstance(network, DigitDet):
        raise ConfigError(f"--arch {config.arch} is not a detector this loop knows how to train")
    if config.weights:
        apply_weights(network, load_weights(config.weights), source=config.weights)
    network.to(device)
    steps = min(STEPS_PER_EPOCH, config.limit_batches or STEPS_PER_EPOCH)
    optimizer = torch.optim.AdamW(network.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    return _Run(
        config=config, params=generator or CanvasParams(canvas_size=spec.input.height, seed=config.seed), device=device,
        network=network, normalize=Uint8Normalize(spec.mean, spec.std).to(device), optimizer=optimizer,
        scheduler=_schedule(optimizer, config.epochs * steps), steps_per_epoch=steps,
    )  # fmt: skip


def train_detector(
    config: TrainConfig, *, progress: DetectProgress, generator: CanvasParams | None = None
) -> TrainResult:
    """Train ``config.arch`` on generated canvases, judge it on held-out ones and write ``config.out``.
    ``generator``: the canvases' parameters (default: :class:`CanvasParams`' own at the input's size and
    ``config.seed``), for training and held-out canvases alike; recorded."""
    _check(config)
    started = time.perf_counter()
    spec = spec_for(config)
    spec = msgspec.structs.replace(spec, name=f"{config.arch}-{DATASET}", resize_size=spec.input.height)
    if generator is not None and generator.canvas_size != spec.input.height:
        raise ConfigError(f"the canvas size ({generator.canvas_size}) must be the input's ({spec.input.height})")
    run = _prepare(config, spec, resolve_device(config.device), generator)
    # Torch's own thread count (every usable core, or OMP_NUM_THREADS), recorded. On a 2-core VM busy with other
    # work (load 3.6) a step took 0.8 s on one thread and 3-4.5 s on two: set OMP_NUM_THREADS=1 there.
    threads = torch.get_num_threads()
    history = []
    for epoch in range(1, config.epochs + 1):
        history.append(_epoch(run, epoch, progress))
        h = history[-1]
        progress.note(
            f"epoch {epoch:>3}/{config.epochs}  loss {h.loss:.4f} (heatmap {h.heatmap_loss:.3f}, size "
            f"{h.size_loss:.3f}, offset {h.offset_loss:.3f}"
            + (f", mask {h.mask_loss:.3f}" if h.mask_loss is not None else "")
            + f")  {h.duration_s:.1f} s, {h.canvases_per_s:.0f} "
            f"canvases/s ({h.generate_s:.1f} s making them)"
        )
    eval_started = time.perf_counter()
    count = min(HELDOUT_CANVASES, (config.limit_batches or HELDOUT_CANVASES) * config.batch_size)
    heldout = make_canvases(run.params, count, pool=digit_pool("heldout"), seed=run.params.heldout_seed,
                            masks=run.segments)  # fmt: skip
    figures = evaluate(run.network, run.normalize, heldout, run.device)
    masks = evaluate_masks(run.network, run.normalize, spec, heldout, run.device) if run.segments else None
    eval_s = time.perf_counter() - eval_started
    record = _record(run, spec, history, figures, masks, count, threads, eval_s, started)
    if config.out:
        save_checkpoint(config.out, state_dict=run.network.state_dict(), spec=spec, record=record)
    return TrainResult(spec=spec, record=record, path=config.out or None)


def _per_class(labels: tuple[str, ...], aps: tuple[float, ...]) -> dict[str, float | None]:
    return {label: None if math.isnan(ap) else float(ap) for label, ap in zip(labels, aps, strict=True)}


def _record(
    run: _Run,
    spec: ModelSpec,
    history: list[DetectionEpoch],
    figures: tuple[float, tuple[float, ...], float, tuple[float, ...]],
    masks: tuple[float, float, float] | None,
    heldout: int,
    threads: int,
    eval_s: float,
    started: float,
) -> TrainRecord:
    config = run.config
    train_digits, heldout_digits = digit_split()
    detection = DetectionRecord(
        generator=run.params, train_digits=len(train_digits), heldout_digits=tuple(heldout_digits.tolist()),
        heldout_canvases=heldout, ap_definition=AP_DEFINITION, score_threshold=SCORE_THRESHOLD, nms_iou=NMS_IOU,
        map_50=float(figures[0]), map_75=float(figures[2]), ap_50=_per_class(spec.labels, figures[1]),
        ap_75=_per_class(spec.labels, figures[3]), steps=run.step, canvases_seen=run.step * config.batch_size,
        max_detections=run.network.max_detections, threads=threads, generate_s=run.generate_s, eval_s=eval_s,
        history=tuple(history), mask_ap=masks[0] if masks else None, mask_ap_50=masks[1] if masks else None,
        mask_ap_75=masks[2] if masks else None, mask_evaluator=MASK_EVALUATOR if masks else None,
    )  # fmt: skip
    return TrainRecord(
        dataset=DATASET, epochs=config.epochs, batch_size=config.batch_size, lr=config.lr, seed=config.seed,
        device=str(run.device), world_size=1, train_size=run.step * config.batch_size, val_size=heldout,
        val_accuracy=None, duration_s=time.perf_counter() - started, history=(),
        versions=library_versions(),
        created_at=datetime.now(UTC).isoformat(timespec="seconds"), detection=detection,
    )  # fmt: skip
