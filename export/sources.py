"""Where an export starts: a visionserve checkpoint, a zoo architecture, and the real images for parity (a
classifier's validation split; a detector's held-out canvases)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch import nn

from models.canvases import CanvasParams, digit_pool, make_canvases
from models.checkpoint import apply_weights, file_sha256, load_checkpoint, load_weights
from models.datasets import IMAGE_EXTENSIONS, load_dataset
from models.folder import validation_sample
from models.normalize import Uint8Classifier
from models.registry import get_architecture, with_input_size
from models.tv_detectors import TorchvisionDetector, Uint8Detector
from service.core.errors import BadInputError, ConfigError, DatasetError
from service.core.preprocess import preprocess_image
from service.core.spec import ModelSpec

MAX_REAL_IMAGES = 512


@dataclass(frozen=True)
class Source:
    eager: nn.Module
    spec: ModelSpec
    sha256: str | None
    real_images: np.ndarray | None
    real_source: str


def from_checkpoint(path: str | Path) -> Source:
    """A trained checkpoint; its validation split (when the dataset is at hand) gives the real images."""
    ckpt = load_checkpoint(path)
    arch = get_architecture(ckpt.spec.architecture)
    network = arch.build(num_classes=ckpt.spec.num_classes)
    apply_weights(network, ckpt.state_dict, source=str(path))
    eager = Uint8Classifier(network, ckpt.spec.mean, ckpt.spec.std).eval()
    images: np.ndarray | None = None
    source = "random uint8 batches only (the training dataset is not at hand)"
    if ckpt.record is not None and ckpt.record.detection is not None:
        images = heldout_canvases(ckpt.record.detection.generator, ckpt.spec)
        if images is not None:
            source = f"{len(images)} held-out canvases (digits training never saw) and random uint8 batches"
    elif ckpt.record is not None:
        try:
            if ckpt.record.dataset.startswith("folder:"):
                # A sample, not the whole folder: it may hold far more images than parity needs.
                images = validation_sample(ckpt.record.dataset.removeprefix("folder:"), ckpt.spec, MAX_REAL_IMAGES)
            else:
                images = load_dataset(ckpt.record.dataset, ckpt.spec).val_images[:MAX_REAL_IMAGES].numpy()
        except (DatasetError, ConfigError):
            images = None
        if images is not None:
            source = f"{len(images)} validation images of {ckpt.record.dataset} and random uint8 batches"
    return Source(eager, ckpt.spec, ckpt.sha256, images, source)


def heldout_canvases(params: CanvasParams, spec: ModelSpec, count: int = MAX_REAL_IMAGES) -> np.ndarray | None:
    """A detector's held-out canvases (``models/canvases.py``: the training's generator, its held-out seed and the
    digits training never saw) as the uint8 batch it is served; None when the canvas is not the input's size."""
    if (spec.input.height, spec.input.width) != (params.canvas_size, params.canvas_size):
        return None
    grey = make_canvases(params, count, pool=digit_pool("heldout"), seed=params.heldout_seed).images
    return np.ascontiguousarray(np.repeat(grey[:, None], spec.input.channels, axis=1))


def from_architecture(name: str, *, weights: str | None = None, input_size: int | None = None) -> Source:
    """A zoo architecture with its initial weights (seeded, so repeatable) or ``weights``."""
    import torch

    arch = get_architecture(name)
    spec = arch.spec
    if input_size is not None:
        spec = with_input_size(spec, input_size)
    torch.manual_seed(0)
    network = arch.build(num_classes=spec.num_classes)
    sha = None
    if weights:
        # torchvision's own state dict for its detectors (their keys), a visionserve one for the rest
        target = network.detector if isinstance(network, TorchvisionDetector) else network
        apply_weights(target, load_weights(weights), source=weights)
        sha = file_sha256(weights)
    if isinstance(network, TorchvisionDetector):
        # Resize inside the model to the spec's input (one resize, by the server's ``stretch``); the front names
        # the formats torchvision's postprocessing cannot be exported to.
        network.fit_input(spec.input.height, spec.input.width)
        network.script()
        return Source(Uint8Detector(network, spec.mean, spec.std).eval(), spec, sha, None, "random uint8 batches only")
    eager = Uint8Classifier(network, spec.mean, spec.std).eval()
    return Source(eager, spec, sha, None, "random uint8 batches only")


def calibration_images(folder: str | Path, spec: ModelSpec, limit: int = MAX_REAL_IMAGES) -> np.ndarray:
    """The user's images (any depth under ``folder``), preprocessed for ``spec``."""
    return np.stack([preprocessed(path, spec) for path in image_files(folder, limit)])


def image_files(folder: str | Path, limit: int) -> list[Path]:
    """Up to ``limit`` of ``--calibration-images``' files (any depth), in path order; a folder of none is refused."""
    root = Path(folder)
    if not root.is_dir():
        raise ConfigError(f"--calibration-images {root} is not a folder")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)[:limit]
    if not files:
        raise ConfigError(f"--calibration-images {root} holds no images ({', '.join(IMAGE_EXTENSIONS)})")
    return files


def preprocessed(path: Path, spec: ModelSpec) -> np.ndarray:
    """One of the user's images through ``spec``'s preprocessing; an unusable one is refused."""
    try:
        return preprocess_image(path.read_bytes(), spec)
    except BadInputError as exc:
        raise ConfigError(f"calibration image {path} is unusable: {exc}") from exc
