"""Decoding many images: a bounded thread pool on the CPU, and batched JPEG decoding on a GPU.

PIL releases the GIL while it decodes and resizes, so a pool of threads uses every core. On CUDA, JPEGs are
decoded in batches by nvJPEG (``torchvision.io.decode_jpeg(..., device="cuda")``), resized and cropped there; other
formats, and JPEGs nvJPEG refuses, go through the CPU path. Each image's refusal stays its own.

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
    crop_box,
    decode_cost,
    decode_transformed,
    open_image,
    orientation,
    resized_size,
)
from service.core.spec import ModelSpec

Decoded = np.ndarray | VisionServeError


def default_workers() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


LARGE_IMAGE_PIXELS = 4_000_000


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

    def decoded(self, done: tuple[np.ndarray, Transform]) -> None:
        """Set the result: the pixels, and the transform beside them."""
        self.transform = done[1]
        self.stamp_finished()
        self.set_result(done[0])

    def stamp_finished(self) -> None:
        self.finished = time.perf_counter()


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
            result.decoded(decode_transformed(img, self.spec))
        except Exception as exc:
            result.stamp_finished()
            result.set_exception(exc)

    def _decode_large(self, img: Any, result: DecodeFuture) -> None:
        try:
            result.decoded(decode_transformed(img, self.spec))
        except Exception as exc:
            result.stamp_finished()
            result.set_exception(exc)
        finally:
            with self._large_lock:
                self._large_pending -= 1

    def decode_many(self, images: Sequence[bytes]) -> list[Decoded]:
        """Decode several images in parallel (blocking); each entry is an array or that image's own error."""
        futures = [self.submit(data) for data in images]
        out: list[Decoded] = []
        for future in futures:
            try:
                out.append(future.result())
            except VisionServeError as exc:
                out.append(exc)
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._large.shutdown(wait=True)


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def has_jpeg_end(data: bytes) -> bool:
    """Whether the file ends with the end-of-image marker (some writers pad after it)."""
    return data.rstrip(b"\x00\r\n ")[-2:] == b"\xff\xd9"


GPU_JPEG_MODES = ("RGB", "L", "YCbCr")  # PIL's modes for JPEGs nvJPEG decodes correctly to RGB/Y


class GpuJpegDecoder:
    """Batched JPEG decode, resize and centre crop on a CUDA device; uint8 CHW arrays come back to the host."""

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

    def _resize_crop(self, image: Any) -> Any:
        torch = self.torch
        _, h, w = image.shape
        new_w, new_h = resized_size(w, h, self.spec.resize_size)
        x = image.unsqueeze(0).float()
        x = torch.nn.functional.interpolate(
            x, size=(new_h, new_w), mode=self.spec.interpolation, antialias=self.spec.interpolation != "nearest"
        )
        left, top, right, bottom = crop_box(new_w, new_h, self.spec.input.height, self.spec.input.width)
        return x[0, :, top:bottom, left:right].round_().clamp_(0, 255).to(torch.uint8)

    def decode_many(self, images: Sequence[bytes], cpu: Preprocessor) -> list[Decoded]:
        """JPEGs on the GPU in one batch; everything else (and any JPEG that fails there) through ``cpu``."""
        torch = self.torch
        out: list[Decoded | None] = [None] * len(images)
        jpeg_idx: list[int] = []
        for i, data in enumerate(images):
            if is_jpeg(data):
                try:
                    header = open_image(data, self.limits)  # header checks (format, pixel limit) stay on the CPU
                except BadInputError as exc:
                    out[i] = exc
                    continue
                # The CPU path turns an EXIF-oriented image upright and letterboxes or stretches; here only the
                # centre crop of an image stored upright is done.
                upright = orientation(header) == 1 and self.spec.resize == "center_crop"
                if header.mode in GPU_JPEG_MODES and has_jpeg_end(data) and upright:
                    jpeg_idx.append(i)
        if jpeg_idx:
            tensors = [torch.frombuffer(bytearray(images[i]), dtype=torch.uint8) for i in jpeg_idx]
            try:
                decoded = self.io.decode_jpeg(tensors, mode=self.mode, device=self.device)
            except RuntimeError:
                decoded = None  # one bad JPEG fails the whole call: those images go through the CPU one by one
            if decoded is not None:
                crops = torch.stack([self._resize_crop(img) for img in decoded]).cpu().numpy()
                for row, i in enumerate(jpeg_idx):
                    out[i] = crops[row]
        rest = [i for i, v in enumerate(out) if v is None]
        for i, result in zip(rest, cpu.decode_many([images[i] for i in rest]), strict=True):
            out[i] = result
        return [v for v in out if v is not None]
