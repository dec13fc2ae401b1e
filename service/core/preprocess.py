"""Image decoding and preprocessing on the CPU: bytes -> uint8 CHW, following a model's spec.

Training (``models/datasets.py``) and serving both call :func:`preprocess_image`, so the transform a model was
trained with is the one it is served with. The resize and crop arithmetic follows torchvision's
``Resize(int)`` + ``CenterCrop`` on PIL images (PIL's antialiased resampling), so torchvision-trained weights see
what they expect.

Every refusal is a :class:`~service.core.errors.BadInputError` for that one image, with a message a person can act on.
"""

from __future__ import annotations

import io
import re
from typing import Final

import msgspec
import numpy as np
from PIL import Image, UnidentifiedImageError

from service.core.errors import BadInputError, ConfigError, PayloadTooLargeError, UnsupportedMediaError
from service.core.spec import ModelSpec

DEFAULT_FORMATS: Final = ("JPEG", "PNG", "WEBP", "BMP")
RESAMPLE: Final = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}
# JPEG draft decoding (DCT scaling) is asked for an image at least this many times the resize target, so that
# the antialiased resize that follows still has the detail a full decode would give it (the same idea as
# PIL's own ``reducing_gap``).
DRAFT_GAP: Final = 2


class ImageLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one image may be. ``max_pixels`` guards against decompression bombs."""

    max_pixels: int = 40_000_000
    formats: tuple[str, ...] = DEFAULT_FORMATS

    def __post_init__(self) -> None:
        ceiling = pil_max_pixels()
        if not 1 <= self.max_pixels <= ceiling:
            raise ConfigError(
                f"max_pixels must be an integer between 1 and {ceiling} (PIL refuses larger images while opening "
                f"them, as decompression bombs), got {self.max_pixels}"
            )


def pil_max_pixels() -> int:
    """The most pixels PIL opens at all: twice its process-wide ``Image.MAX_IMAGE_PIXELS``, past which it raises
    ``DecompressionBombError`` before our own check runs. PIL's limit stays in force, since some of its plugins (GIF,
    animated WebP) allocate a canvas while opening a file; a configured ``max_pixels`` may not exceed it."""
    pil = Image.MAX_IMAGE_PIXELS
    return 2 * pil if pil is not None else 2**63 - 1


DEFAULT_LIMITS: Final = ImageLimits()


def resized_size(width: int, height: int, shorter: int) -> tuple[int, int]:
    """(width, height) after resizing the shorter side to ``shorter`` (torchvision's rounding)."""
    if width <= height:
        return shorter, int(shorter * height / width)
    return int(shorter * width / height), shorter


def crop_box(width: int, height: int, crop_h: int, crop_w: int) -> tuple[int, int, int, int]:
    """The centre-crop box (left, top, right, bottom), rounded as torchvision rounds it."""
    top = round((height - crop_h) / 2.0)
    left = round((width - crop_w) / 2.0)
    return left, top, left + crop_w, top + crop_h


def open_image(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Identify an encoded image and check its format and size, without decoding its pixels."""
    if not data:
        raise BadInputError("empty image: the file has 0 bytes")
    try:
        # PIL only warns (DecompressionBombWarning) between its MAX_IMAGE_PIXELS and twice that: the check below is
        # the one that refuses. (Turning the warning into an error here took the process-wide warnings filters,
        # which the decode threads raced on, and refused images within a larger configured limit.)
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError as exc:
        allowed = ", ".join(limits.formats)
        raise BadInputError(f"not a recognised image: the data is none of {allowed}") from exc
    except Image.DecompressionBombError as exc:  # over pil_max_pixels(), so over any configured limit too
        found = re.search(r"\((\d+) pixels\)", str(exc))
        size = f"{found.group(1)} pixels" if found else "too many pixels"
        raise PayloadTooLargeError(
            f"image has {size}, over the limit of {limits.max_pixels} (refused as a possible decompression bomb)"
        ) from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise BadInputError(f"truncated or corrupt image header: {exc}") from exc
    if img.format not in limits.formats:
        allowed = ", ".join(limits.formats)
        raise UnsupportedMediaError(f"unsupported image format {img.format}: this server takes {allowed}")
    width, height = img.size
    if width < 1 or height < 1:
        raise BadInputError(f"image has no pixels ({width}x{height})")
    if width * height > limits.max_pixels:
        raise PayloadTooLargeError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels} "
            "(refused as a possible decompression bomb)"
        )
    return img


def preprocess_pil(img: Image.Image, spec: ModelSpec) -> np.ndarray:
    """Convert, resize the shorter side, centre-crop: uint8 array of shape (C, H, W)."""
    mode = "L" if spec.input.channels == 1 else "RGB"
    if img.mode != mode:
        img = img.convert(mode)
    new_w, new_h = resized_size(img.width, img.height, spec.resize_size)
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), RESAMPLE[spec.interpolation])
    box = crop_box(new_w, new_h, spec.input.height, spec.input.width)
    if box != (0, 0, new_w, new_h):
        img = img.crop(box)
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        return arr[np.newaxis, :, :].copy()
    return np.ascontiguousarray(arr.transpose(2, 0, 1))


def preprocess_image(data: bytes, spec: ModelSpec, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode encoded image bytes and preprocess them for ``spec``: uint8 array (C, H, W).

    Raises :class:`BadInputError` (or a subclass) for this image alone.
    """
    return decode_opened(open_image(data, limits), spec)


def decode_cost(img: Image.Image, spec: ModelSpec) -> int:
    """About how many pixels decoding ``img`` (opened, not loaded) for ``spec`` will produce: its size, less what
    JPEG draft mode skips (it decodes at 1/2, 1/4 or 1/8 scale when the image is much larger than needed)."""
    w, h = img.size
    if img.format != "JPEG":
        return w * h
    scale = spec.resize_size * DRAFT_GAP / min(w, h)
    reduction = 1
    while reduction < 8 and reduction * 2 * scale <= 1:
        reduction *= 2
    return (w // reduction) * (h // reduction)


def decode_opened(img: Image.Image, spec: ModelSpec) -> np.ndarray:
    """Decode and preprocess an image :func:`open_image` has checked; :class:`BadInputError` for a corrupt one."""
    if img.format == "JPEG":
        # Decode at a reduced scale when the image is much larger than needed: far fewer pixels to decode.
        w, h = img.size
        scale = spec.resize_size * DRAFT_GAP / min(w, h)
        if scale < 1:
            img.draft("RGB" if spec.input.channels == 3 else "L", (int(w * scale) + 1, int(h * scale) + 1))
    try:
        img.load()
    except OSError as exc:
        raise BadInputError(f"truncated or corrupt image data ({img.format}): {exc}") from exc
    except (Image.DecompressionBombError, ValueError, SyntaxError) as exc:
        raise BadInputError(f"corrupt image data ({img.format}): {exc}") from exc
    try:
        return preprocess_pil(img, spec)
    except OSError as exc:
        raise BadInputError(f"truncated or corrupt image data ({img.format}): {exc}") from exc
