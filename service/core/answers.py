"""What the image API answers (``POST /v1/models/{m}/classify``): the one set of types that the server encodes and
the client decodes, so the two cannot drift.

On the wire an :class:`ImageResult` holds only what is set (``omit_defaults``): ``predictions`` or ``error``, and
``filename`` when the image came as a named file.
"""

from __future__ import annotations

import msgspec


class Prediction(msgspec.Struct, frozen=True):
    """One class for one image: its label, its index in the model's outputs, and its softmax score."""

    label: str
    index: int
    score: float


class ImageResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image's answer: its top-k predictions (best first), or the reason it could not be classified.

    ``model`` and ``version`` are never sent (the answer names them once, in :class:`ClassifyResponse`): the client
    copies them onto each result so that a result stands alone."""

    predictions: list[Prediction] | None = None
    error: str | None = None
    filename: str | None = None
    model: str | None = None
    version: int | None = None

    @property
    def ok(self) -> bool:
        """Whether the image was classified."""
        return self.error is None and self.predictions is not None

    @property
    def top1(self) -> Prediction | None:
        """The best prediction, or None for an image that failed."""
        return self.predictions[0] if self.predictions else None


class ClassifyResponse(msgspec.Struct):
    """The image API's answer to one request: one result per image, in the order they were sent."""

    model: str
    version: int
    results: list[ImageResult]


class Detection(msgspec.Struct, frozen=True):
    """One object found in an image: its box (in the request's ``box_format``, in the image's own pixels or,
    ``normalized``, as fractions of its width and height), its class's label and index, and its score."""

    box: list[float]
    label: str
    index: int
    score: float


class DetectResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One image's answer from a detector: its size as a viewer shows it (EXIF orientation applied) and its
    detections, best first; or the reason it could not be read."""

    filename: str | None = None
    width: int | None = None
    height: int | None = None
    detections: list[Detection] | None = None
    error: str | None = None


class DetectResponse(msgspec.Struct):
    """The image API's answer to one detect request: one result per image, in the order they were sent."""

    model: str
    version: int
    results: list[DetectResult]
