"""Training on an image folder: ``folder:PATH``, streamed through DataLoader workers or held in memory.

The layouts, streaming, augmentation and skipping rules are README's ("Training on your own images"). Validation
images get exactly the served transform (:func:`service.core.preprocess.decode_opened`, the very function serving
calls); small folders trained without workers are decoded once into memory instead (:func:`choose_mode`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from models.augment import Augmentation, augment_pil
from models.datasets import _FOLDER_LIMITS, class_files
from models.datasets import _split as stratified_split
from models.feeds import Batch, MemoryFeed, even_batches
from service.core.errors import DatasetError
from service.core.preprocess import decode_opened, open_image
from service.core.spec import ModelSpec

VAL_FOLDERS = ("val", "validation", "valid")
MODES = ("auto", "memory", "stream")
# `auto` may hold a folder in memory when its decoded images take at most this much RAM, affordable anywhere.
MEMORY_MODE_MAX_BYTES = 64 * 2**20
MAX_LISTED_SKIPS = 1000  # the record names at most this many unreadable files (and counts them all)
Progress = Callable[[int, int], None]


def default_workers() -> int:
    """DataLoader workers by default: one core is left to the training loop itself, at most 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores - 1))


@dataclass(frozen=True)
class Split:
    paths: list[str]
    targets: np.ndarray  # int64

    @classmethod
    def of(cls, files: dict[str, list[str]], labels: tuple[str, ...]) -> Split:
        """Each label's files, in label order, targeted with the label's index."""
        paths = [p for name in labels for p in files.get(name, [])]
        return cls(paths, np.array([i for i, n in enumerate(labels) for _ in files.get(n, [])], dtype=np.int64))

    def take(self, index: Any) -> Split:
        return Split([self.paths[i] for i in index], self.targets[index])


@dataclass(frozen=True)
class FolderIndex:
    root: Path
    labels: tuple[str, ...]
    train: Split
    val: Split
    layout: str  # "train/val folders" or "stratified split"


def scan_folder(root: str | Path) -> FolderIndex:
    """List a folder's images and split them; an empty class or a stray validation class is refused here."""
    root = Path(root)
    val_dir = next((root / n for n in VAL_FOLDERS if (root / n).is_dir()), None)
    if (root / "train").is_dir() and val_dir is not None:
        train = class_files(root / "train", required=True)
        val = class_files(val_dir, required=False)
        stray = sorted(set(val) - set(train))
        if stray:
            raise DatasetError(f"{val_dir} has classes that {root / 'train'} lacks: {', '.join(stray)}")
        labels = tuple(train)
        return FolderIndex(root, labels, Split.of(train, labels), Split.of(val, labels), "train/val folders")
    files = class_files(root, required=True)
    labels = tuple(files)
    whole = Split.of(files, labels)
    train_idx, val_idx = stratified_split(whole.targets, len(labels))
    return FolderIndex(root, labels, whole.take(train_idx), whole.take(val_idx), "stratified split")


class FolderImages(Dataset[tuple[torch.Tensor | None, int, str, str]]):
    """Decodes one file per item, lazily; a key is ``(index, epoch)`` so that augmentation is reproducible."""

    def __init__(self, split: Split, spec: ModelSpec, augmentation: Augmentation | None, seed: int) -> None:
        self.paths, self.targets = split.paths, split.targets
        self.spec, self.augmentation, self.seed = spec, augmentation, seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor | None, int, str, str]:
        index, epoch = key
        path, target = self.paths[index], int(self.targets[index])
        try:
            with open(path, "rb") as fh:
                img = open_image(fh.read(), _FOLDER_LIMITS)
            if self.augmentation is None:
                array = decode_opened(img, self.spec)  # exactly what the server does with these bytes
            else:
                array = augment_pil(img, self.spec, self.augmentation, (self.seed, epoch, index))
        # One unreadable file must not end an epoch: whatever PIL raises for it (OSError, SyntaxError,
        # DecompressionBombError, ValueError...) is reported for that file alone.
        except Exception as exc:
            return None, target, path, str(exc) or type(exc).__name__
        return torch.from_numpy(array), target, path, ""


def collate(items: Sequence[tuple[torch.Tensor | None, int, str, str]]) -> Batch:
    good = [(image, target) for image, target, _, _ in items if image is not None]
    skipped = [(path, reason) for image, _, path, reason in items if image is None]
    if not good:
        return Batch(torch.empty((0,), dtype=torch.uint8), torch.empty((0,), dtype=torch.int64), skipped)
    return Batch(
        torch.stack([image for image, _ in good]), torch.tensor([t for _, t in good], dtype=torch.int64), skipped
    )


class EpochSampler(Sampler[tuple[int, int]]):
    """:class:`DistributedSampler` (this rank's share of a per-epoch permutation), keyed with the epoch."""

    def __init__(self, dataset: FolderImages, *, seed: int, rank: int, world: int, shuffle: bool = True) -> None:
        self.inner: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed
        )
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.inner.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return ((i, self.epoch) for i in self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class EvenBatches(Sampler[list[tuple[int, int]]]):
    """The keys of ``sampler`` in batches of nearly equal size (:func:`models.feeds.even_batches`): the training
    loader never ends an epoch on a remainder of one or two images."""

    def __init__(self, sampler: EpochSampler, batch_size: int) -> None:
        self.sampler, self.batch_size = sampler, batch_size

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        keys = list(self.sampler)
        return (keys[start:stop] for start, stop in even_batches(len(keys), self.batch_size))

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)


