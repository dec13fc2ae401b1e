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

from service.core.boxes import Transform, letterbox_geometry
from service.core.errors import BadInputError, ConfigError, PayloadTooLargeError, UnsupportedMediaError
from service.core.spec import ModelSpec

DEFAULT_FORMATS: Final = ("JPEG", "PNG", "WEBP", "BMP")
RESAMPLE: Final = {name: Image.Resampling[name.upper()] for name in ("bilinear", "bicubic", "nearest")}
# JPEG draft decoding (DCT scaling) is asked for an image at least this many times the resize target, so that
# the antialiased resize that follows still has the detail a full decode would give it (the same idea as
# PIL's own ``reducing_gap``).
DRAFT_GAP: Final = 2
ORIENTATION_TAG: Final = 0x0112
# EXIF orientation -> the transpose that shows the image as its camera saw it (as PIL's ImageOps.exif_transpose).
ORIENTATIONS: Final = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


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
    """Convert and resize as ``spec.resize`` says (by default: resize the shorter side, centre-crop): uint8 array of
    shape (C, H, W)."""
    return prepare(img, spec)[0]


def placement(spec: ModelSpec, width: int, height: int) -> tuple[int, int, int, int]:
    """(new_w, new_h, x, y): the size ``spec``'s resize gives a ``width`` x ``height`` image and where its corner lands
    in the input (a letterbox's padding; minus a centre crop's corner; 0 for a stretch)."""
    in_w, in_h = spec.input.width, spec.input.height
    if spec.resize == "letterbox":
        return letterbox_geometry(width, height, in_w, in_h)
    if spec.resize == "stretch":
        return in_w, in_h, 0, 0
    new_w, new_h = resized_size(width, height, spec.resize_size)
    left, top, _, _ = crop_box(new_w, new_h, in_h, in_w)
    return new_w, new_h, -left, -top


def prepare(img: Image.Image, spec: ModelSpec, size: tuple[int, int] | None = None) -> tuple[np.ndarray, Transform]:
    """:func:`preprocess_pil`, and the image's :class:`Transform` from ``size`` (the original's width and height as
    a viewer shows it, where ``img`` was decoded smaller; default ``img.size``) to the input."""
    mode = "L" if spec.input.channels == 1 else "RGB"
    if img.mode != mode:
        img = img.convert(mode)
    width, height = size or img.size
    in_w, in_h = spec.input.width, spec.input.height
    # A centre crop is sized from the decoded image (JPEG draft decoding may have shrunk it), others from the original.
    new_w, new_h, x, y = placement(spec, *(img.size if spec.resize == "center_crop" else (width, height)))
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), RESAMPLE[spec.interpolation])
    transform = Transform(width, height, new_w / width, new_h / height, float(x), float(y))
    if spec.resize == "letterbox":
        out = np.full((spec.input.channels, in_h, in_w), spec.pad_value, dtype=np.uint8)
        out[:, y : y + new_h, x : x + new_w] = _chw(img)
        return out, transform
    if (x, y, in_w, in_h) != (0, 0, new_w, new_h):  # a centre crop that cuts something off
        img = img.crop((-x, -y, in_w - x, in_h - y))
    return _chw(img).copy(), transform


def _chw(img: Image.Image) -> np.ndarray:
    """The image's pixels as a (C, H, W) view."""
    arr = np.asarray(img, dtype=np.uint8)
    return arr[np.newaxis] if arr.ndim == 2 else arr.transpose(2, 0, 1)


def orientation(img: Image.Image) -> int:
    """The EXIF orientation of a loaded image (1: as stored). Read only where the file has EXIF at all, so an
    image without it costs one dictionary lookup."""
    if "exif" not in img.info:
        return 1
    try:
        value = img.getexif().get(ORIENTATION_TAG, 1)
    except Exception:  # a broken EXIF block does not make the pixels unusable: shown as stored
        return 1
    return value if isinstance(value, int) and value in ORIENTATIONS else 1


def preprocess_image(data: bytes, spec: ModelSpec, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode encoded image bytes and preprocess them for ``spec``: uint8 (C, H, W), or a BadInputError (its own)."""
    return decode_opened(open_image(data, limits), spec)


def decode_cost(img: Image.Image, spec: ModelSpec) -> int:
    """About how many pixels decoding ``img`` (opened, not loaded) for ``spec`` will produce: its size, less what
    JPEG draft mode skips (it decodes at 1/2, 1/4 or 1/8 scale when the image is much larger than needed)."""
    w, h = img.size
    if img.format != "JPEG":
        return w * h
    scale = draft_scale(w, h, spec)
    reduction = 1
    while reduction < 8 and reduction * 2 * scale <= 1:
        reduction *= 2
    return (w // reduction) * (h // reduction)


def draft_scale(width: int, height: int, spec: ModelSpec) -> float:
    """How small a JPEG may be decoded (a fraction of its size; JPEG draft mode) and still hold ``DRAFT_GAP`` times
    the pixels the resize keeps, on both axes."""
    if spec.resize == "center_crop":
        return spec.resize_size * DRAFT_GAP / min(width, height)
    in_w, in_h = spec.input.width, spec.input.height
    if spec.resize == "letterbox":
        return min(in_w / width, in_h / height) * DRAFT_GAP
    return max(in_w / width, in_h / height) * DRAFT_GAP


def decode_opened(img: Image.Image, spec: ModelSpec) -> np.ndarray:
    """Decode and preprocess an image :func:`open_image` has checked; :class:`BadInputError` for a corrupt one."""
    return decode_transformed(img, spec)[0]


def decode_transformed(img: Image.Image, spec: ModelSpec) -> tuple[np.ndarray, Transform]:
    """:func:`decode_opened`, and the image's :class:`Transform` to the input (from its size in the header, EXIF
    orientation applied: JPEG draft decoding shrinks what is decoded, never what the boxes are answered in)."""
    width, height = img.size
    if img.format == "JPEG":
        # Decode at a reduced scale when the image is much larger than needed: far fewer pixels to decode.
        scale = draft_scale(width, height, spec)
        if scale < 1:
            img.draft("RGB" if spec.input.channels == 3 else "L", (int(width * scale) + 1, int(height * scale) + 1))
    try:
        img.load()
    except OSError as exc:
        raise BadInputError(f"truncated or corrupt image data ({img.format}): {exc}") from exc
    except (Image.DecompressionBombError, ValueError, SyntaxError) as exc:
        raise BadInputError(f"corrupt image data ({img.format}): {exc}") from exc
    try:
        turn = orientation(img)
        if turn != 1:  # a phone photo taken upright is stored on its side, with the turn in its EXIF
            img = img.transpose(ORIENTATIONS[turn])
            if turn >= 5:
                width, height = height, width
        return prepare(img, spec, (width, height))
    except OSError as exc:
        raise BadInputError(f"truncated or corrupt image data ({img.format}): {exc}") from exc
