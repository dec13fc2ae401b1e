"""Fuzzing the image checks (``open_image``, ``ImageLimits``, ``preprocess_image``): the pixel limit, decompression
bombs, truncated and corrupt files, formats we do not take.

Properties: a header that declares more pixels than the limit is refused (413) before any pixel is decoded, and one
within it is accepted, whatever the limit is configured to; every image of a format we take decodes to the model's
shape; a corrupted, truncated or arbitrary file is refused with a :class:`BadInputError` (or a subclass) and nothing
else.
"""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

import models
from service.core.errors import BadInputError, ConfigError, PayloadTooLargeError, UnsupportedMediaError
from service.core.preprocess import ImageLimits, open_image, pil_max_pixels, preprocess_image
from tests.fuzz.conftest import FUZZ, outcome, peak_bytes

DIGITS = models.get_architecture("smallcnn").spec  # one channel, small: the decode is the work, not the resize
SPECS = {"digits": DIGITS, "resnet": models.get_architecture("resnet18").spec}
# The largest configured limit the fuzzing tries: far above what PIL opens at all (twice Image.MAX_IMAGE_PIXELS,
# 179 million by default), since --max-pixels may be set that high.
MAX_LIMIT = 10**12


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds almost none: a decompression bomb's shape."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0")) + _chunk(b"IEND", b"")


def bmp_header(width: int, height: int) -> bytes:
    """A 24-bit BMP that declares ``width`` x ``height`` (negative: top-down rows) and holds a few bytes."""
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    pixels = bytes(16)
    return b"BM" + struct.pack("<IHHI", 14 + len(info) + len(pixels), 0, 0, 14 + len(info)) + info + pixels


HEADERS = {"PNG": png_header, "BMP": bmp_header}
sides = st.integers(1, 2**31 - 1) | st.integers(1, 20_000)
limits = st.integers(1, MAX_LIMIT) | st.integers(1, 10**8) | st.sampled_from([40_000_000, 89_478_485, 2 * 89_478_485])


# PIL warns between its MAX_IMAGE_PIXELS and twice that; the limit that refuses is ours, which this test checks.
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
@FUZZ
@given(st.sampled_from(sorted(HEADERS)), sides, sides, limits)
def test_a_declared_size_over_the_limit_is_refused_and_one_within_it_is_accepted(
    fmt: str, width: int, height: int, max_pixels: int
) -> None:
    if max_pixels > pil_max_pixels():  # a limit PIL cannot honour is refused when it is configured
        with pytest.raises(ConfigError, match=f"max_pixels must be an integer between 1 and .*, got {max_pixels}"):
            ImageLimits(max_pixels=max_pixels)
        return
    data = HEADERS[fmt](width, height)
    with peak_bytes() as peak:
        result = outcome(lambda: open_image(data, ImageLimits(max_pixels=max_pixels)), (BadInputError,))
    assert peak[0] < 1 << 20  # the header alone is read: nothing the declared size is allocated
    if width * height > max_pixels:
        assert isinstance(result, PayloadTooLargeError), result
        assert f"over the limit of {max_pixels}" in str(result)
    elif isinstance(result, BadInputError):  # within the limit, PIL may still find the header unreadable
        assert not isinstance(result, PayloadTooLargeError), result
    else:
        assert result.size == (width, height) and result.format == fmt


FORMAT_MODES = {
    "PNG": ["L", "RGB", "RGBA", "P", "1", "LA", "I;16"],  # Pillow 13 no longer writes mode I as PNG
    "JPEG": ["L", "RGB", "CMYK"],
    "BMP": ["L", "RGB", "P", "1"],
    "WEBP": ["RGB", "RGBA"],
}


