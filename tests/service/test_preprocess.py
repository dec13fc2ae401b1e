"""Preprocessing: the serving transform is the training transform (and torchvision's), and every bad image is
refused alone with a message a person understands."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms

import models
from models.datasets import load_dataset
from service.core.decoding import Preprocessor
from service.core.errors import BadInputError, PayloadTooLargeError, UnsupportedMediaError
from service.core.preprocess import ImageLimits, preprocess_image, preprocess_pil
from tests.conftest import encode_image, random_image

DIGITS = models.get_architecture("smallcnn").spec
RESNET = models.get_architecture("resnet18").spec


def test_served_digits_match_the_training_transform_exactly() -> None:
    """A real digit sent as a PNG file decodes to exactly the tensor the model was trained on."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    data = load_dataset("digits", DIGITS)
    pixels = np.rint(raw.images * (255.0 / 16.0)).astype(np.uint8)
    train_rows = {tuple(img.flatten()): i for i, img in enumerate(data.train_images.numpy()[:50])}
    matched = 0
    for digit in pixels[:200]:
        served = preprocess_image(encode_image(digit, "PNG"), DIGITS)
        if tuple(served.flatten()) in train_rows:
            matched += 1
    assert matched >= 45  # every one of the 50 training images we looked for is produced identically


@pytest.mark.parametrize(("height", "width"), [(375, 500), (500, 333), (224, 224), (100, 90)])
def test_preprocessing_matches_torchvision_resize_and_center_crop(height: int, width: int) -> None:
    image = random_image(height, width, seed=height)
    reference = transforms.Compose([transforms.Resize(RESNET.resize_size), transforms.CenterCrop(224)])(
        Image.fromarray(image)
    )
    expected = np.asarray(reference).transpose(2, 0, 1)
    got = preprocess_pil(Image.fromarray(image), RESNET)
    assert got.shape == (3, 224, 224) and got.dtype == np.uint8
    assert np.array_equal(got, expected)


def test_large_jpegs_use_draft_mode_and_stay_close_to_a_full_decode() -> None:
    big = encode_image(random_image(1800, 2400, seed=3), "JPEG", quality=92)
    drafted = preprocess_image(big, RESNET).astype(float)
    full = preprocess_pil(Image.open(__import__("io").BytesIO(big)).convert("RGB"), RESNET).astype(float)
    assert np.abs(drafted - full).mean() < 3.0  # draft decoding saves most of the work, not the picture


def _png_with_size(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height``: a decompression bomb's calling card."""
    data = encode_image(np.zeros((8, 8, 3), np.uint8), "PNG")
    ihdr = data[16:29]
    patched = struct.pack(">II", width, height) + ihdr[8:]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + patched) & 0xFFFFFFFF)
    return data[:16] + patched + crc + data[33:]


def _gif() -> bytes:
    import io

    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(buf, format="GIF")
    return buf.getvalue()


