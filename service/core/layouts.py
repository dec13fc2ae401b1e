"""What a detector's graph answers (its spec's ``output_layout``), read into one form: each image's candidate rows
``[K, 6]`` (x1, y1, x2, y2 in input pixels, score, class), which the server then suppresses or, for a graph that
suppressed them itself (``end2end``, ``efficientnms``), only selects. numpy only: the serving install has no torch.
Each layout's outputs are tabled in docs/detection.md (``yolo-seg``, a ``yolo`` head followed by P mask
coefficients an anchor, then the prototypes ``[N, P, h, w]``: docs/tasks.md).

:func:`check_outputs` holds a graph's real output shapes to its layout (the export's refusal names what does not
fit); :func:`image_rows` reads a computed batch, dropping rows under the score threshold before building them (a
YOLO head's 8,400 anchors leave a few hundred).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, Literal

import numpy as np

from service.core.boxes import Suppression, select, suppress
from service.core.errors import ConfigError

Layout = Literal["candidates", "yolo", "yolov5", "end2end", "efficientnms", "yolo-seg"]
LAYOUTS: Final[tuple[Layout, ...]] = ("candidates", "yolo", "yolov5", "end2end", "efficientnms", "yolo-seg")
SUPPRESSED_BY_GRAPH: Final = ("end2end", "efficientnms")  # the server only thresholds and selects these
EFFICIENT_NMS: Final = ("num_dets", "det_boxes", "det_scores", "det_classes")
Shape = Sequence[int | str | None]  # a dimension may be symbolic (ONNX) or unknown


def suppresses(layout: str | None) -> bool:
    """Whether the server suppresses this layout's rows (False: the graph did)."""
    return layout not in SUPPRESSED_BY_GRAPH


def _known(dim: int | str | None) -> int | None:
    return dim if isinstance(dim, int) and dim > 0 else None


def yolo_channels_first(shape: Shape, width: int) -> bool:
    """Whether a YOLO output of ``shape`` ``[N, a, b]`` holds its ``width`` values per anchor on axis 1 (the
    ultralytics default, also taken when both axes are ``width``), else on axis 2; refused when neither is."""
    a, b = (_known(d) for d in shape[1:3])
    if a == width:
        return True
    if b == width:
        return False
    raise ConfigError(f"neither axis 1 nor axis 2 of its output {list(shape)} is {width} values per anchor")


def check_outputs(layout: Layout, outputs: Mapping[str, Shape], num_classes: int) -> None:
    """Refuse a graph whose outputs (name -> shape, batch first) do not fit ``layout`` with ``num_classes``
    labels, naming what does not fit."""
    names = list(outputs)

    def one(rank: int) -> Shape:
        if len(names) != 1:
            raise ConfigError(f"output_layout {layout} takes one output, the graph has {len(names)}: {names}")
        shape = outputs[names[0]]
        if len(shape) != rank:
            raise ConfigError(f"output_layout {layout} takes a rank-{rank} output, {names[0]} is {list(shape)}")
        return shape

    try:
        if layout in ("candidates", "end2end"):
            shape = one(3)
            if _known(shape[2]) != 6:
                raise ConfigError(f"rows of 6 (x1, y1, x2, y2, score, class) on axis 2, got {list(shape)}")
        elif layout in ("yolo", "yolov5"):
            width = num_classes + (4 if layout == "yolo" else 5)
            yolo_channels_first(one(3), width)
        elif layout == "yolo-seg":
            head, protos = (outputs[name] for name in seg_outputs(outputs))
            if _known(head[1]) != 4 + num_classes + (_known(protos[1]) or 0):
                raise ConfigError(f"axis 1 of {list(head)} must be 4 + classes + the prototypes' {protos[1]}")
        else:
            missing = [n for n in EFFICIENT_NMS if n not in outputs]
            if missing:
                raise ConfigError(f"outputs {', '.join(EFFICIENT_NMS)} are needed; missing {missing} of {names}")
            if _known(outputs["det_boxes"][-1]) != 4:
                raise ConfigError(f"det_boxes must end in 4 coordinates, is {list(outputs['det_boxes'])}")
    except ConfigError as exc:
        labels = f"{num_classes} labels"
        raise ConfigError(f"the graph's outputs do not fit output_layout {layout} ({labels}): {exc}") from None


