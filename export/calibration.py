"""The images ``--int8`` calibrates on and gates against fp32 with, always two disjoint sets: a dataset's training
split and its validation split (with labels), a detector's generated canvases (held-out ones with their boxes), a
folder's files taken alternately, or, for ungated speed work only, generated photo-like JPEGs. Every image goes
through the model's own preprocessing."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from export.quantize import MAX_CALIBRATION, Int8Data
from export.sources import image_files, preprocessed
from models.canvases import Canvases, CanvasParams, digit_pool, make_canvases
from models.datasets import load_dataset
from models.segment_train import truth_coco
from service.core.errors import ConfigError
from service.core.preprocess import preprocess_image
from service.core.samples import photo_like_jpegs
from service.core.spec import ModelSpec
from service.core.tasks import task_named

MAX_HELD_OUT = 1024
CALIBRATION_SEED = 7_919  # canvases' calibration stream (seed, 0, this): a 3-tuple, apart from training's (seed, step)


def from_dataset(name: str, spec: ModelSpec) -> Int8Data:
    """Calibrate on the training split, gate on the validation split (with its labels): never the same images."""
    data = load_dataset(name, spec)
    calibration = data.train_images[:MAX_CALIBRATION].numpy()
    return Int8Data(
        calibration=calibration,
        calibration_source=f"the first {len(calibration)} training images of {name}",
        held_out=data.val_images[:MAX_HELD_OUT].numpy(),
        held_out_source=f"the validation split of {name}",
        held_out_labels=data.val_targets[:MAX_HELD_OUT].numpy(),
    )


def from_folder(folder: str | Path, spec: ModelSpec) -> Int8Data:
    """The folder's images in path order, taken alternately for calibration and to hold out. Where every image sits
    in a sub-folder named as one of the spec's labels (an ImageFolder tree), a classifier's held-out ones carry
    labels (a detector's or segmenter's are judged against fp32 alone)."""
    root, files = Path(folder), image_files(folder, 2 * MAX_HELD_OUT)
    images = np.stack([preprocessed(p, spec) for p in files])
    parts = [p.relative_to(root).parts for p in files]
    classes = [q[0] if len(q) > 1 else None for q in parts]
    labelled = task_named(spec.task).gate == "top1" and all(c in spec.labels for c in classes)  # class indices
    held = list(range(1, len(files), 2))
    labels = np.array([spec.labels.index(str(classes[i])) for i in held], np.int64) if labelled else None
    calibration = images[0::2][:MAX_CALIBRATION]
    return Int8Data(
        calibration=calibration,
        calibration_source=f"{len(calibration)} images of {root} (every other file)",
        held_out=images[1::2],
        held_out_source=f"the other {len(held)} images of {root}" + (", labelled by folder" if labelled else ""),
        held_out_labels=labels,
    )


def from_samples(spec: ModelSpec, count: int = 96) -> Int8Data:
    """Generated photo-like JPEGs through the model's preprocessing: for ungated speed work only, where no real
    images are at hand (agreement on them proves nothing about real ones)."""
    images = np.stack([preprocess_image(jpeg, spec) for jpeg in photo_like_jpegs(count)])
    split = count * 2 // 3
    return Int8Data(
        calibration=images[:split],
        calibration_source=f"{split} generated photo-like JPEGs (no real images)",
        held_out=images[split:],
        held_out_source=f"{count - split} other generated photo-like JPEGs",
    )


def from_canvases(params: CanvasParams, spec: ModelSpec, held_out: int = 256) -> Int8Data:
    """A detector trained on generated canvases (models/canvases.py): calibrate on canvases of training digits
    (a seed training's steps never draw), gate on the held-out canvases (digits training never saw) with their
    known boxes (a segmenter's: masks, as its training scores them), so the labelled mAP is checked too."""
    if (spec.input.height, spec.input.width) != (params.canvas_size, params.canvas_size):
        raise ConfigError(f"the checkpoint's canvases are {params.canvas_size} px, its input {spec.input}")

    def batch(canvases: Canvases) -> np.ndarray:
        return np.ascontiguousarray(np.repeat(canvases.images[:, None], spec.input.channels, axis=1))

    calibration = make_canvases(
        params, MAX_CALIBRATION, pool=digit_pool("train"), seed=(params.seed, 0, CALIBRATION_SEED)
    )
    masks = task_named(spec.task).gate == "masks"
    truth = "masks" if masks else "boxes"
    held = make_canvases(params, held_out, pool=digit_pool("heldout"), seed=params.heldout_seed, masks=masks)
    return Int8Data(
        calibration=batch(calibration),
        calibration_source=f"{MAX_CALIBRATION} generated canvases of training digits",
        held_out=batch(held),
        held_out_source=f"{held_out} held-out canvases (digits training never saw), their {truth} known",
        held_out_labels=truth_coco(held, spec.labels) if masks else [held.objects(i) for i in range(len(held))],
    )