def _truncated(fmt: str) -> bytes:
    data = encode_image(random_image(200, 200), fmt)
    return data[: len(data) // 2]


@pytest.mark.parametrize(
    ("data", "error", "message"),
    [
        (b"", BadInputError, "empty image"),
        (b"hello, I am text", BadInputError, "not a recognised image"),
        (_truncated("JPEG"), BadInputError, "truncated"),
        (_truncated("PNG"), BadInputError, "truncated"),
        (_gif(), UnsupportedMediaError, "unsupported image format GIF"),
        (_png_with_size(50_000, 50_000), PayloadTooLargeError, "2500000000 pixels, over the limit"),
        (_png_with_size(8_000, 8_000), PayloadTooLargeError, "8000x8000 = 64000000 pixels, over the limit"),
    ],
    ids=["empty", "text", "truncated-jpeg", "truncated-png", "gif", "bomb", "too-many-pixels"],
)
def test_bad_images_are_refused_with_a_clear_message(data: bytes, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        preprocess_image(data, RESNET)


def test_pixel_limit_is_configurable() -> None:
    small = ImageLimits(max_pixels=1000)
    with pytest.raises(PayloadTooLargeError, match="over the limit of 1000"):
        preprocess_image(encode_image(random_image(40, 40), "PNG"), DIGITS, small)


def test_every_format_we_take_decodes() -> None:
    for fmt in ("JPEG", "PNG", "WEBP", "BMP"):
        out = preprocess_image(encode_image(random_image(60, 80), fmt), RESNET)
        assert out.shape == (3, 224, 224)


def test_the_pool_refuses_each_bad_image_alone() -> None:
    pool = Preprocessor(RESNET, workers=2)
    good = encode_image(random_image(300, 400), "JPEG")
    results = pool.decode_many([good, b"junk", good, _truncated("JPEG"), good])
    pool.close()
    assert [isinstance(r, np.ndarray) for r in results] == [True, False, True, False, True]
    assert isinstance(results[1], BadInputError) and isinstance(results[3], BadInputError)
    assert all(np.array_equal(results[0], r) for r in (results[2], results[4]))


def test_large_images_take_their_own_bounded_lane_and_small_ones_never_wait_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading
    from concurrent.futures import FIRST_COMPLETED, wait

    from service.core import decoding
    from service.core.boxes import Transform
    from service.core.errors import OverloadedError
    from service.core.preprocess import decode_cost, open_image
    from service.core.spec import ModelSpec

    big = encode_image(random_image(2000, 2000), "PNG")
    small = encode_image(random_image(64, 64), "PNG")
    assert decode_cost(open_image(big), RESNET) == 4_000_000
    jpeg = open_image(encode_image(random_image(3000, 4000), "JPEG"))
    assert decode_cost(jpeg, RESNET) == 750 * 1000  # draft mode decodes it at a quarter of each side

    # A big image's decode is held until the test opens the gate, wherever it is decoded: the first one is still
    # decoding when the second arrives by construction, however fast this machine decodes.
    gate = threading.Event()
    decode = decoding.decode_transformed

    def held_when_big(img: Image.Image, spec: ModelSpec) -> tuple[np.ndarray, Transform]:
        if img.width * img.height > 1_000_000 and not gate.wait(10):
            raise RuntimeError("the gate was never opened")
        return decode(img, spec)

    monkeypatch.setattr(decoding, "decode_transformed", held_when_big)
    pool = Preprocessor(RESNET, workers=2, large_pixels=1_000_000, large_queue=0)  # one large at a time
    try:
        both = [pool.submit(big), pool.submit(big)]
        assert isinstance(pool.submit(small).result(timeout=10), np.ndarray)  # while a big one is held
        done, held = wait(both, timeout=10, return_when=FIRST_COMPLETED)
        assert len(done) == 1 and len(held) == 1  # whichever reached the lane second was refused at once
        error = next(iter(done)).exception()
        assert isinstance(error, OverloadedError) and "being decoded already" in str(error)
    finally:
        gate.set()
    assert next(iter(held)).result(timeout=10).shape == (3, 224, 224)
    pool.close()


@pytest.mark.gpu
def test_gpu_jpeg_decoding_matches_the_cpu_path() -> None:
    from service.core.decoding import GpuJpegDecoder

    cpu = Preprocessor(RESNET, workers=2)
    gpu = GpuJpegDecoder(RESNET, "cuda")
    files = [encode_image(random_image(375 + 10 * i, 500, seed=i), "JPEG", quality=95) for i in range(6)]
    files.append(encode_image(random_image(200, 300), "PNG"))
    files.append(b"junk")
    on_gpu = gpu.decode_many(files, cpu)
    on_cpu = cpu.decode_many(files)
    for a, b in zip(on_gpu[:7], on_cpu[:7], strict=True):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        assert np.abs(a.astype(float) - b.astype(float)).mean() < 4.0  # nvJPEG's IDCT and resize differ slightly
    assert isinstance(on_gpu[7], BadInputError)
    assert torch.cuda.is_available()
