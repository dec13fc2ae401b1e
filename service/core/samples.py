"""Sample images for benchmarks and load tests: generated ones (no dataset is downloaded, and every run sees the
same pictures), or the files of a folder the user names."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp")  # the formats the image API takes


def image_files(folder: str | Path, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> list[bytes]:
    """The bytes of every file below ``folder`` with one of ``suffixes``, in path order; ValueError if none."""
    files = sorted(p for p in Path(folder).rglob("*") if p.suffix.lower() in suffixes)
    if not files:
        raise ValueError(f"{folder} holds no images (looked for {', '.join(suffixes)})")
    return [p.read_bytes() for p in files]


def photo_like_jpegs(count: int = 64, size: tuple[int, int] = (500, 375), seed: int = 0) -> list[bytes]:
    """JPEGs the size of a typical ImageNet photo: smooth fields, solid shapes with edges, and noise (quality 90)."""
    rng = np.random.default_rng(seed)
    width, height = size
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for _ in range(count):
        img = np.zeros((height, width, 3), np.float32)
        for c in range(3):
            fx, fy, phase = rng.uniform(0.005, 0.05), rng.uniform(0.005, 0.05), rng.uniform(0, 6.3)
            img[..., c] = 128 + 90 * np.sin(xx * fx + phase) * np.cos(yy * fy)
        for _ in range(6):
            # The same draws as ever for photo sizes; small images (thumbnails, tiny models' inputs) still work.
            x0, y0 = rng.integers(0, max(1, width - 60)), rng.integers(0, max(1, height - 60))
            img[y0 : y0 + rng.integers(20, 120), x0 : x0 + rng.integers(20, 160)] = rng.uniform(0, 255, 3)
        img += rng.normal(0, 8, img.shape)
        buf = io.BytesIO()
        Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out
