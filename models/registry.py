"""The architecture registry: a name maps to a keyword-only builder and a default :class:`ModelSpec`.

Builders follow torchvision's pattern: ``builder(*, num_classes=...) -> nn.Module``. The spec carries the
preprocessing and labels that travel with the weights. Registering a name twice is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from torch import nn

from service.core.errors import ConfigError, UnknownNameError
from service.core.spec import InputSpec, ModelSpec

Builder = Callable[..., nn.Module]


@dataclass(frozen=True)
class Architecture:
    """One registered architecture: how to build it and what it expects by default."""

    name: str
    builder: Builder
    spec: ModelSpec
    description: str
    # What its forward answers: classifiers logits [N, classes]; detectors [N, K, 6] rows, candidates before
    # suppression (models/detector.py) or torchvision's suppressed ones (models/tv_detectors.py: its spec's
    # output_layout says which). `train` picks its loop by it.
    task: str = "classify"  # a name of service.core.tasks

    def build(self, *, num_classes: int | None = None) -> nn.Module:
        """A fresh model with initial weights (never downloaded)."""
        return self.builder(num_classes=num_classes or self.spec.num_classes)


def with_input_size(spec: ModelSpec, size: int) -> ModelSpec:
    """``spec`` at a square input of ``size``, its resize size scaled in the same proportion to the crop."""
    if size < 8:
        raise ConfigError(f"--input-size must be >= 8, got {size}")
    ratio = spec.resize_size / max(spec.input.height, spec.input.width)
    return msgspec.structs.replace(
        spec,
        input=InputSpec(channels=spec.input.channels, height=size, width=size),
        resize_size=max(size, round(size * ratio)),
    )


_REGISTRY: dict[str, Architecture] = {}


def register(name: str, *, spec: ModelSpec, description: str, task: str = "classify") -> Callable[[Builder], Builder]:
    """Decorator that registers a builder under ``name``; a duplicate name raises ``ValueError``."""

    def wrap(builder: Builder) -> Builder:
        if name in _REGISTRY:
            raise ValueError(f"architecture {name!r} is already registered")
        if spec.architecture != name:
            raise ValueError(f"spec.architecture {spec.architecture!r} does not match the name {name!r}")
        _REGISTRY[name] = Architecture(name=name, builder=builder, spec=spec, description=description, task=task)
        return builder

    return wrap


def architecture_names() -> list[str]:
    return sorted(_REGISTRY)


def get_architecture(name: str) -> Architecture:
    """The architecture called ``name``; an unknown name lists the valid ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown architecture {name!r}; choose one of: {', '.join(architecture_names())}"
        ) from None
