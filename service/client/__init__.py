"""The Python client of visionserve's image API (README, "Python client"), and the ``visionserve classify``,
``detect`` and ``segment`` commands. Importing this package loads neither torch nor any server code.
"""

from __future__ import annotations

from service.client.client import DEFAULT_MAX_IMAGES_PER_REQUEST, AsyncClient, Client
from service.client.errors import ClientError
from service.client.images import discover, sniff
from service.client.kinds import DetectedImage, SegmentedImage
from service.client.retry import RetryPolicy
from service.core.answers import ClassifyResponse, Detection, ImageResult, Prediction

__all__ = [
    "DEFAULT_MAX_IMAGES_PER_REQUEST",
    "AsyncClient",
    "ClassifyResponse",
    "Client",
    "ClientError",
    "DetectedImage",
    "Detection",
    "ImageResult",
    "Prediction",
    "RetryPolicy",
    "SegmentedImage",
    "discover",
    "sniff",
]
