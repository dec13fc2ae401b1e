"""Checkpoints: weights, the :class:`ModelSpec` and a training record (JSON text), in one file, read with
``torch.load(weights_only=True)`` (README: a file that is not ours is refused, never unpickled into objects).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch

from models.canvases import CanvasParams
from service.core.errors import CheckpointError, ConfigError
from service.core.spec import ModelSpec, decode_spec, encode_spec

CHECKPOINT_FORMAT = "visionserve-checkpoint/1"


class EpochRecord(msgspec.Struct, frozen=True, kw_only=True):
    epoch: int
    train_loss: float
    train_accuracy: float
    val_accuracy: float | None
    duration_s: float
    # Where an epoch's time went: images/s of the training steps, time blocked waiting for the next batch, and
    # time in the step itself (copy to the device, forward, backward, update). Data wait far above compute means
    # the loader is the bottleneck (more --workers); the other way round, the device is.
    images_per_s: float = 0.0
    data_wait_s: float = 0.0
    compute_s: float = 0.0
    skipped_images: int = 0


class SkippedImage(msgspec.Struct, frozen=True):
    path: str
    reason: str


class Extension(msgspec.Struct, frozen=True, kw_only=True):
    """One ``train --resume --epochs M`` past the epochs the run was planned for: planned ``from_epochs``, it had
    finished ``at_epoch`` of them and went on towards ``to_epochs`` on the schedule rebuilt for those
    (``models/resume.py``)."""

    from_epochs: int
    to_epochs: int
    at_epoch: int


class DetectionEpoch(msgspec.Struct, frozen=True, kw_only=True):
    """One detector epoch (a fixed number of steps, each on freshly generated canvases): its mean losses, and where
    its time went."""

    epoch: int
    steps: int
    loss: float
    heatmap_loss: float  # focal loss on the class heatmaps
    size_loss: float  # L1 of width and height, in stride-4 cells
    offset_loss: float  # L1 of the centre's sub-cell offset
    mask_loss: float | None = None  # a segmenter's: cross-entropy of the masks, inside their boxes
    duration_s: float
    generate_s: float  # of which making canvases and their targets
    canvases_per_s: float


class DetectionRecord(msgspec.Struct, frozen=True, kw_only=True):
    """How a detector was trained and judged: the canvas generator's parameters, the held-out digits, the AP
    definition (``models/detection_eval.py``) and its figures on held-out canvases."""

    generator: CanvasParams
    train_digits: int  # how many of scikit-learn's 1,797 digits the training canvases drew from
    heldout_digits: tuple[int, ...]  # the indices of the others: the only ones on held-out canvases
    heldout_canvases: int
    ap_definition: str
    score_threshold: float  # candidates below it are dropped before suppression
    nms_iou: float  # per-class suppression
    map_50: float  # mean over classes of AP at IoU 0.5
    map_75: float
    ap_50: dict[str, float | None]  # label -> AP at IoU 0.5 (None: no box of that class held out)
    ap_75: dict[str, float | None]
    steps: int
    canvases_seen: int
    max_detections: int  # K, the candidates a canvas the graph answers
    threads: int  # torch's intra-op threads while training
    generate_s: float  # of the run's time, making canvases and targets
    eval_s: float
    history: tuple[DetectionEpoch, ...]
    # A segmenter's masks on the same held-out canvases, by pycocotools' COCOeval (iouType "segm").
    mask_ap: float | None = None  # AP@[.5:.95]
    mask_ap_50: float | None = None
    mask_ap_75: float | None = None
    mask_evaluator: str | None = None


class TrainRecord(msgspec.Struct, frozen=True, kw_only=True):
    """How a checkpoint was trained."""

    dataset: str
    epochs: int
    batch_size: int
    lr: float
    seed: int
    device: str
    world_size: int
    train_size: int
    val_size: int
    val_accuracy: float | None
    duration_s: float
    history: tuple[EpochRecord, ...]
    versions: dict[str, str]
    created_at: str
    loader: str = "memory"  # memory | stream
    workers: int = 0
    augment: bool = False
    skipped_images: int = 0  # distinct unreadable files, left out of training (or validation)
    skipped: tuple[SkippedImage, ...] = ()  # the first of them, by name, with the reason
    best_epoch: int | None = None
    best_val_accuracy: float | None = None
    resumed_from_epoch: int | None = None
    extensions: tuple[Extension, ...] = ()  # each extension of the run, in order; () for a run never extended
    # What the run's own figures say is wrong with it, in words (validation far below training in its last epochs).
    warnings: tuple[str, ...] = ()
    detection: DetectionRecord | None = None  # detectors only; their val_accuracy is None and history empty


@dataclass(frozen=True)
class Checkpoint:
    state_dict: dict[str, torch.Tensor]
    spec: ModelSpec
    record: TrainRecord | None
    sha256: str


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(
    path: str | Path,
    *,
    state_dict: dict[str, torch.Tensor],
    spec: ModelSpec,
    record: TrainRecord | None,
    resume: dict[str, Any] | None = None,
) -> None:
    """Write atomically (a temporary file, synced, then a rename), so a crash never leaves half a checkpoint.

    ``resume`` (optimizer, scheduler, scaler, random states, epoch: tensors, numbers and strings only) makes the
    file resumable with ``train --resume``; readers that only want the model ignore it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": CHECKPOINT_FORMAT,
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
        "spec": encode_spec(spec).decode(),
        "record": msgspec.json.encode(record).decode() if record is not None else "",
    }
    if resume is not None:
        payload["resume"] = resume
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_resume_state(path: str | Path) -> tuple[Checkpoint, dict[str, Any]]:
    """A checkpoint written during training, with its resume state; one without it is refused."""
    path = Path(path)
    ckpt = load_checkpoint(path)
    payload = _safe_load(path)
    resume = payload.get("resume")
    if not isinstance(resume, dict) or ckpt.record is None:
        raise CheckpointError(f"{path} cannot be resumed: it holds no training state (it was not written by train)")
    return ckpt, resume


