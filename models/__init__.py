"""The model zoo, datasets and training.

Importing this package registers every architecture (``models.zoo``, and torchvision's detectors:
``models.tv_detectors``).
"""

from __future__ import annotations

from models import tv_detectors as _tv_detectors  # noqa: F401  (registers torchvision's detectors)
from models import zoo as _zoo  # noqa: F401  (registers the architectures)
from models.normalize import Uint8Classifier, Uint8Normalize
from models.registry import Architecture, architecture_names, get_architecture, register

__all__ = [
    "Architecture",
    "Uint8Classifier",
    "Uint8Normalize",
    "architecture_names",
    "get_architecture",
    "register",
]
