"""Datasets that need no network: ``digits``, ``folder:PATH`` and ``synthetic[:N]``.

Every image goes through :func:`service.core.preprocess.preprocess_pil`, the transform the server applies, so a
model is trained on exactly what it will be served. Images are held in memory as uint8 ``[N, C, H, W]``
tensors; normalisation happens inside the model (:class:`models.normalize.Uint8Normalize`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from service.core.errors import BadInputError, DatasetError, UnknownNameError
from service.core.preprocess import ImageLimits, preprocess_image, preprocess_pil
from service.core.spec import ModelSpec

DATASET_KINDS = ("digits", "folder:PATH", "synthetic[:N]")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")
# Training takes a few more formats than the server does by default: they are the user's own files.
_FOLDER_LIMITS = ImageLimits(formats=("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "MPO"))
VAL_FRACTION = 0.2
SPLIT_SEED = 0  # the split never changes with the training seed: validation numbers stay comparable


@dataclass(frozen=True)
class Dataset:
    """A dataset split into train and validation, as uint8 image tensors and int64 targets."""

    name: str
    labels: tuple[str, ...]
    train_images: torch.Tensor
    train_targets: torch.Tensor
    val_images: torch.Tensor
    val_targets: torch.Tensor

    @property
    def num_classes(self) -> int:
        return len(self.labels)


Progress = Callable[[int, int], None]


def load_dataset(name: str, spec: ModelSpec, *, progress: Progress | None = None) -> Dataset:
    """Load dataset ``name`` preprocessed for ``spec`` (input size, resize policy, channels)."""
    if name == "digits":
        return _digits(spec)
    if name.startswith("folder:"):
        return _folder(Path(name.removeprefix("folder:")), spec, progress)
    if name == "synthetic" or name.startswith("synthetic:"):
        count_text = name.partition(":")[2] or "2560"
        try:
            count = int(count_text)
        except ValueError:
            count = 0
        if count < 20:
            raise DatasetError(f"synthetic:N needs an integer N >= 20, got {count_text!r}")
        return _synthetic(spec, count)
    raise UnknownNameError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASET_KINDS)}")


def _split(targets: np.ndarray, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic stratified split: VAL_FRACTION of each class (at least one when it has two or more)."""
    rng = np.random.RandomState(SPLIT_SEED)
    train_idx: list[np.ndarray] = []
    val_idx: list[np.ndarray] = []
    for cls in range(num_classes):
        idx = np.flatnonzero(targets == cls)
        rng.shuffle(idx)
        n_val = max(1, round(len(idx) * VAL_FRACTION)) if len(idx) >= 2 else 0
        val_idx.append(idx[:n_val])
        train_idx.append(idx[n_val:])
    return np.sort(np.concatenate(train_idx)), np.sort(np.concatenate(val_idx))


def _make(name: str, labels: Sequence[str], images: np.ndarray, targets: np.ndarray) -> Dataset:
    train, val = _split(targets, len(labels))
    images_t = torch.from_numpy(images)
    targets_t = torch.from_numpy(targets.astype(np.int64))
    return Dataset(
        name=name,
        labels=tuple(labels),
        train_images=images_t[train],
        train_targets=targets_t[train],
        val_images=images_t[val],
        val_targets=targets_t[val],
    )


def _digits(spec: ModelSpec) -> Dataset:
    """scikit-learn's bundled 1,797 real 8x8 handwritten digits (ink bright on a dark ground)."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    pixels = np.rint(raw.images * (255.0 / 16.0)).astype(np.uint8)
    images = np.stack([preprocess_pil(Image.fromarray(p), spec) for p in pixels])
    return _make("digits", [str(d) for d in range(10)], images, raw.target)


def class_files(root: Path, required: bool) -> dict[str, list[str]]:
    """Each class folder's image files under ``root``, by class name, in path order: a folder that does not exist,
    one with no class folder and (``required``) a class folder with no images are refused."""
    if not root.is_dir():
        raise DatasetError(f"dataset folder {root} does not exist or is not a folder")
    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise DatasetError(f"dataset folder {root} has no class folders: expected one sub-folder per class")
    out: dict[str, list[str]] = {}
    for folder in classes:
        found = sorted(
            str(p)
            for p in folder.rglob("*")
            if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
        )
        if not found and required:
            raise DatasetError(f"class folder {folder} holds no images (looked for {', '.join(IMAGE_EXTENSIONS)})")
        out[folder.name] = found
    return out


def _folder(root: Path, spec: ModelSpec, progress: Progress | None) -> Dataset:
    """An ImageFolder tree: one sub-folder per class, holding that class's images."""
    classes = class_files(root, required=True)
    files = [(Path(p), index) for index, paths in enumerate(classes.values()) for p in paths]
    images = np.empty((len(files), spec.input.channels, spec.input.height, spec.input.width), np.uint8)
    for i, (path, _) in enumerate(files):
        try:
            images[i] = preprocess_image(path.read_bytes(), spec, _FOLDER_LIMITS)
        except BadInputError as exc:
            raise DatasetError(f"unreadable image {path}: {exc}") from exc
        except OSError as exc:
            raise DatasetError(f"cannot read image {path}: {exc.strerror or exc}") from exc
        if progress is not None:
            progress(i + 1, len(files))
    targets = np.array([cls for _, cls in files], dtype=np.int64)
    return _make(f"folder:{root}", list(classes), images, targets)


def _synthetic(spec: ModelSpec, count: int, num_classes: int = 10) -> Dataset:
    """Generated images for speed runs: each class a colour and stripe frequency, with noise. Deterministic."""
    rng = np.random.RandomState(SPLIT_SEED)
    c, h, w = spec.input.channels, spec.input.height, spec.input.width
    targets = np.arange(count) % num_classes
    base = rng.randint(40, 216, size=(num_classes, c, 1, 1))
    ys = np.arange(h).reshape(1, h, 1)
    images = np.empty((count, c, h, w), np.uint8)
    for i, cls in enumerate(targets):
        stripes = 30.0 * np.sin(ys * (cls + 1) * np.pi / h)
        noise = rng.normal(0.0, 12.0, size=(c, h, w))
        images[i] = np.clip(base[cls] + stripes + noise, 0, 255).astype(np.uint8)
    return _make(f"synthetic:{count}", [f"class_{k}" for k in range(num_classes)], images, targets)
