"""Instance masks in the image's own pixels, and their encodings (COCO's compressed RLE, PNG). numpy only.

A segmenter answers each instance's mask at its own resolution (a YOLO-seg head: 32 coefficients an instance times
32 prototypes of 160 x 160, in the letterboxed input's frame). :func:`instance_mask` brings one to the original
image: each original pixel's centre is taken through the image's :class:`~service.core.boxes.Transform` to the
prototypes' grid and the mask's logit is sampled there bilinearly (separably: a weight matrix per axis), the sigmoid
thresholded at 0.5 (logit >= 0), and only the instance's box (in the image's own pixels) is filled: the mask never
extends past its box or the image. One resampling from the model's grid to the image, never two (letterbox, then
original), so the edges land where ultralytics' ``scale_masks`` puts them.

:func:`rle` writes COCO's compressed RLE of the full image (column-major runs, first a run of zeros, each count
written as pycocotools' ``rleToString`` writes it), exactly what ``pycocotools.mask.decode`` reads; it is built
from the box's region alone, never from a full-size array. :func:`polygons` traces the mask's pixel edges into
rings (COCO's polygon form, the outer rings, and its holes apart: a COCO polygon cannot hold one).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np

from service.core.boxes import Transform


@dataclass(frozen=True, slots=True)
class Mask:
    """One instance's mask in the image's own pixels: ``region`` (bool ``[y2 - y1, x2 - x1]``) at ``x1``, ``y1`` of
    an image ``width`` x ``height``; every pixel outside the region is 0."""

    region: np.ndarray
    x1: int
    y1: int
    width: int
    height: int

    @property
    def area(self) -> int:
        return int(self.region.sum())


def _weights(coords: np.ndarray, size: int) -> np.ndarray:
    """``[len(coords), size]`` bilinear weights sampling a grid of ``size`` cells at ``coords`` (cell units, a cell's
    centre at i + 0.5; beyond the edges the edge cell, as align_corners=False upsampling does)."""
    x = np.clip(coords - 0.5, 0, size - 1)
    low = np.floor(x).astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    frac = (x - low).astype(np.float32)
    w = np.zeros((len(coords), size), dtype=np.float32)
    rows = np.arange(len(coords))
    w[rows, low] = 1 - frac  # one (row, column) pair each: += on a fancy index adds once, as wanted
    w[rows, high] += frac
    return w


def instance_mask(logits: np.ndarray, box: np.ndarray, where: Transform, input_size: tuple[int, int]) -> Mask:
    """The mask of one instance whose ``logits`` ``[h, w]`` cover the model's input (``input_size``: its width and
    height), cropped to ``box`` (x1, y1, x2, y2 in the image's own pixels), in the image's own pixels."""
    grid_h, grid_w = logits.shape
    in_w, in_h = input_size
    x1, y1 = int(np.floor(max(box[0], 0))), int(np.floor(max(box[1], 0)))
    x2, y2 = int(np.ceil(min(box[2], where.width))), int(np.ceil(min(box[3], where.height)))
    if x2 <= x1 or y2 <= y1:
        return Mask(np.zeros((0, 0), dtype=bool), x1, y1, where.width, where.height)
    # Each original pixel's centre, in the input's pixels, then in the grid's cells.
    xs = ((np.arange(x1, x2) + 0.5) * where.scale_x + where.pad_x) * (grid_w / in_w)
    ys = ((np.arange(y1, y2) + 0.5) * where.scale_y + where.pad_y) * (grid_h / in_h)
    sampled = _weights(ys, grid_h) @ np.asarray(logits, dtype=np.float32) @ _weights(xs, grid_w).T
    return Mask(sampled >= 0, x1, y1, where.width, where.height)  # sigmoid >= 0.5; NaN is never >= 0


_STRIP_PIXELS = 1 << 20  # a semantic map is resampled this many image pixels at a time, a class's logits each


def class_masks(
    logits: np.ndarray, where: Transform, input_size: tuple[int, int], wanted: tuple[int, ...] | None = None
) -> list[tuple[int, Mask]]:
    """A semantic model's answer for one image: each class that wins some pixel, with its mask in the image's own
    pixels. ``logits`` ``[C, h, w]`` cover the model's input (``input_size``); each image pixel's centre is taken to
    the logits' grid as :func:`instance_mask` takes it, the logits of the classes that win somewhere on the grid
    are sampled there bilinearly, and the pixel goes to the highest (a partition of the image: every pixel one
    class, none two). ``wanted``: only these classes' masks (None: all)."""
    logits = np.asarray(logits, dtype=np.float32)
    _, grid_h, grid_w = logits.shape
    winners = np.unique(np.nan_to_num(logits, nan=-np.inf).argmax(axis=0))
    present = [int(c) for c in winners if wanted is None or int(c) in wanted]
    if not present:
        return []
    in_w, in_h = input_size
    xs = ((np.arange(where.width) + 0.5) * where.scale_x + where.pad_x) * (grid_w / in_w)
    across = _weights(xs, grid_w).T
    best = np.empty((where.height, where.width), dtype=np.int32)
    rows = max(1, _STRIP_PIXELS // max(1, where.width))
    candidates = winners.astype(np.int64)
    for top in range(0, where.height, rows):
        ys = ((np.arange(top, min(top + rows, where.height)) + 0.5) * where.scale_y + where.pad_y) * (grid_h / in_h)
        down = _weights(ys, grid_h)
        sampled = np.stack([down @ logits[c] @ across for c in candidates])
        best[top : top + len(ys)] = candidates[np.nan_to_num(sampled, nan=-np.inf).argmax(axis=0)]
    out = []
    for c in present:
        inside = best == c
        cols, lines = np.flatnonzero(inside.any(axis=0)), np.flatnonzero(inside.any(axis=1))
        if len(cols) == 0:
            continue  # won on the grid, but no image pixel's centre lies where it wins
        x1, x2, y1, y2 = int(cols[0]), int(cols[-1]) + 1, int(lines[0]), int(lines[-1]) + 1
        out.append((c, Mask(inside[y1:y2, x1:x2], x1, y1, where.width, where.height)))
    return out


def mask_ious(a: list[Mask], b: list[Mask]) -> np.ndarray:
    """Intersection over union of each mask of ``a`` with each of ``b`` (one image's): ``[len(a), len(b)]``, each
    pair counted over the overlap of their regions alone (0 where the regions do not meet)."""
    out = np.zeros((len(a), len(b)), dtype=np.float32)
    for i, m in enumerate(a):
        for j, n in enumerate(b):
            x1, y1 = max(m.x1, n.x1), max(m.y1, n.y1)
            x2 = min(m.x1 + m.region.shape[1], n.x1 + n.region.shape[1])
            y2 = min(m.y1 + m.region.shape[0], n.y1 + n.region.shape[0])
            if x2 <= x1 or y2 <= y1:
                continue
            mine = m.region[y1 - m.y1 : y2 - m.y1, x1 - m.x1 : x2 - m.x1]
            theirs = n.region[y1 - n.y1 : y2 - n.y1, x1 - n.x1 : x2 - n.x1]
            inter = int((mine & theirs).sum())
            union = m.area + n.area - inter
            out[i, j] = inter / union if union else 0.0
    return out


def rle(mask: Mask) -> dict[str, object]:
    """COCO's compressed RLE of the full image: ``{"size": [height, width], "counts": "..."}``."""
    h, w = mask.height, mask.width
    region = mask.region
    if region.size == 0 or not region.any():
        return {"size": [h, w], "counts": _string([h * w])}
    # Column-major: each column of the region padded with a 0 above and below; a change marks a run's edge.
    padded = np.zeros((region.shape[1], region.shape[0] + 2), dtype=np.int8)
    padded[:, 1:-1] = region.T
    col, row = np.nonzero(np.diff(padded, axis=1))
    edges = (mask.x1 + col) * h + mask.y1 + row
    if len(edges) > 2:  # a run ending at one column's foot and the next starting at its head are one run
        joined = np.flatnonzero(edges[1:-1:2] == edges[2::2])
        if len(joined):
            edges = np.delete(edges, np.concatenate([2 * joined + 1, 2 * joined + 2]))
    counts = np.diff(np.concatenate([[0], edges, [h * w]])).tolist()
    if counts[-1] == 0:  # ending on a run of ones: no empty run of zeros after it (as pycocotools writes it)
        counts.pop()
    return {"size": [h, w], "counts": _string(counts)}


def _string(counts: list[int]) -> str:
    """pycocotools' ``rleToString``: each count (past the second, less the count two before) in 5-bit groups, low
    first, each a character from 48 with 0x20 set while more follow. Vectorised over the counts, a pass per group
    the largest needs; a Python loop over the characters took half of a segmenter's answer's time (digits-segment,
    384 x 384 canvases, 2026-11-28)."""
    x = np.asarray(counts, dtype=np.int64)
    values = x.copy()
    values[3:] -= x[1:-2]
    groups = int(np.abs(values).max(initial=0)).bit_length() // 5 + 1  # enough for the largest, and its sign
    chars = np.zeros((len(values), groups), dtype=np.uint8)
    written = np.zeros((len(values), groups), dtype=bool)
    active = np.ones(len(values), dtype=bool)
    for k in range(groups):
        group = values & 0x1F
        values >>= 5  # arithmetic: a negative difference keeps its sign
        more = np.where(group & 0x10, values != -1, values != 0) & active
        chars[:, k] = group + 48 + 0x20 * more
        written[:, k] = active
        active = more
    return chars[written].tobytes().decode()


def png(mask: Mask) -> str:
    """The full-size mask as a base64 PNG (one bit a pixel, 1 inside the instance)."""
    from PIL import Image

    full = np.zeros((mask.height, mask.width), dtype=bool)
    r = mask.region
    full[mask.y1 : mask.y1 + r.shape[0], mask.x1 : mask.x1 + r.shape[1]] = r
    buffer = io.BytesIO()
    Image.fromarray(full).save(buffer, format="PNG", optimize=True)
    return base64.b64encode(buffer.getvalue()).decode()


_STEPS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # east, south, west, north: each the one before turned right (y down)


def polygons(mask: Mask) -> dict[str, list[list[float]]]:
    """The mask's outline: ``{"polygons": [[x, y, x, y, ...], ...], "holes": [...]}``, each ring the boundary of a
    4-connected part (``polygons``) or of a hole in one (``holes``) along the pixels' edges, in the image's pixel
    coordinates (a pixel (col, row) spans x from col to col + 1), a vertex where the edge turns: an outer ring
    clockwise as the image is shown (y down), a hole the other way round."""
    region = mask.region
    out: dict[str, list[list[float]]] = {"polygons": [], "holes": []}
    if region.size == 0 or not region.any():
        return out
    inside = np.pad(region, 1)
    starts: dict[tuple[int, int], list[int]] = {}
    edges: list[tuple[int, int, int]] = []  # x, y of the edge's start (in the padded frame), its direction
    # Each side of an inside pixel that borders an outside one, walked with the inside on its right.
    for direction, (dr, dc), (ox, oy) in ((0, (-1, 0), (0, 0)), (1, (0, 1), (1, 0)), (2, (1, 0), (1, 1)),
                                          (3, (0, -1), (0, 1))):  # fmt: skip
        rows, cols = np.nonzero(inside & ~np.roll(inside, (-dr, -dc), axis=(0, 1)))
        for r, c in zip(rows.tolist(), cols.tolist(), strict=True):
            starts.setdefault((c + ox, r + oy), []).append(len(edges))
            edges.append((c + ox, r + oy, direction))
    used = [False] * len(edges)
    for first in range(len(edges)):
        if used[first]:
            continue
        ring: list[tuple[int, int]] = []
        edge = first
        while not used[edge]:
            used[edge] = True
            x, y, d = edges[edge]
            ring.append((x, y))
            end = (x + _STEPS[d][0], y + _STEPS[d][1])
            # Where two edges leave a corner (pixels touching at it alone), the right turn: 4-connected parts.
            edge = min(starts[end], key=lambda e: (edges[e][2] - d) % 4 if edges[e][2] != (d + 2) % 4 else 4)
        corners = [p for i, p in enumerate(ring) if _turns(ring, i)]
        area = sum(a[0] * b[1] - b[0] * a[1] for a, b in zip(corners, corners[1:] + corners[:1], strict=True))
        flat = [float(v) for x, y in corners for v in (mask.x1 + x - 1, mask.y1 + y - 1)]
        out["polygons" if area > 0 else "holes"].append(flat)
    return out


def _turns(ring: list[tuple[int, int]], i: int) -> bool:
    """Whether the ring turns at its ``i``-th vertex (a straight run's inner vertices are left out)."""
    (ax, ay), (bx, by), (cx, cy) = ring[i - 1], ring[i], ring[(i + 1) % len(ring)]
    return (bx - ax) * (cy - by) != (by - ay) * (cx - bx)


def decoded(mask: dict[str, object]) -> np.ndarray:
    """The full-size bool array of a compressed RLE ``{"size": [h, w], "counts": "..."}`` (:func:`rle`'s inverse,
    pycocotools' ``rleFrString`` then its decode)."""
    h, w = (int(v) for v in mask["size"])  # type: ignore[attr-defined]
    text = str(mask["counts"])
    counts: list[int] = []
    i = 0
    while i < len(text):
        x, k, more = 0, 0, True
        while more:
            c = ord(text[i]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            i, k = i + 1, k + 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        counts.append(x + counts[-2] if len(counts) > 2 else x)
    flat = np.repeat(np.arange(len(counts)) % 2 == 1, counts)
    return flat.reshape(w, h).T if flat.size == h * w else np.zeros((h, w), dtype=bool)
