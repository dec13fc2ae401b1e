"""Which images the GPU JPEG decoder sends to nvJPEG and which to the CPU pool, checked without a GPU: the batched
decode call is pointed at the CPU (torchvision's same ``decode_jpeg`` on a list), everything else runs as on CUDA."""

from __future__ import annotations

import io
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from models.registry import get_architecture
from service.core.decoding import GpuJpegDecoder, Preprocessor, has_jpeg_end
from service.core.errors import BadInputError
from tests.conftest import encode_image, random_image

SPEC = get_architecture("resnet18").spec


def _decoder() -> tuple[GpuJpegDecoder, list[int]]:
    gpu = GpuJpegDecoder(SPEC, "cpu")
    sent: list[int] = []
    real = gpu.io.decode_jpeg

    class RecordingIO:
        ImageReadMode = gpu.io.ImageReadMode

        @staticmethod
        def decode_jpeg(tensors: list[torch.Tensor], **kw: Any) -> Any:
            sent.append(len(tensors))
            return real(tensors, **kw)

    gpu.io = RecordingIO  # type: ignore[assignment]
    return gpu, sent


def test_cmyk_and_truncated_jpegs_stay_on_the_cpu_and_the_rest_go_in_one_batch() -> None:
    rgb = random_image(300, 400, seed=2)
    cmyk = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(cmyk, format="JPEG", quality=95)
    baseline = encode_image(rgb, "JPEG", quality=95)
    files = [
        baseline,
        encode_image(rgb, "JPEG", quality=95, progressive=True),
        cmyk.getvalue(),
        encode_image(rgb[:, :, 0], "JPEG", quality=95),
        baseline[: len(baseline) // 2],
        encode_image(rgb, "PNG"),
    ]
    gpu, sent = _decoder()
    pool = Preprocessor(SPEC, workers=2)
    try:
        out, reference = gpu.decode_many(files, pool), pool.decode_many(files)
    finally:
        pool.close()
    assert sent == [3]  # baseline, progressive and grayscale: one batched call
    for i in (0, 1, 2, 3, 5):
        a, b = out[i], reference[i]
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), i
        assert a.shape == b.shape == (3, 224, 224)
        assert np.abs(a.astype(float) - b.astype(float)).mean() < 4.0, i
    assert isinstance(out[4], BadInputError)  # refused as the CPU refuses it, not decoded into grey rows


def test_one_jpeg_the_batched_call_rejects_sends_the_batch_to_the_cpu_each_on_its_own() -> None:
    good = encode_image(random_image(200, 260, seed=3), "JPEG", quality=90)
    # A valid header and an end marker around garbage entropy-coded data: PIL's header check passes.
    broken = good[:600] + bytes(range(256)) * 4 + b"\xff\xd9"
    gpu, sent = _decoder()
    pool = Preprocessor(SPEC, workers=2)
    try:
        out = gpu.decode_many([good, broken, good], pool)
    finally:
        pool.close()
    assert sent == [3] and len(out) == 3
    assert isinstance(out[0], np.ndarray) and isinstance(out[2], np.ndarray) and np.array_equal(out[0], out[2])
    assert isinstance(out[1], (np.ndarray, BadInputError))  # its own answer, whichever decoder gave it


def test_end_of_image_marker() -> None:
    assert has_jpeg_end(b"\xff\xd8\xff...\xff\xd9") and has_jpeg_end(b"\xff\xd8\xff...\xff\xd9\x00\x00")
    assert not has_jpeg_end(b"\xff\xd8\xff...\xff")


def _marked(height: int, width: int) -> np.ndarray:
    """Red rising left to right, green top to bottom, a white block in the top-left corner: any wrong turn or flip
    moves it far from where it belongs."""
    yy, xx = np.mgrid[0:height, 0:width]
    image = np.stack([xx * 255 // width, yy * 255 // height, np.full_like(xx, 60)], axis=-1).astype(np.uint8)
    image[: height // 4, : width // 5] = 255
    return image


@pytest.mark.parametrize("resize", ["center_crop", "letterbox", "stretch"])
def test_the_gpu_path_turns_each_exif_orientation_upright_and_resizes_as_the_cpu_path_does(resize: str) -> None:
    spec = msgspec.structs.replace(SPEC, resize=resize, pad_value=114)
    gpu, sent = _decoder()
    gpu.spec = spec
    files = []
    for turn in range(1, 9):
        exif = Image.Exif()
        exif[0x0112] = turn
        buf = io.BytesIO()
        Image.fromarray(_marked(240, 320)).save(buf, format="JPEG", quality=95, exif=exif)
        files.append(buf.getvalue())
    pool = Preprocessor(spec, workers=2)
    try:
        out = gpu.decode_transformed(files, pool)
        reference = [(f.result(), f.transform) for f in [pool.submit(data) for data in files]]
    finally:
        pool.close()
    assert sent == [8]  # every orientation on the device, none sent back to the CPU
    for turn, ((pixels, where), (expected, expected_where)) in enumerate(zip(out, reference, strict=True), 1):
        assert isinstance(pixels, np.ndarray) and pixels.shape == expected.shape == (3, 224, 224), turn
        assert where == expected_where, turn  # the same transform: boxes map back alike
        assert (where.width, where.height) == ((240, 320) if turn >= 5 else (320, 240)), turn
        assert np.abs(pixels.astype(float) - expected.astype(float)).mean() < 4.0, (turn, resize)
