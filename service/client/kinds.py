"""What each image route is to the client: its route, its result type and its query (:class:`Kind`), so that
``classify`` and ``detect`` share one path in the client and in ``visionserve classify`` / ``detect``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from service.core.answers import DetectResult, ImageResult
from service.core.boxes import BoxFormat


class DetectedImage(DetectResult, kw_only=True, omit_defaults=True):
    """One image's answer from a detector (:class:`~service.core.answers.DetectResult`: its ``width``, ``height``
    and ``detections``, or its ``error``), with the ``model`` and ``version`` that answered copied on, as
    :class:`ImageResult` has them, so that a result stands alone."""

    model: str | None = None
    version: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the image was read and searched (an image with no detections is ok)."""
        return self.error is None and self.detections is not None


R = TypeVar("R", ImageResult, DetectedImage)


class _Answer(msgspec.Struct, Generic[R]):
    """An image route's answer (``ClassifyResponse``, ``DetectResponse``), read into the client's result type."""

    model: str
    version: int
    results: list[R]


@dataclass(frozen=True, slots=True)
class Kind(Generic[R]):
    """What one image route is to the client: its ``action`` (the route's last part) and its result type."""

    action: str
    result: type[R]


CLASSIFY = Kind("classify", ImageResult)
DETECT = Kind("detect", DetectedImage)


def detect_query(
    *,
    score_threshold: float = 0.25,
    iou_threshold: float | None = None,
    max_detections: int = 100,
    classes: Sequence[str | int] | None = None,
    class_agnostic: bool | None = None,
    box_format: BoxFormat = "xyxy",
    normalized: bool = False,
) -> dict[str, Any]:
    """The detect route's query for these options (the server checks them: a bad one is its 400). The suppression's
    own options go only when given: a detector whose graph suppresses its boxes refuses them."""
    query: dict[str, Any] = {
        "score_threshold": score_threshold, "max_detections": max_detections, "box_format": box_format,
        "normalized": normalized,
    }  # fmt: skip
    if iou_threshold is not None:
        query["iou_threshold"] = iou_threshold
    if class_agnostic is not None:
        query["class_agnostic"] = class_agnostic
    if classes is not None:
        query["classes"] = [str(c) for c in classes]
    return query


def answer_of(body: bytes, kind: Kind[R]) -> _Answer[R]:
    """An image route's 200 body, read into ``kind``'s result type (msgspec.DecodeError when it is not one)."""
    return msgspec.json.decode(body, type=_Answer[kind.result])  # type: ignore[name-defined]
