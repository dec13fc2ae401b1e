"""Boxes: suppression against a plain reference, the way back to the original image's pixels against an independent
formula (within 0.5 pixel), and the transform each decoded image carries (EXIF orientation, JPEG draft decoding)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from service.core.boxes import (
    BLOCK,
    Transform,
    formatted,
    letterbox_transform,
    stretch_transform,
    suppress,
    to_original,
)
from service.core.preprocess import decode_transformed, open_image
from service.core.spec import InputSpec, ModelSpec
from service.core.tasks import DetectOptions

SIZES = [(37, 201), (301, 53), (7, 9), (1, 1), (3000, 4000), (4000, 3000), (4000, 17), (480, 640)]  # (height, width)


def reference_nms(rows: np.ndarray, options: DetectOptions) -> list[int]:
    """Greedy suppression written plainly: indices into ``rows`` of what is kept, best first."""
    order = [i for i in sorted(range(len(rows)), key=lambda i: -rows[i, 4]) if rows[i, 4] >= options.score_threshold]
    if options.classes is not None:
        order = [i for i in order if int(rows[i, 5]) in options.classes]
    kept: list[int] = []
    for i in order:
        same = [k for k in kept if options.class_agnostic or rows[k, 5] == rows[i, 5]]
        if all(plain_iou(rows[i], rows[k]) <= options.iou_threshold for k in same):
            kept.append(i)
    return kept[: options.max_detections]


def plain_iou(a: np.ndarray, b: np.ndarray) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
    return float(w * h / union) if union > 0 else 0.0


@pytest.mark.parametrize(
    "options",
    [
        DetectOptions(),
        DetectOptions(class_agnostic=True),
        DetectOptions(score_threshold=0.0, iou_threshold=0.3, max_detections=7),
        DetectOptions(classes=(0, 2), iou_threshold=0.6),
    ],
    ids=["default", "agnostic", "low-threshold-capped", "class-filter"],
)
def test_suppression_matches_a_plain_reference(options: DetectOptions) -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        k = 300
        xy = rng.uniform(0, 200, (k, 2))
        wh = rng.uniform(5, 60, (k, 2))
        rows = np.concatenate([xy, xy + wh, rng.uniform(0, 1, (k, 1)), rng.integers(0, 4, (k, 1))], axis=1)
        rows = rows.astype(np.float32)
        kept = suppress(rows, options)
        assert kept.dtype == np.float32 and kept.shape[1] == 6
        np.testing.assert_array_equal(kept, rows[reference_nms(rows, options)])


@pytest.mark.parametrize("agnostic", [False, True], ids=["per-class", "agnostic"])
def test_suppression_over_several_blocks_matches_the_reference(agnostic: bool) -> None:
    """More candidates above the threshold than one block settles (and than one class matrix holds), clustered as a
    dense head's are, every one kept that greedy suppression keeps: the block-by-block path and the per-class path."""
    rng = np.random.default_rng(3)
    k = 2 * BLOCK + 100
    centres = rng.uniform(0, 300, (12, 2))
    xy = centres[rng.integers(0, 12, k)] + rng.normal(0, 8, (k, 2))
    wh = rng.uniform(10, 40, (k, 2))
    rows = np.concatenate([xy, xy + wh, rng.uniform(0, 1, (k, 1)), rng.integers(0, 2, (k, 1))], axis=1)
    rows = rows.astype(np.float32)
    assert min((rows[:, 5] == c).sum() for c in (0, 1)) > BLOCK  # each class alone spans two blocks
    options = DetectOptions(score_threshold=0.0, iou_threshold=0.5, max_detections=k, class_agnostic=agnostic)
    np.testing.assert_array_equal(suppress(rows, options), rows[reference_nms(rows, options)])


