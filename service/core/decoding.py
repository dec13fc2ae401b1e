"""Decoding many images: a bounded thread pool on the CPU, and batched JPEG decoding on a GPU.

PIL releases the GIL while it decodes and resizes, so a pool of threads uses every core. On CUDA, JPEGs are
decoded in batches by nvJPEG (``torchvision.io.decode_jpeg(..., device="cuda")``), turned upright by their EXIF
orientation and resized as the spec says (centre crop, letterbox, stretch) there, each with the same
:class:`Transform` the CPU path records; other formats, and JPEGs nvJPEG refuses, go through the CPU path. Each
image's refusal stays its own.

What goes to nvJPEG is checked on the CPU first, from the header only (torchvision 0.26-0.29's
``decode_jpegs_cuda``, read for this): CMYK/YCCK JPEGs stay on the CPU (nvJPEG's RGB output has no Adobe CMYK
transform, so colours would come back wrong instead of failing), and so do JPEGs without an end-of-image marker
(a truncated file must be refused, as PIL refuses it, not decoded into grey rows). Progressive JPEGs are decoded
on the GPU (torchvision sends them to nvJPEG's software path). One JPEG that nvJPEG rejects fails the whole
batched call, so then the batch goes to the CPU pool, where each image succeeds or fails on its own.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from service.core.boxes import Transform
from service.core.errors import BadInputError, OverloadedError, VisionServeError
from service.core.preprocess import (
    DEFAULT_LIMITS,
    ImageLimits,
    decode_cost,
    decode_transformed,
    open_image,
    orientation,
    placement,
)
from service.core.spec import ModelSpec

Decoded = np.ndarray | VisionServeError
LARGE_IMAGE_PIXELS = 4_000_000  # serve's --large-image-pixels default
GPU_JPEG_MODES = ("RGB", "L", "YCbCr")  # PIL's modes for JPEGs nvJPEG decodes correctly to RGB/Y


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class DecodeFuture(Future[np.ndarray]):
    """One image's decode, stamped with ``time.perf_counter()`` when a thread took it and when it was done (the
    ``decode_wait`` and ``decode`` stages of the request's timing), with the image's :class:`Transform` once
    decoded (where its boxes map back to)."""

    def __init__(self) -> None:
        super().__init__()
        self.submitted = time.perf_counter()
        self.started = self.submitted
        self.finished = self.submitted
        self.transform: Transform | None = None

    def settle(self, outcome: tuple[np.ndarray, Transform] | Exception) -> None:
        """Stamp the end and set the result (the pixels, the transform beside them) or the exception."""
        self.finished = time.perf_counter()
        if isinstance(outcome, Exception):
            self.set_exception(outcome)
        else:
            self.transform = outcome[1]
            self.set_result(outcome[0])


class Preprocessor:
    """CPU decode + preprocess for one model's spec, in two bounded lanes of threads.

    Every image is opened (its header only) in the main pool. One whose decode would produce more than
    ``large_pixels`` pixels (:func:`decode_cost`) is handed to a lane of its own (half the workers), where at most
    ``large_queue`` more wait; past that it is refused with 503 at once. Small images then never queue behind
    large ones: measured with 8 clients sending 36-megapixel PNGs (0.7 s each to decode) on 2 cores, a digit's
    answer took up to 3.2 s with one shared pool (tests/reliability/test_faults.py).
    """

    def __init__(
        self,
        spec: ModelSpec,
        limits: ImageLimits = DEFAULT_LIMITS,
        *,
        workers: int | None = None,
        large_pixels: int = LARGE_IMAGE_PIXELS,
        large_queue: int | None = None,
    ) -> None:
        self.spec = spec
        self.limits = limits
        self.workers = workers or default_workers()
        self.large_pixels = large_pixels
        self.large_workers = max(1, self.workers // 2)
        self.large_queue = self.large_workers * 2 if large_queue is None else large_queue
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix=f"decode-{spec.name}")
        self._large = ThreadPoolExecutor(max_workers=self.large_workers, thread_name_prefix=f"decode-large-{spec.name}")
        self._large_lock = threading.Lock()
        self._large_pending = 0

    def submit(self, data: bytes) -> DecodeFuture:
        """Decode one image; the future raises :class:`BadInputError` for a refused image, or
        :class:`OverloadedError` when the large-image lane is full."""
        result = DecodeFuture()
        self._pool.submit(self._route, data, result)
        return result

    def _route(self, data: bytes, result: DecodeFuture) -> None:
        if not result.set_running_or_notify_cancel():  # the caller went away
            return
        result.started = time.perf_counter()
        try:
            img = open_image(data, self.limits)
            if decode_cost(img, self.spec) > self.large_pixels:
                with self._large_lock:
                    if self._large_pending >= self.large_workers + self.large_queue:
                        raise OverloadedError(
                            f"{self._large_pending} large images (over {self.large_pixels} pixels each) are being "
                            "decoded already; retry later"
                        )
                    self._large_pending += 1
                self._large.submit(self._decode_large, img, result)
                return
            result.settle(decode_transformed(img, self.spec))
        except Exception as exc:
            result.settle(exc)

    def _decode_large(self, img: Any, result: DecodeFuture) -> None:
        try:
            result.settle(decode_transformed(img, self.spec))
        except Exception as exc:
            result.settle(exc)
        finally:
            with self._large_lock:
                self._large_pending -= 1

    def decode_many(self, images: Sequence[bytes]) -> list[Decoded]:
        """Decode several images in parallel (blocking); each entry is an array or that image's own error."""
        futures = [self.submit(data) for data in images]
        return [_outcome(future) for future in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._large.shutdown(wait=True)


def _outcome(future: DecodeFuture) -> Decoded:
    try:
        return future.result()
    except VisionServeError as exc:
        return exc


def has_jpeg_end(data: bytes) -> bool:
    """Whether the file ends with the end-of-image marker (some writers pad after it)."""
    return data.rstrip(b"\x00\r\n ")[-2:] == b"\xff\xd9"


class GpuJpegDecoder:
    """Batched JPEG decode on a CUDA device, EXIF orientation and the spec's resize (centre crop, letterbox or
    stretch) done there too; uint8 CHW arrays come back to the host, each with its :class:`Transform`."""

    def __init__(self, spec: ModelSpec, device: str = "cuda", limits: ImageLimits = DEFAULT_LIMITS) -> None:
        import torch
        import torchvision

        self.torch = torch
        self.io = torchvision.io
        self.spec = spec
        self.device = torch.device(device)
        self.limits = limits
        # A one-channel model takes luma, as the CPU path's convert("L") gives it.
        self.mode = torchvision.io.ImageReadMode.GRAY if spec.input.channels == 1 else torchvision.io.ImageReadMode.RGB

    def _upright(self, image: Any, turn: int) -> Any:
        """``image`` (C, H, W) as a viewer shows it: PIL's transpose for each EXIF orientation, on the device."""
        if turn in (5, 7):  # transpose, transverse: the axes swapped (transverse also turned half round)
            image = image.transpose(1, 2)
            return image.flip(1, 2) if turn == 7 else image
        if turn in (6, 8):  # rotate 270 / 90 counter-clockwise
            return self.torch.rot90(image, k=1 if turn == 8 else -1, dims=(1, 2))
        flips = {2: (2,), 3: (1, 2), 4: (1,)}.get(turn)
        return image.flip(flips) if flips else image

    def _resize(self, image: Any, new_h: int, new_w: int) -> Any:
        x = image.unsqueeze(0).float()
        if (new_h, new_w) != tuple(image.shape[1:]):
            x = self.torch.nn.functional.interpolate(
                x, size=(new_h, new_w), mode=self.spec.interpolation, antialias=self.spec.interpolation != "nearest"
            )
        return x[0].round_().clamp_(0, 255).to(self.torch.uint8)

    def _prepare(self, image: Any) -> tuple[Any, Transform]:
        """The CPU path's :func:`~service.core.preprocess.prepare`, on the device."""
        spec = self.spec
        _, h, w = image.shape
        in_w, in_h = spec.input.width, spec.input.height
        new_w, new_h, x, y = placement(spec, w, h)
        resized = self._resize(image, new_h, new_w)
        transform = Transform(w, h, new_w / w, new_h / h, float(x), float(y))
        if spec.resize != "letterbox":  # a centre crop's window (x, y <= 0), or the whole of a stretch
            return resized[:, -y : in_h - y, -x : in_w - x], transform
        out = self.torch.full((image.shape[0], in_h, in_w), spec.pad_value, dtype=self.torch.uint8, device=image.device)
        out[:, y : y + new_h, x : x + new_w] = resized
        return out, transform

    def decode_many(self, images: Sequence[bytes], cpu: Preprocessor) -> list[Decoded]:
        """JPEGs on the GPU in one batch; everything else (and any JPEG that fails there) through ``cpu``."""
        return [pixels for pixels, _ in self.decode_transformed(images, cpu)]

    def decode_transformed(self, images: Sequence[bytes], cpu: Preprocessor) -> list[tuple[Decoded, Transform | None]]:
        """:meth:`decode_many`, each image with its :class:`Transform` (None for a refused one), as the CPU path
        gives them: boxes map back to the image as a viewer shows it, whichever decoder read it."""
        torch = self.torch
        out: list[tuple[Decoded, Transform | None] | None] = [None] * len(images)
        jpegs: list[tuple[int, int]] = []  # (index, EXIF orientation)
        for i, data in enumerate(images):
            if data[:3] == b"\xff\xd8\xff":  # a JPEG
                try:
                    header = open_image(data, self.limits)  # header checks (format, pixel limit) stay on the CPU
                except BadInputError as exc:
                    out[i] = (exc, None)
                    continue
                if header.mode in GPU_JPEG_MODES and has_jpeg_end(data):
                    jpegs.append((i, orientation(header)))
        if jpegs:
            tensors = [torch.frombuffer(bytearray(images[i]), dtype=torch.uint8) for i, _ in jpegs]
            try:
                decoded = self.io.decode_jpeg(tensors, mode=self.mode, device=self.device)
            except RuntimeError:
                decoded = None  # one bad JPEG fails the whole call: those images go through the CPU one by one
            if decoded is not None:
                prepared = [
                    self._prepare(self._upright(img, turn)) for img, (_, turn) in zip(decoded, jpegs, strict=True)
                ]
                pixels = torch.stack([p for p, _ in prepared]).cpu().numpy()
                for row, ((i, _), (_, transform)) in enumerate(zip(jpegs, prepared, strict=True)):
                    out[i] = (pixels[row], transform)
        rest = [i for i, v in enumerate(out) if v is None]
        futures = [cpu.submit(images[i]) for i in rest]
        for i, future in zip(rest, futures, strict=True):
            out[i] = (_outcome(future), future.transform)  # no transform for a refused image
        return [v for v in out if v is not None]
