"""A decoded video frame to a model's input, straight from its YUV planes: FFmpeg's scaler converts and resizes in
one pass (:func:`frame_input`), where going through a full-size RGB picture and PIL (``frame.to_image()`` then
:func:`~service.core.preprocess.prepare`) converted every pixel of the frame before throwing most of them away.

The geometry is :func:`~service.core.preprocess.prepare`'s (letterbox, stretch, or shorter side then centre crop),
so the :class:`~service.core.boxes.Transform` that maps boxes back is the same; the pixels differ from PIL's resize
by its filter alone (FFmpeg's area average for a reduction, as PIL's antialiased bilinear averages).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from service.core.boxes import Transform, letterbox_geometry
from service.core.preprocess import crop_box, resized_size
from service.core.spec import ModelSpec


def frame_input(frame: Any, spec: ModelSpec) -> tuple[np.ndarray, Transform]:
    """``frame`` (a PyAV ``VideoFrame``) as ``spec``'s uint8 ``(C, H, W)`` input, and its Transform."""
    grey = spec.input.channels == 1
    width, height = frame.width, frame.height
    in_w, in_h = spec.input.width, spec.input.height
    if spec.resize == "letterbox":
        new_w, new_h, left, top = letterbox_geometry(width, height, in_w, in_h)
        out = np.full((spec.input.channels, in_h, in_w), spec.pad_value, dtype=np.uint8)
        out[:, top : top + new_h, left : left + new_w] = _scaled(frame, new_w, new_h, grey)
        return out, Transform(width, height, new_w / width, new_h / height, float(left), float(top))
    if spec.resize == "stretch":
        return _scaled(frame, in_w, in_h, grey), Transform(width, height, in_w / width, in_h / height)
    new_w, new_h = resized_size(width, height, spec.resize_size)
    x0, y0, x1, y1 = crop_box(new_w, new_h, in_h, in_w)
    chw = _scaled(frame, new_w, new_h, grey)[:, y0:y1, x0:x1]
    return np.ascontiguousarray(chw), Transform(width, height, new_w / width, new_h / height, float(-x0), float(-y0))


def _scaled(frame: Any, width: int, height: int, grey: bool) -> np.ndarray:
    """The frame at ``width`` x ``height``, ``(C, H, W)`` uint8: one channel for a grey model, else RGB."""
    reduce = width * height < frame.width * frame.height
    pixels = frame.reformat(
        width=width, height=height, format="gray" if grey else "rgb24", interpolation="AREA" if reduce else "BILINEAR"
    ).to_ndarray()
    return pixels[np.newaxis] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
