"""The training augmentation for image folders: random resized crop and horizontal flip.

It is torchvision's reference recipe for ImageNet classifiers (``RandomResizedCrop`` with scale (0.08, 1) and
ratio (3/4, 4/3), then ``RandomHorizontalFlip``), with the interpolation of the model's spec. The draw for one
image depends only on (seed, epoch, image index), never on a process-wide generator: so the same run gives the
same crops with 0 or 8 DataLoader workers, and a resumed run draws what an uninterrupted one would have.

Validation and serving never augment: they use :func:`service.core.preprocess.decode_opened`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from service.core.preprocess import DRAFT_GAP, RESAMPLE
from service.core.spec import ModelSpec


@dataclass(frozen=True)
class Augmentation:
    """What a training image goes through before the model sees it."""

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = True


STANDARD = Augmentation()
# The compact network is meant for small, centred inputs (digits, icons): a crop down to 8% of such an image
# often leaves nothing of the object, so it keeps at least a quarter.
_PER_ARCHITECTURE = {"smallcnn": Augmentation(scale=(0.25, 1.0))}


def augmentation_for(architecture: str) -> Augmentation:
    return _PER_ARCHITECTURE.get(architecture, STANDARD)


@dataclass(frozen=True)
class Draw:
    """One image's random choices: the crop box (in pixels of the image it applies to) and the flip."""

    left: int
    top: int
    width: int
    height: int
    flip: bool


def draw(aug: Augmentation, width: int, height: int, seed: int, epoch: int, index: int) -> Draw:
    """torchvision's ``RandomResizedCrop.get_params`` (ten tries, then the centre crop), from a private stream."""
    rng = np.random.default_rng([seed, epoch, index])
    area = width * height
    log_ratio = (math.log(aug.ratio[0]), math.log(aug.ratio[1]))
    flip = bool(aug.flip and rng.random() < 0.5)
    for _ in range(10):
        target_area = area * rng.uniform(aug.scale[0], aug.scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return Draw(left, top, w, h, flip)
    in_ratio = width / height
    if in_ratio < aug.ratio[0]:
        w, h = width, round(width / aug.ratio[0])
    elif in_ratio > aug.ratio[1]:
        w, h = round(height * aug.ratio[1]), height
    else:
        w, h = width, height
    return Draw((width - w) // 2, (height - h) // 2, w, h, flip)


def augment_pil(img: Image.Image, spec: ModelSpec, aug: Augmentation, key: tuple[int, int, int]) -> np.ndarray:
    """An opened (not yet decoded) image to a uint8 (C, H, W) training crop for ``spec``."""
    mode = "L" if spec.input.channels == 1 else "RGB"
    if img.format == "JPEG":
        # The same reduced-scale decode as serving: the crop is then resized from at least twice the served
        # resolution, and decoding costs a quarter of the pixels for a 500x375 photo at 64x64.
        w, h = img.size
        scale = spec.resize_size * DRAFT_GAP / min(w, h)
        if scale < 1:
            img.draft(mode, (int(w * scale) + 1, int(h * scale) + 1))
    img.load()
    if img.mode != mode:
        img = img.convert(mode)
    d = draw(aug, img.width, img.height, *key)
    box = (d.left, d.top, d.left + d.width, d.top + d.height)
    out = img.resize((spec.input.width, spec.input.height), RESAMPLE[spec.interpolation], box=box)
    if d.flip:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    arr = np.asarray(out, dtype=np.uint8)
    if arr.ndim == 2:
        return arr[np.newaxis, :, :].copy()
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def augment_tensor(
    images: torch.Tensor, indices: torch.Tensor, spec: ModelSpec, aug: Augmentation, seed: int, epoch: int
) -> torch.Tensor:
    """The same augmentation on a batch of stored uint8 crops (the in-memory path: no original to crop from)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as F

    mode = InterpolationMode(spec.interpolation)
    size = [spec.input.height, spec.input.width]
    out = torch.empty((len(images), *images.shape[1:]), dtype=torch.uint8)
    height, width = images.shape[-2:]
    for row, (image, index) in enumerate(zip(images, indices.tolist(), strict=True)):
        d = draw(aug, width, height, seed, epoch, index)
        crop = F.resized_crop(image, d.top, d.left, d.height, d.width, size, interpolation=mode, antialias=True)
        out[row] = F.horizontal_flip(crop) if d.flip else crop
    return out
