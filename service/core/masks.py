"""Instance masks in the image's own pixels, and their encodings (COCO's compressed RLE, polygons, PNG). numpy only.

:func:`instance_masks` brings a segmenter's masks (an instance's coefficients times the prototypes, on the grid of
the model's input) to the original image in one bilinear resampling through the image's
:class:`~service.core.boxes.Transform`, never two (letterbox, then original), so the edges land where ultralytics'
``scale_masks`` puts them; only the instance's box is filled. :func:`rle` writes exactly what
``pycocotools.mask.decode`` reads, from the box's region alone, never from a full-size array. What each protocol
answers: docs/tasks.md, "Segmentation".
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.core.boxes import Transform


@dataclass(frozen=True, slots=True)
class Mask:
    """One instance's mask in the image's own pixels: ``region`` (bool ``[y2 - y1, x2 - x1]``) at ``x1``, ``y1`` of
    an image ``width`` x ``height``; every pixel outside the region is 0. ``area``: its pixels (counted if not
    given)."""

    region: np.ndarray
    x1: int
    y1: int
    width: int
    height: int
    area: int = -1

    def __post_init__(self) -> None:
        if self.area < 0:
            object.__setattr__(self, "area", int(self.region.sum()))


def _weights(coords: np.ndarray, size: int, cells: np.ndarray) -> np.ndarray:
    """``[..., n, k]``: the bilinear weights sampling a grid of ``size`` cells at ``coords`` ``[..., n]`` (cell
    units, a cell's centre at i + 0.5; beyond the edges the edge cell, as align_corners=False upsampling does), for
    the consecutive ``cells`` ``[..., k]`` alone (every weight of the coords among them)."""
    x = np.clip(coords - 0.5, 0, size - 1)
    low = np.floor(x)
    frac = (x - low).astype(np.float32)
    k = cells.shape[-1]
    low = low.astype(np.int64) - cells[..., :1]
    high = np.clip(np.minimum(low + 1, size - 1 - cells[..., :1]), 0, k - 1)  # past the cells: padding, unread
    low = np.clip(low, 0, k - 1)
    w = np.zeros((*coords.shape, k), dtype=np.float32)
    flat, base = w.reshape(-1), np.arange(coords.size).reshape(coords.shape) * k
    flat[base + low] = 1 - frac  # one (row, cell) pair each: += on a fancy index adds once, as wanted
    flat[base + high] += frac
    return w


_CHUNK_PIXELS = 1 << 22  # instances resampled together, each padded to the largest box, hold at most this many


def instance_masks(
    coefficients: np.ndarray, protos: np.ndarray, boxes: np.ndarray, where: list[Transform],
    input_size: tuple[int, int], image: np.ndarray | None = None,
) -> list[Mask]:  # fmt: skip
    """Each instance's mask, its logits ``coefficients`` ``[M, P]`` times the ``protos`` ``[N, P, h, w]`` of its
    ``image`` (``[M]``, all 0 by default) covering the model's input, cropped to its box (``boxes`` ``[M, 4]``, in
    the image's own pixels: ``where``, a transform an instance), in the image's own pixels. All at once, whatever
    their images: each instance's logits on the grid cells its box's rows and columns touch alone, its weights for
    them, boxes of like sizes padded to the largest, then batched products (a dozen calls an instance took more
    than the forward of digits-segment, and the logits of the whole grid 15 ms for 30 instances at 640,
    2026-11-28)."""
    coefficients = np.asarray(coefficients, dtype=np.float32)
    protos = np.asarray(protos, dtype=np.float32)
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    image = np.zeros(len(boxes), dtype=np.int64) if image is None else np.asarray(image)
    if not len(boxes):
        return []
    count, grid_h, grid_w = protos.shape[1:]
    in_w, in_h = input_size
    image_w, image_h = (np.array([getattr(t, k) for t in where], dtype=np.int64) for k in ("width", "height"))
    scale = np.array([(t.scale_x, t.scale_y) for t in where], dtype=np.float64).reshape(-1, 2)
    pad = np.array([(t.pad_x, t.pad_y) for t in where], dtype=np.float64).reshape(-1, 2)
    x1 = np.floor(np.maximum(boxes[:, 0], 0)).astype(np.int64)
    y1 = np.floor(np.maximum(boxes[:, 1], 0)).astype(np.int64)
    w = np.maximum(np.ceil(np.minimum(boxes[:, 2], image_w)).astype(np.int64) - x1, 0)
    h = np.maximum(np.ceil(np.minimum(boxes[:, 3], image_h)).astype(np.int64) - y1, 0)
    w[h == 0], h[w == 0] = 0, 0
    out: list[Mask] = [None] * len(boxes)  # type: ignore[list-item]
    for part in _chunks(h, w):
        pw, ph = max(int(w[part].max()), 1), max(int(h[part].max()), 1)
        # Each pixel's centre (past the box: masked below), in the input's pixels, then in the grid's cells.
        xs = ((x1[part, None] + np.arange(pw) + 0.5) * scale[part, :1] + pad[part, :1]) * (grid_w / in_w)
        ys = ((y1[part, None] + np.arange(ph) + 0.5) * scale[part, 1:] + pad[part, 1:]) * (grid_h / in_h)
        cx, cy = _touched(xs, w[part], grid_w), _touched(ys, h[part], grid_h)
        m, p = len(part), np.arange(count)[None, :, None, None]
        window = protos[image[part, None, None, None], p, cy[:, None, :, None], cx[:, None, None, :]]  # [m, P, ch, cw]
        window = (coefficients[part, None, :] @ window.reshape(m, count, -1)).reshape(m, cy.shape[1], cx.shape[1])
        sampled = _weights(ys, grid_h, cy) @ window @ _weights(xs, grid_w, cx).transpose(0, 2, 1)
        inside = sampled >= 0  # sigmoid >= 0.5; NaN is never >= 0
        inside &= (np.arange(ph) < h[part, None])[:, :, None] & (np.arange(pw) < w[part, None])[:, None, :]
        areas = np.count_nonzero(inside, axis=(1, 2)).tolist()
        for k, i in enumerate(part.tolist()):
            out[i] = Mask(inside[k, : h[i], : w[i]], int(x1[i]), int(y1[i]), int(image_w[i]), int(image_h[i]), areas[k])
    return out


def _touched(coords: np.ndarray, extent: np.ndarray, size: int) -> np.ndarray:
    """``[m, k]``: the grid cells (of ``size``) the first ``extent`` of each row of ``coords`` take weights from,
    as many for every row (the most any needs), inside the grid."""
    x = np.clip(coords - 0.5, 0, size - 1)
    first = np.floor(x[:, 0]).astype(np.int64)
    last = np.minimum(np.floor(x[np.arange(len(x)), np.maximum(extent - 1, 0)]).astype(np.int64) + 1, size - 1)
    k = max(int((last - first).max(initial=0)) + 1, 1)
    return np.minimum(first, size - k)[:, None] + np.arange(k)


def _chunks(h: np.ndarray, w: np.ndarray) -> list[np.ndarray]:
    """The instances' indices in groups of like sizes (largest first), each padded to its largest box at most
    doubling its pixels and holding at most :data:`_CHUNK_PIXELS` (one alone may hold more). Padding every box of
    a batch of digits-segment's to the largest made two pixels of three padding (2026-11-28)."""
    groups: list[list[int]] = []
    tallest = widest = area = 0
    for i in np.argsort(-(h * w), kind="stable").tolist():
        t, v, a = max(tallest, int(h[i])), max(widest, int(w[i])), area + int(h[i] * w[i])
        if not groups or (len(groups[-1]) + 1) * t * v > min(_CHUNK_PIXELS, 2 * a):
            groups.append([])
            t, v, a = int(h[i]), int(w[i]), int(h[i] * w[i])
        groups[-1].append(i)
        tallest, widest, area = t, v, a
    return [np.asarray(g, dtype=np.int64) for g in groups]


_STRIP_PIXELS = 1 << 20  # a semantic map is resampled this many image pixels at a time, a class's logits each


def class_masks(
    logits: np.ndarray, where: Transform, input_size: tuple[int, int], wanted: tuple[int, ...] | None = None
) -> list[tuple[int, Mask]]:
    """A semantic model's answer for one image: each class that wins some pixel, with its mask in the image's own
    pixels. ``logits`` ``[C, h, w]`` cover the model's input (``input_size``); each image pixel's centre is taken to
    the logits' grid as :func:`instance_masks` takes it, the logits of the classes that win somewhere on the grid
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
    across = _weights(xs, grid_w, np.arange(grid_w)).T
    best = np.empty((where.height, where.width), dtype=np.int32)
    rows = max(1, _STRIP_PIXELS // max(1, where.width))
    candidates = winners.astype(np.int64)
    for top in range(0, where.height, rows):
        ys = ((np.arange(top, min(top + rows, where.height)) + 0.5) * where.scale_y + where.pad_y) * (grid_h / in_h)
        down = _weights(ys, grid_h, np.arange(grid_h))
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
    return rles([mask])[0]


def rles(masks: list[Mask]) -> list[dict[str, object]]:
    """:func:`rle` of each of ``masks``, all at once: their runs found and written in a few calls for them all (a
    dozen calls a mask took a quarter of a segmenter's answer, 2026-11-28)."""
    if not masks:
        return []
    n = len(masks)
    x1, y1, h, w = (np.array([getattr(m, k) for m in masks], dtype=np.int64) for k in ("x1", "y1", "height", "width"))
    # Column-major, one mask after another in one buffer: each column of a region with a 0 above and below; a change
    # marks a run's edge.
    tall = np.array([m.region.shape[0] for m in masks], dtype=np.int64) + 2
    size = np.array([m.region.shape[1] for m in masks], dtype=np.int64) * tall
    begin = np.cumsum(size) - size
    flat = np.zeros(int(size.sum()) + 1, dtype=bool)
    for m, a, b, t in zip(masks, begin.tolist(), (begin + size).tolist(), tall.tolist(), strict=True):
        flat[a:b].reshape(-1, t)[:, 1:-1] = m.region.T
    at = np.flatnonzero(flat[1:] != flat[:-1])
    which = np.searchsorted(begin + size, at, side="right")
    col, row = np.divmod(at - begin[which], tall[which])
    edges = (x1[which] + col) * h[which] + y1[which] + row
    # A run ending at one column's foot and the next starting at its head (of one mask) are one run.
    joined = np.flatnonzero((edges[1:-1:2] == edges[2::2]) & (which[1:-1:2] == which[2::2]))
    if len(joined):
        gone = np.concatenate([2 * joined + 1, 2 * joined + 2])
        edges, which = np.delete(edges, gone), np.delete(which, gone)
    # Each mask's edges between a 0 and its pixel count; the differences are its runs, the first of zeros.
    found = np.bincount(which, minlength=n)
    stop = np.cumsum(found)
    bounds = np.insert(
        edges, np.stack([stop - found, stop], axis=1).ravel(), np.stack([np.zeros(n, np.int64), h * w], 1).ravel()
    )
    counts = np.diff(bounds)
    owner = np.repeat(np.arange(n), found + 2)[:-1]
    keep = np.ones(len(counts), dtype=bool)
    last = np.cumsum(found + 2) - 2  # each mask's last run (the step into the next mask's 0 follows it)
    keep[last[:-1] + 1] = False
    keep[last[counts[last] == 0]] = False  # ending on a run of ones: no empty run of zeros after it
    counts, owner = counts[keep], owner[keep]
    return [
        {"size": [m.height, m.width], "counts": text}
        for m, text in zip(masks, _strings(counts, np.bincount(owner, minlength=n)), strict=True)
    ]


def _strings(counts: np.ndarray, lengths: np.ndarray) -> list[str]:
    """pycocotools' ``rleToString`` of each mask's counts (``counts`` one after another, ``lengths`` of each): each
    count (past a mask's second, less the count two before) in 5-bit groups, low first, each a character from 48
    with 0x20 set while more follow. Vectorised, a pass per group the largest needs; a Python loop over the
    characters took half of a segmenter's answer's time (digits-segment, 384 x 384 canvases, 2026-11-28)."""
    values = counts.astype(np.int64)
    place = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    later = np.flatnonzero(place > 2)
    values[later] -= counts[later - 2]
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
    text = chars[written].tobytes().decode()
    cuts = np.cumsum(np.bincount(np.repeat(np.arange(len(lengths)), lengths), written.sum(axis=1), len(lengths)))
    return [text[a:b] for a, b in zip([0, *cuts[:-1].astype(int).tolist()], cuts.astype(int).tolist(), strict=True)]


def encoded(masks: list[Mask], form: str) -> list[Any]:
    """Each of ``masks`` as ``form`` (``rle``, ``polygon`` or ``png``) writes it."""
    if form == "rle":
        return rles(masks)
    return [polygons(m) if form == "polygon" else png(m) for m in masks]


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