@st.composite
def encoded_images(draw: st.DrawFn) -> tuple[bytes, str, int, int]:
    """(file, format, width, height): a small image of any mode a format we take can hold."""
    fmt = draw(st.sampled_from(sorted(FORMAT_MODES)))
    mode = draw(st.sampled_from(FORMAT_MODES[fmt]))
    width, height = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    seed = draw(st.integers(0, 2**16))
    noise = np.random.default_rng(seed).integers(0, 256, size=(height, width, 4), dtype=np.uint8)
    img = Image.fromarray(noise, "RGBA").convert(mode if mode != "I;16" else "L")
    if mode == "I;16":
        img = img.convert("I;16")
    if mode == "P" and draw(st.booleans()):
        img.info["transparency"] = 0
    buf = io.BytesIO()
    params = {"quality": draw(st.integers(5, 95)), "progressive": draw(st.booleans())} if fmt == "JPEG" else {}
    img.save(buf, format=fmt, **params)
    return buf.getvalue(), fmt, width, height


@FUZZ
@given(encoded_images(), st.sampled_from(sorted(SPECS)), limits)
def test_every_image_we_take_decodes_to_the_model_shape_or_is_refused_for_its_size(
    image: tuple[bytes, str, int, int], spec_name: str, max_pixels: int
) -> None:
    max_pixels = min(max_pixels, pil_max_pixels())
    data, _, width, height = image
    spec = SPECS[spec_name]
    result = outcome(lambda: preprocess_image(data, spec, ImageLimits(max_pixels=max_pixels)), (BadInputError,))
    if width * height > max_pixels:
        assert isinstance(result, PayloadTooLargeError), result
    else:
        assert isinstance(result, np.ndarray), result
        assert result.shape == (spec.input.channels, spec.input.height, spec.input.width)
        assert result.dtype == np.uint8


@st.composite
def corrupted_images(draw: st.DrawFn) -> bytes:
    """A valid small image, truncated, with bytes changed, or with bytes inserted."""
    data = draw(encoded_images())[0]
    how = draw(st.sampled_from(["truncate", "flip", "insert", "splice"]))
    i = draw(st.integers(0, len(data) - 1))
    if how == "truncate":
        return data[:i]
    if how == "flip":
        return data[:i] + bytes([data[i] ^ draw(st.integers(1, 255))]) + data[i + 1 :]
    if how == "insert":
        return data[:i] + draw(st.binary(min_size=1, max_size=16)) + data[i:]
    return data[:i] + draw(st.binary(max_size=64))


@FUZZ
@given(corrupted_images(), st.sampled_from(sorted(SPECS)))
def test_a_corrupted_image_decodes_or_is_refused_with_bad_input_only(data: bytes, spec_name: str) -> None:
    spec = SPECS[spec_name]
    result = outcome(lambda: preprocess_image(data, spec, ImageLimits(max_pixels=1 << 20)), (BadInputError,))
    if isinstance(result, np.ndarray):
        assert result.shape == (spec.input.channels, spec.input.height, spec.input.width)


MAGICS = [
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"BM",
    b"RIFF\x00\x00\x00\x00WEBPVP8 ",
    b"GIF89a",
    b"II*\x00",
    b"\x00\x00\x01\x00",
    b"",
]


@FUZZ
@given(st.sampled_from(MAGICS), st.binary(max_size=300))
def test_arbitrary_bytes_are_refused_with_bad_input_only(magic: bytes, rest: bytes) -> None:
    """Behind a real format's magic number, so every plugin's parser gets past its first check."""
    data = magic + rest
    result = outcome(lambda: preprocess_image(data, DIGITS, ImageLimits(max_pixels=1 << 20)), (BadInputError,))
    if isinstance(result, BadInputError) and not data:
        assert "empty image" in str(result)


def test_a_format_we_do_not_take_is_refused_as_unsupported_media() -> None:
    buf = io.BytesIO()
    Image.new("L", (4, 4)).save(buf, format="GIF")
    result = outcome(lambda: open_image(buf.getvalue()), (BadInputError,))
    assert isinstance(result, UnsupportedMediaError) and "GIF" in str(result)
