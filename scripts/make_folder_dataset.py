"""Generate an image folder of class-dependent synthetic JPEGs, for training benchmarks and demos.

Each class has its own shape (circle, square, triangle, cross, ring, bar...) and its own colour family, drawn at a
random place, size and rotation on a noisy random background, so a model has something learnable and a
random crop still keeps part of the object. Deterministic for a given --seed.

    python scripts/make_folder_dataset.py --out /tmp/shapes --images 5000 --classes 10
    python scripts/make_folder_dataset.py --out /tmp/shapes2 --classes 5 --class-offset 10 --split
"""

from __future__ import annotations

import argparse
import colorsys
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SHAPES = ("circle", "square", "triangle", "cross", "ring", "hbar", "vbar", "diamond", "star", "dots")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder to create, one sub-folder per class (required, no default)")
    p.add_argument("--images", type=int, default=5000, help="images in all (default: 5000)")
    p.add_argument("--classes", type=int, default=10, help="number of classes (default: 10)")
    p.add_argument(
        "--class-offset",
        type=int,
        default=0,
        help="first class number: a folder with other classes than another one made with offset 0 (default: 0)",
    )
    p.add_argument("--width", type=int, default=500, help="image width in pixels (default: 500)")
    p.add_argument("--height", type=int, default=375, help="image height in pixels (default: 375)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default: 90)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--split", action="store_true", help="write train/ and val/ (a fifth) (default: one level)")
    return p


def _colour(cls: int, rng: np.random.Generator) -> tuple[int, int, int]:
    hue = (cls * 0.381966 + rng.normal(0, 0.02)) % 1.0  # golden-ratio steps: neighbouring classes differ
    r, g, b = colorsys.hsv_to_rgb(hue, 0.75 + rng.uniform(-0.1, 0.1), 0.85 + rng.uniform(-0.1, 0.1))
    return int(r * 255), int(g * 255), int(b * 255)


def _polygon(cx: float, cy: float, r: float, sides: int, turn: float) -> list[tuple[float, float]]:
    angles = (turn + 2 * math.pi * k / sides for k in range(sides))
    return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in angles]


def draw_image(cls: int, width: int, height: int, rng: np.random.Generator) -> Image.Image:
    """One image of class ``cls``: its shape in its colour on a noisy background."""
    ground = rng.integers(60, 200, size=3)
    noise = rng.normal(0, 18, size=(height // 4, width // 4, 3))
    base = np.clip(ground + noise, 0, 255).astype(np.uint8)
    img = Image.fromarray(base).resize((width, height), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(img)
    colour = _colour(cls, rng)
    r = min(width, height) * rng.uniform(0.18, 0.32)
    cx, cy = rng.uniform(r, width - r), rng.uniform(r, height - r)
    turn = rng.uniform(0, 2 * math.pi)
    shape = SHAPES[cls % len(SHAPES)]
    box = (cx - r, cy - r, cx + r, cy + r)
    polygons = {"square": (4, turn), "diamond": (4, math.pi / 4), "triangle": (3, turn)}  # (sides, turn)
    if shape in polygons:
        draw.polygon(_polygon(cx, cy, r, *polygons[shape]), fill=colour)
    elif shape == "circle":
        draw.ellipse(box, fill=colour)
    elif shape == "ring":
        draw.ellipse(box, outline=colour, width=max(3, int(r / 3)))
    elif shape == "star":
        points = [_polygon(cx, cy, r if k % 2 == 0 else r * 0.45, 10, turn)[k] for k in range(10)]
        draw.polygon(points, fill=colour)
    elif shape == "cross":
        w = r / 3
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
    elif shape == "hbar":
        draw.rectangle((0, cy - r / 3, width, cy + r / 3), fill=colour)
    elif shape == "vbar":
        draw.rectangle((cx - r / 3, 0, cx + r / 3, height), fill=colour)
    else:  # dots
        for _ in range(6):
            x, y = rng.uniform(0, width), rng.uniform(0, height)
            draw.ellipse((x - r / 3, y - r / 3, x + r / 3, y + r / 3), fill=colour)
    return img.filter(ImageFilter.GaussianBlur(radius=0.8))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.images < args.classes or args.classes < 1:
        print("--images must be at least --classes, and --classes at least 1", file=sys.stderr)
        return 2
    out = Path(args.out)
    rng = np.random.default_rng(args.seed)
    for i in range(args.images):
        cls = args.class_offset + i % args.classes
        name = f"class_{cls:02d}_{SHAPES[cls % len(SHAPES)]}"
        part = ("val" if (i // args.classes) % 5 == 4 else "train") if args.split else ""
        folder = out / part / name
        folder.mkdir(parents=True, exist_ok=True)
        draw_image(cls, args.width, args.height, rng).save(folder / f"{i:06d}.jpg", quality=args.quality)
    print(f"wrote {args.images} images of {args.width}x{args.height} in {args.classes} classes to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
