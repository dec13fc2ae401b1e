"""Images as the client takes them (paths, bytes, PIL images, numpy arrays) turned into files to send, and image
files told apart from other files by their first bytes rather than their names."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# Leading bytes of the formats worth sending. The server decodes JPEG, PNG, WebP and BMP; a GIF or TIFF is still
# an image the user meant to classify, so it goes and comes back with the server's own reason.
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"BM", "image/bmp"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
)
SNIFF_BYTES = 16

ImageInput = str | os.PathLike[str] | bytes | bytearray | memoryview | Any  # Any: a PIL image or a numpy array


def sniff(head: bytes) -> str | None:
    """The media type of an image file from its first bytes (at least 12), or None when it is not an image."""
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return next((media for magic, media in _MAGIC if head.startswith(magic)), None)


def is_image_file(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return sniff(f.read(SNIFF_BYTES)) is not None
    except OSError:
        return False


def discover(paths: Iterable[str | Path]) -> tuple[list[Path], int]:
    """(image files, files passed over) below ``paths``.

    Folders are walked recursively in sorted order and only files whose content is an image are kept; a file
    named on its own is always kept (if it is no image, its result says so). Duplicates are dropped.
    """
    found: list[Path] = []
    passed_over = 0
    for path in map(Path, paths):
        if not path.is_dir():
            found.append(path)
            continue
        for file in _walk(path):
            if is_image_file(file):
                found.append(file)
            else:
                passed_over += 1
    return list(dict.fromkeys(found)), passed_over


def _walk(folder: Path) -> Iterator[Path]:
    for root, dirs, files in os.walk(folder):
        dirs.sort()  # os.walk descends in the order left in dirs: sorted, so runs are stable
        for name in sorted(files):
            yield Path(root) / name


def encode(image: ImageInput, index: int) -> tuple[str, bytes, str]:
    """(filename, data, media type) for one image of any accepted kind; ``index`` names unnamed ones.

    Arrays are HxW (grey) or HxWx3 / HxWx4 uint8, as PIL's ``Image.fromarray`` takes them; arrays and PIL images
    are sent as PNG, which keeps every pixel.
    """
    if isinstance(image, str | os.PathLike):
        path = Path(image)
        data = path.read_bytes()
        return path.name, data, sniff(data[:SNIFF_BYTES]) or "application/octet-stream"
    if isinstance(image, bytes | bytearray | memoryview):
        data = bytes(image)
        return f"image-{index}", data, sniff(data[:SNIFF_BYTES]) or "application/octet-stream"
    return f"image-{index}.png", _png(image), "image/png"


def _png(image: Any) -> bytes:
    import io

    from PIL import Image

    if not isinstance(image, Image.Image):
        shape = getattr(image, "shape", None)
        if shape is None:
            raise TypeError(
                f"cannot classify a {type(image).__name__}: pass a path, bytes, a PIL image or a numpy array"
            )
        if getattr(image, "dtype", None) != "uint8" or len(shape) not in (2, 3):
            raise TypeError(f"a numpy image must be uint8 HxW or HxWxC, got {image.dtype} {tuple(shape)}")
        image = Image.fromarray(image)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