def image_rows(
    layout: str | None, outputs: Mapping[str, np.ndarray], num_classes: int, score_threshold: float = 0.0
) -> list[np.ndarray]:
    """Each image's candidate rows ``[K, 6]`` float32 of a computed batch, those scoring under
    ``score_threshold`` left out."""
    if layout == "efficientnms":
        return _efficient_nms(outputs, score_threshold)
    if layout == "yolo-seg":
        heads = outputs[seg_outputs(outputs)[0]]
        return [anchor_rows(head[: 4 + num_classes], num_classes, score_threshold)[0] for head in heads]
    out = next(iter(outputs.values()))
    if layout in ("yolo", "yolov5"):
        return [_yolo(image, layout, num_classes, score_threshold) for image in out]
    return [_above(np.asarray(image, dtype=np.float32).reshape(-1, 6), score_threshold) for image in out]


def _above(rows: np.ndarray, threshold: float) -> np.ndarray:
    return rows[rows[:, 4] >= threshold] if threshold > 0 else rows


def _yolo(image: np.ndarray, layout: str, num_classes: int, threshold: float) -> np.ndarray:
    width = num_classes + (4 if layout == "yolo" else 5)
    first = yolo_channels_first((0, *image.shape), width)
    values = np.asarray(image if first else image.T, dtype=np.float32)  # [width, A]
    return anchor_rows(values, num_classes, threshold, objectness=layout == "yolov5")[0]


def anchor_rows(
    values: np.ndarray, num_classes: int, threshold: float, objectness: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A YOLO head's ``values`` ``[width, A]`` (box, [objectness,] class scores) as rows, those scoring under
    ``threshold`` left out, and the anchor each row came from (a segmenter's coefficients are the anchor's)."""
    values = np.asarray(values, dtype=np.float32)
    classes = values[len(values) - num_classes :]
    score = classes.max(axis=0)  # the best class's score; its index only for the anchors kept (a fraction)
    if objectness:
        score *= values[4]
    keep = np.flatnonzero(score >= threshold) if threshold > 0 else np.arange(len(score))
    cx, cy, w, h = values[:4, keep]
    rows = np.empty((len(keep), 6), dtype=np.float32)
    rows[:, 0], rows[:, 1] = cx - w / 2, cy - h / 2
    rows[:, 2], rows[:, 3] = cx + w / 2, cy + h / 2
    rows[:, 4], rows[:, 5] = score[keep], classes[:, keep].argmax(axis=0)
    return rows, keep


def seg_outputs(outputs: Mapping[str, Any]) -> tuple[str, str]:
    """The names of a ``yolo-seg`` graph's head (rank 3) and prototypes (rank 4), whatever their names or order
    (``outputs``: name -> an array or a shape)."""
    ranks = {name: len(getattr(value, "shape", value)) for name, value in outputs.items()}
    heads = [n for n, r in ranks.items() if r == 3]
    protos = [n for n, r in ranks.items() if r == 4]
    if len(outputs) != 2 or len(heads) != 1 or len(protos) != 1:
        raise ConfigError(f"a rank-3 head and rank-4 prototypes are needed, the graph has {ranks}")
    return heads[0], protos[0]


def _efficient_nms(outputs: Mapping[str, np.ndarray], threshold: float) -> list[np.ndarray]:
    counts = np.asarray(outputs["num_dets"]).reshape(len(outputs["num_dets"]), -1)[:, 0]
    boxes, scores, classes = outputs["det_boxes"], outputs["det_scores"], outputs["det_classes"]
    sizes = np.clip(counts.astype(np.int64), 0, boxes.shape[1]).tolist()
    return [
        _above(np.column_stack((boxes[i, :n], scores[i, :n], classes[i, :n])).astype(np.float32), threshold)
        for i, n in enumerate(sizes)
    ]


def top_rows(rows: list[np.ndarray], k: int) -> np.ndarray:
    """``[N, k, 6]``: each image's ``k`` best rows, best first, padded with zero rows (the parity gate compares
    fixed shapes; a zero row scores under any threshold it vouches for)."""
    out = np.zeros((len(rows), k, 6), dtype=np.float32)
    for i, image in enumerate(rows):
        best = image[np.argsort(-image[:, 4], kind="stable")[:k]]
        out[i, : len(best)] = best
    return out


def keep(layout: str | None, rows: np.ndarray, options: Suppression) -> np.ndarray:
    """One image's rows as the server keeps them: suppressed with ``options``, or, where the graph suppressed them
    itself, only selected (every path: the image API, v2, streams, the in-process client)."""
    if suppresses(layout):
        return suppress(rows, options)
    return select(rows, options.score_threshold, options.classes, options.max_detections)
