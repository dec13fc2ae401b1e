"""What each image route is to the client: its route, its result type and its query (:class:`Kind`), so that
``classify`` and ``detect`` share one path in the client and in ``visionserve classify`` / ``detect``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypedDict, TypeVar, Unpack

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


class DetectQuery(TypedDict, total=False):
    """The detect route's options, as keywords of ``detect()``: ``score_threshold`` (0.25), ``iou_threshold``,
    ``max_detections`` (100), ``classes`` (labels or indices to keep), ``class_agnostic``, ``box_format``
    (``"xyxy"``) and ``normalized`` (False). ``iou_threshold`` and ``class_agnostic`` go only when given (the
    server's defaults are 0.45 and false), since a detector whose graph suppresses its own boxes refuses them."""

    score_threshold: float
    iou_threshold: float | None
    max_detections: int
    classes: Sequence[str | int] | None
    class_agnostic: bool | None
    box_format: BoxFormat
    normalized: bool


def detect_query(**options: Unpack[DetectQuery]) -> dict[str, Any]:
    """The detect route's query for these options (the server checks them: a bad one is its 400); TypeError on a
    keyword that is none of them, as a misspelt keyword argument gets."""
    unknown = sorted(options.keys() - DetectQuery.__optional_keys__)
    if unknown:
        raise TypeError(f"detect() got an unexpected keyword argument {unknown[0]!r}")
    query: dict[str, Any] = {
        "score_threshold": options.get("score_threshold", 0.25), "max_detections": options.get("max_detections", 100),
        "box_format": options.get("box_format", "xyxy"), "normalized": options.get("normalized", False),
    }  # fmt: skip
    for key in ("iou_threshold", "class_agnostic"):
        if options.get(key) is not None:
            query[key] = options[key]
    if (classes := options.get("classes")) is not None:
        query["classes"] = [str(c) for c in classes]
    return query


def answer_of(body: bytes, kind: Kind[R]) -> _Answer[R]:
    """An image route's 200 body, read into ``kind``'s result type (msgspec.DecodeError when it is not one)."""
    return msgspec.json.decode(body, type=_Answer[kind.result])  # type: ignore[name-defined]