def test_suppression_of_nothing_and_of_non_finite_rows() -> None:
    assert suppress(np.zeros((0, 6), np.float32), DetectOptions()).shape == (0, 6)
    rows = np.array([[0, 0, 10, 10, 0.9, 0], [np.nan, 0, 10, 10, 0.95, 0]], dtype=np.float32)
    assert suppress(rows, DetectOptions()).tolist() == [[0, 0, 10, 10, pytest.approx(0.9), 0]]


def independent_letterbox(width: int, height: int, in_w: int, in_h: int, x: float, y: float) -> tuple[float, float]:
    """An input point's place in the original, written from the resize's geometry: the longer side (relative to the
    input) fills the input, the other is scaled by the same factor and rounded, the image is centred with the
    remainder split (floor) before it."""
    if width * in_h >= height * in_w:  # as wide as the input or wider: the width fills it
        new_w, new_h = in_w, max(1, min(in_h, int(height * in_w / width + 0.5)))
    else:
        new_w, new_h = max(1, min(in_w, int(width * in_h / height + 0.5))), in_h
    left, top = (in_w - new_w) // 2, (in_h - new_h) // 2
    return (x - left) * width / new_w, (y - top) * height / new_h


@pytest.mark.parametrize(("height", "width"), SIZES)
@pytest.mark.parametrize(("in_w", "in_h"), [(64, 48), (640, 640), (32, 96)])
def test_letterbox_mapping_matches_an_independent_formula(height: int, width: int, in_w: int, in_h: int) -> None:
    t = letterbox_transform(width, height, in_w, in_h)
    rng = np.random.default_rng(1)
    points = rng.uniform(0, 1, (50, 2)) * [in_w, in_h]
    rows = np.zeros((50, 6), np.float32)
    rows[:, 0], rows[:, 1] = points[:, 0], points[:, 1]
    rows[:, 2], rows[:, 3] = points[:, 0], points[:, 1]
    mapped = to_original(rows, t)
    for (x, y), row in zip(points, mapped, strict=True):
        ex, ey = independent_letterbox(width, height, in_w, in_h, x, y)
        assert abs(row[0] - min(max(ex, 0), width)) <= 0.5 and abs(row[1] - min(max(ey, 0), height)) <= 0.5
        assert 0 <= row[0] <= width and 0 <= row[1] <= height  # clipped to the image
    corners = np.array([[t.pad_x, t.pad_y, t.pad_x + width * t.scale_x, t.pad_y + height * t.scale_y, 1, 0]])
    assert to_original(corners, t)[0, :4] == pytest.approx([0, 0, width, height], abs=0.5)


@pytest.mark.parametrize(("height", "width"), SIZES)
def test_stretch_mapping(height: int, width: int) -> None:
    t = stretch_transform(width, height, 64, 48)
    row = np.array([[16, 12, 48, 36, 1, 0]], np.float32)
    assert to_original(row, t)[0, :4] == pytest.approx([width / 4, height / 4, width * 3 / 4, height * 3 / 4], abs=0.5)


def test_box_formats() -> None:
    xyxy = np.array([[10, 20, 50, 80]], np.float32)
    assert formatted(xyxy, "xyxy", 100, 200, False).tolist() == [[10, 20, 50, 80]]
    assert formatted(xyxy, "xywh", 100, 200, False).tolist() == [[10, 20, 40, 60]]
    assert formatted(xyxy, "cxcywh", 100, 200, False).tolist() == [[30, 50, 40, 60]]
    assert formatted(xyxy, "xywh", 100, 200, True)[0].tolist() == pytest.approx([0.1, 0.1, 0.4, 0.3])


def spec_of(resize: str, channels: int = 3) -> ModelSpec:
    return ModelSpec(
        name="t", architecture="t", input=InputSpec(height=48, width=64, channels=channels), resize_size=64,
        mean=(0.0,) * channels, std=(1.0,) * channels, labels=("a",), resize=resize,  # type: ignore[arg-type]
    )  # fmt: skip


