"""The Python client of visionserve's image API, and the ``visionserve classify`` and ``visionserve detect``
commands.

::

    from service.client import Client

    with Client("http://127.0.0.1:8000", model="digits") as client:
        for result in client.classify(["a.png", "b.jpg"], top_k=3):
            print(result.top1.label if result.ok else result.error)

``detect`` is the same for a detector: one :class:`DetectedImage` per image (``width``, ``height``, ``detections``
of :class:`~service.core.answers.Detection`, or ``error``). :class:`AsyncClient` is the same for asyncio.
Importing this package loads neither torch nor any server code.
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
