"""What a classification gives back: typed records, the same shapes as the image API's answer."""

from __future__ import annotations

import msgspec

from service.core.errors import VisionServeError


class Prediction(msgspec.Struct, frozen=True):
    """One class for one image: its label, its index in the model's outputs, and its softmax score."""

    label: str
    index: int
    score: float


class ImageResult(msgspec.Struct, kw_only=True):
    """One image's answer: its top-k predictions (best first), or the reason it could not be classified."""

    predictions: list[Prediction] | None = None
    error: str | None = None
    filename: str | None = None
    model: str | None = None
    version: int | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.predictions is not None

    @property
    def top1(self) -> Prediction | None:
        return self.predictions[0] if self.predictions else None


class ClassifyResponse(msgspec.Struct):
    """The image API's answer to one request (``POST /v1/models/{m}/classify``)."""

    model: str
    version: int
    results: list[ImageResult]


class ClientError(VisionServeError):
    """A request the server refused as a whole, or that could not be sent within the retry policy.

    ``status`` is the HTTP status (None when no answer came: connection refused or dropped on every attempt).
    """

    def __init__(self, message: str, *, status: int | None = None, retries: int = 0) -> None:
        super().__init__(message)
        self.status = status
        self.retries = retries
