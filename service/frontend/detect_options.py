"""A detection request's options, checked at the edge alike for the image API's query string and the v2
``parameters`` (HTTP JSON and gRPC): each refusal names the parameter, the value sent and what is allowed.

``classes`` names classes by label or by index; the v2 form also takes one string of them separated by commas,
since a gRPC ``InferParameter`` holds no list.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from service.core.boxes import BOX_FORMATS, BoxFormat, DetectOptions, class_indices
from service.core.errors import BadInputError, shown
from service.frontend.parameters import flag, integer

MAX_DETECTIONS: Final = 10_000  # the most a request may ask for: a cap on its answer's size
THRESHOLD: Final = "a number from 0 to 1"


def threshold(name: str, value: Any) -> float:
    """A score or IoU threshold: a number from 0 to 1 (a bool is not one; NaN fails the range)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not (0 <= value <= 1):
        raise BadInputError(f"{name} must be {THRESHOLD}, got {shown(value)}")
    return float(value)


def class_list(name: str, value: Any) -> list[Any] | tuple[Any, ...]:
    """``classes`` as a list (JSON's array; the query's repeated values): a number or a string alone is not one
    (a source's ``"classes": 0`` iterated as nothing, a TypeError, and stopped a server starting its sources)."""
    if not isinstance(value, list | tuple):
        raise BadInputError(f"{name} must be a list of class labels or indices, got {shown(value)}")
    return value


def box_format(name: str, value: Any) -> BoxFormat:
    if value not in BOX_FORMATS:
        raise BadInputError(f"{name} must be one of {', '.join(BOX_FORMATS)}, got {shown(value)}")
    return value


def detect_options(
    labels: tuple[str, ...],
    *,
    score_threshold: Any = 0.25,
    iou_threshold: Any = 0.45,
    max_detections: Any = 100,
    classes: Any = None,
    class_agnostic: Any = False,
    box_format_: Any = "xyxy",
    normalized: Any = False,
    where: str = "",
) -> DetectOptions:
    """The options, each checked; ``where``: the prefix of each parameter's name in a message (``parameters.``)."""
    named = f"{where}classes"
    return DetectOptions(
        score_threshold=threshold(f"{where}score_threshold", score_threshold),
        iou_threshold=threshold(f"{where}iou_threshold", iou_threshold),
        max_detections=integer(
            f"{where}max_detections", max_detections, 1, f"an integer from 1 to {MAX_DETECTIONS}", MAX_DETECTIONS
        ),
        classes=None if classes is None else class_indices(named, class_list(named, classes), labels),
        class_agnostic=flag(f"{where}class_agnostic", class_agnostic),
        box_format=box_format(f"{where}box_format", box_format_),
        normalized=flag(f"{where}normalized", normalized),
    )


def v2_options(params: Mapping[str, Any], labels: tuple[str, ...], default: DetectOptions) -> DetectOptions:
    """A v2 request's ``parameters``: ``score_threshold``, ``iou_threshold``, ``max_detections``, ``classes`` (a
    list, or one string separated by commas) and ``class_agnostic``; the rest is not the detector's. v2's
    ``DETECTIONS`` are xyxy in pixels always."""
    classes = params.get("classes")
    if isinstance(classes, str):
        classes = [c for c in classes.split(",") if c.strip()]
    elif classes is not None and not isinstance(classes, list):
        classes = [classes]
    return detect_options(
        labels,
        score_threshold=params.get("score_threshold", default.score_threshold),
        iou_threshold=params.get("iou_threshold", default.iou_threshold),
        max_detections=params.get("max_detections", default.max_detections),
        classes=classes,
        class_agnostic=params.get("class_agnostic", default.class_agnostic),
        where="parameters.",
    )