def _loader(
    dataset: FolderImages, sampler: EpochSampler, batch_size: int, workers: int, pin: bool, persistent: bool
) -> DataLoader[Batch]:
    return DataLoader(
        dataset,  # type: ignore[arg-type]
        batch_sampler=EvenBatches(sampler, batch_size),
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin,
        persistent_workers=persistent and workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


class StreamFeed:
    """Batches decoded in ``workers`` DataLoader processes (0: in the training process itself)."""

    mode = "stream"

    def __init__(
        self,
        index: FolderIndex,
        spec: ModelSpec,
        *,
        batch_size: int,
        seed: int,
        workers: int,
        rank: int = 0,
        world: int = 1,
        augmentation: Augmentation | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.name, self.labels = f"folder:{index.root}", index.labels
        self.train_size, self.val_size = len(index.train.paths), len(index.val.paths)
        self.train_paths, self.val_paths = frozenset(index.train.paths), frozenset(index.val.paths)
        self.workers, self.batch_size, self.world = workers, batch_size, world
        train = FolderImages(index.train, spec, augmentation, seed)
        val = FolderImages(index.val, spec, None, seed)
        self.sampler = EpochSampler(train, seed=seed, rank=rank, world=world)
        self.train_loader = _loader(train, self.sampler, batch_size, workers, pin_memory, persistent=True)
        val_sampler = EpochSampler(val, seed=seed, rank=0, world=1, shuffle=False)
        self.val_loader = _loader(val, val_sampler, 128, workers, pin_memory, persistent=False)

    def steps_per_epoch(self) -> int:
        return len(self.train_loader)

    def readable_sizes(self, skipped: dict[str, str]) -> tuple[int, int]:
        """(train, val) images less the files found unreadable so far in each split (streamed files are only
        found unreadable when read: an unreadable file was counted as a training or validation image)."""
        bad = skipped.keys()
        return self.train_size - len(self.train_paths & bad), self.val_size - len(self.val_paths & bad)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def train_batches(self) -> Iterator[Batch]:
        return iter(self.train_loader)

    def val_batches(self) -> Iterator[Batch]:
        return iter(self.val_loader) if self.val_size else iter(())

    def close(self) -> None:
        # Persistent workers end with their iterator; dropping the loader lets them go now, not at exit.
        self.train_loader = self.val_loader = None  # type: ignore[assignment]


def choose_mode(requested: str, index: FolderIndex, spec: ModelSpec, workers: int) -> str:
    """``memory`` or ``stream``. ``auto`` holds a folder in memory only when it is small (``MEMORY_MODE_MAX_BYTES``)
    and no workers would decode it alongside the training loop: with a worker, streaming overlaps decoding with
    compute and was the faster of the two even on 300 images (docs/performance.md); without one, every epoch
    after the first would decode again in the loop itself."""
    if requested not in MODES:
        raise DatasetError(f"--loader must be one of {', '.join(MODES)}, got {requested!r}")
    if requested != "auto":
        return requested
    size = (len(index.train.paths) + len(index.val.paths)) * spec.input.channels * spec.input.height * spec.input.width
    return "memory" if workers == 0 and size <= MEMORY_MODE_MAX_BYTES else "stream"


def decode_all(
    split: Split, spec: ModelSpec, workers: int, progress: Progress | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[str, str]]]:
    """Every image of ``split`` through the served transform, decoded by ``workers`` processes; unreadable ones
    are left out and returned as (path, reason)."""
    dataset = FolderImages(split, spec, None, 0)
    shape = (spec.input.channels, spec.input.height, spec.input.width)
    images = torch.empty((len(split.paths), *shape), dtype=torch.uint8)
    targets = torch.empty((len(split.paths),), dtype=torch.int64)
    skipped: list[tuple[str, str]] = []
    sampler = EpochSampler(dataset, seed=0, rank=0, world=1, shuffle=False)
    filled = done = 0
    for batch in _loader(dataset, sampler, 64, workers, pin=False, persistent=False):
        images[filled : filled + len(batch.images)] = batch.images
        targets[filled : filled + len(batch.images)] = batch.targets
        filled += len(batch.images)
        skipped += batch.skipped
        done += len(batch.images) + len(batch.skipped)
        if progress is not None:
            progress(done, len(split.paths))
    return images[:filled].clone(), targets[:filled].clone(), skipped


def memory_feed(
    index: FolderIndex, spec: ModelSpec, *, workers: int, **options: Any
) -> tuple[MemoryFeed, list[tuple[str, str]]]:
    """The folder decoded once (by ``workers`` processes) into a :class:`MemoryFeed` (``options``: its batch size,
    seed, rank, world and augmentation), and the files it skipped."""
    train, val = decode_all(index.train, spec, workers), decode_all(index.val, spec, workers)
    feed = MemoryFeed(
        name=f"folder:{index.root}", labels=index.labels, train=train[:2], val=val[:2], spec=spec, **options
    )
    return feed, train[2] + val[2]


def validation_sample(root: str | Path, spec: ModelSpec, limit: int = 512) -> np.ndarray | None:
    """Up to ``limit`` validation images (spread over the split) through the served transform, for export's
    parity check: never the whole folder, which may hold far more."""
    index = scan_folder(root)
    split = index.val if index.val.paths else index.train
    if not split.paths:
        return None
    chosen = np.unique(np.linspace(0, len(split.paths) - 1, min(limit, len(split.paths))).round().astype(int))
    images, _, _ = decode_all(split.take(chosen), spec, workers=0)
    return images.numpy() if len(images) else None