def _safe_load(path: Path) -> Any:
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "Unsupported global" in str(exc) or "GLOBAL" in str(exc):
            raise CheckpointError(
                f"{path} is not a visionserve checkpoint: it holds Python objects other than tensors, "
                "which are refused rather than unpickled"
            ) from exc
        raise CheckpointError(f"{path} is corrupt or not a PyTorch file (it cannot be unpickled)") from exc
    except (RuntimeError, EOFError, ValueError, OSError, AttributeError, KeyError) as exc:
        reason = str(exc).split(". ")[0]
        raise CheckpointError(f"{path} is corrupt or not a PyTorch file: {reason}") from exc


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a visionserve checkpoint; anything else raises :class:`CheckpointError`."""
    path = Path(path)
    payload = _safe_load(path)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        hint = ""
        if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
            hint = " (it looks like a bare state dict: pass it with --weights and --arch instead)"
        raise CheckpointError(f"{path} is not a visionserve checkpoint{hint}")
    try:
        spec = decode_spec(payload["spec"], source=f"{path} [spec]")
        record = msgspec.json.decode(payload["record"], type=TrainRecord) if payload.get("record") else None
        state_dict = payload["state_dict"]
    except (KeyError, msgspec.DecodeError, ConfigError) as exc:
        raise CheckpointError(f"{path} is a damaged visionserve checkpoint: {exc}") from exc
    return Checkpoint(state_dict=state_dict, spec=spec, record=record, sha256=file_sha256(path))


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A state dict from a bare ``torch.save(model.state_dict())`` file or from a visionserve checkpoint."""
    path = Path(path)
    payload = _safe_load(path)
    if isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT:
        return dict(payload["state_dict"])
    if isinstance(payload, dict) and payload and all(isinstance(v, torch.Tensor) for v in payload.values()):
        return dict(payload)
    raise CheckpointError(f"{path} holds no state dict (expected a dict of tensors)")


def apply_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, source: str) -> None:
    """Load ``state_dict`` strictly; a mismatch names the first missing and unexpected keys."""
    try:
        result = model.load_state_dict(state_dict, strict=False)
    except RuntimeError as exc:  # shape mismatches raise even when strict=False
        first = str(exc).strip().splitlines()[1:2] or [str(exc)]
        raise CheckpointError(f"weights in {source} do not fit the architecture: {first[0].strip()}") from exc
    problems = []
    if result.missing_keys:
        problems.append(f"missing {len(result.missing_keys)} keys (first: {result.missing_keys[0]})")
    if result.unexpected_keys:
        problems.append(f"unexpected {len(result.unexpected_keys)} keys (first: {result.unexpected_keys[0]})")
    if problems:
        raise CheckpointError(f"weights in {source} do not fit the architecture: {'; '.join(problems)}")
