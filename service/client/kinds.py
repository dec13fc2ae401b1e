"""What each image route is to the client: its task (the route, and the query generated from the task's options)
and its result type (:class:`Kind`), so that ``classify`` and ``detect`` share one path in the client and in
``visionserve classify`` / ``detect``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec

from service.core.answers import DetectResult, ImageResult
from service.core.tasks import Classify, Detect, Segment, Task
from service.core.tasks.options import as_query
from service.core.tasks.segment import SegmentResult


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


class SegmentedImage(SegmentResult, kw_only=True, omit_defaults=True):
    """One image's answer from a segmenter (its ``width``, ``height`` and ``instances``, each a box and a mask, or
    its ``error``), with the ``model`` and ``version`` that answered copied on."""

    model: str | None = None
    version: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.instances is not None


R = TypeVar("R", ImageResult, DetectedImage, SegmentedImage)


class _Answer(msgspec.Struct, Generic[R]):
    """An image route's answer (``ClassifyResponse``, ``DetectResponse``), read into the client's result type."""

    model: str
    version: int
    results: list[R]


@dataclass(frozen=True, slots=True)
class Kind(Generic[R]):
    """What one image route is to the client: its task (the route's last part is its name), its result type."""

    task: type[Task]
    result: type[R]

    @property
    def action(self) -> str:
        return self.task.name

    def query(self, options: dict[str, Any]) -> dict[str, Any]:
        """The route's query for the keyword arguments ``options`` (the task's options; the server checks their
        values): TypeError on a keyword that is none of them, as a misspelt keyword argument gets."""
        return as_query(self.task.Options, options, self.action)


CLASSIFY = Kind(Classify, ImageResult)
DETECT = Kind(Detect, DetectedImage)
SEGMENT = Kind(Segment, SegmentedImage)


def answer_of(body: bytes, kind: Kind[R]) -> _Answer[R]:
    """An image route's 200 body, read into ``kind``'s result type (msgspec.DecodeError when it is not one)."""
    return msgspec.json.decode(body, type=_Answer[kind.result])  # type: ignore[name-defined]