# EXIF orientation -> the transpose that stores an upright image so that a viewer shows it upright.
STORED = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 5: Image.Transpose.TRANSPOSE,
          6: Image.Transpose.ROTATE_90, 7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}  # fmt: skip


def stored(pixels: np.ndarray, fmt: str, orientation: int) -> bytes:
    out = io.BytesIO()
    img = Image.fromarray(pixels)
    if orientation == 1:
        img.save(out, fmt, quality=95) if fmt == "JPEG" else img.save(out, fmt)
        return out.getvalue()
    exif = Image.Exif()
    exif[0x0112] = orientation
    img.transpose(STORED[orientation]).save(out, fmt, exif=exif.tobytes())
    return out.getvalue()


@pytest.mark.parametrize(
    ("height", "width", "fmt", "orientation"),
    [(90, 160, "PNG", 1), (90, 160, "PNG", 6), (90, 160, "JPEG", 8), (160, 90, "WEBP", 3), (160, 90, "PNG", 5),
     (120, 100, "PNG", 7), (120, 100, "JPEG", 2), (3000, 4000, "JPEG", 1), (4000, 3000, "JPEG", 6)],
)  # fmt: skip
@pytest.mark.parametrize("resize", ["letterbox", "stretch", "center_crop"])
def test_decoded_images_carry_their_transform(height: int, width: int, fmt: str, orientation: int, resize: str) -> None:
    """An upright image's bright rectangle, found in the preprocessed input and mapped back with the transform, lands
    where it was drawn: EXIF turned, JPEG draft decoded (4000 px) or not."""
    box = (width // 4, height // 3, width * 3 // 5, height * 4 // 5)
    pixels = np.full((height, width, 3), 10, np.uint8)
    pixels[box[1] : box[3], box[0] : box[2]] = 250
    arr, t = decode_transformed(open_image(stored(pixels, fmt, orientation)), spec_of(resize))
    assert (t.width, t.height) == (width, height)
    bright = arr.mean(0) > 130
    ys, xs = np.nonzero(bright)
    found = np.array([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1, 1, 0]], np.float32)
    back = to_original(found, t)[0, :4]
    seen = to_original(np.array([[0, 0, 64, 48, 1, 0]], np.float32), t)[0, :4]  # a centre crop cuts the image
    expected = np.clip(np.array(box, np.float32), np.tile(seen[:2], 2), np.tile(seen[2:], 2))
    slack = 1.5 / min(t.scale_x, t.scale_y)
    assert np.abs(back - expected).max() <= slack, (back, expected)


def test_an_image_without_exif_is_untouched_and_a_one_channel_letterbox_pads() -> None:
    pixels = np.zeros((10, 40, 3), np.uint8)
    arr, t = decode_transformed(open_image(stored(pixels, "PNG", 1)), spec_of("letterbox", channels=1))
    assert arr.shape == (1, 48, 64) and t == Transform(40, 10, 64 / 40, 16 / 10, 0.0, 16.0)
    assert (arr[0, :16] == 114).all() and (arr[0, 16:32] == 0).all() and (arr[0, 32:] == 114).all()


@pytest.mark.parametrize("agnostic", [False, True])
def test_a_handful_of_rows_is_suppressed_as_the_plain_reference_does(agnostic: bool) -> None:
    """Few rows above the threshold (a trained head's usual answer) take a plain loop, not the matrix: the same
    answers on many small overlapping sets."""
    rng = np.random.default_rng(3)
    options = DetectOptions(class_agnostic=agnostic, iou_threshold=0.4)
    for _ in range(500):
        k = int(rng.integers(2, 13))
        xy = rng.uniform(0, 40, (k, 2))
        wh = rng.uniform(5, 30, (k, 2))
        rows = np.concatenate([xy, xy + wh, rng.uniform(0.3, 1, (k, 1)), rng.integers(0, 3, (k, 1))], axis=1)
        rows = rows.astype(np.float32)
        np.testing.assert_array_equal(suppress(rows, options), rows[reference_nms(rows, options)])
