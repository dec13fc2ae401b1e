"""What a model version's engine reports about itself: readiness, devices and fallback (metadata, metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np

from service.core.errors import VisionServeError

# READY and DEGRADED (serving from the CPU fallback) serve and report ready, as does AVAILABLE (an on-demand model
# not resident now: its next request loads it); UNHEALTHY (its last batches all failed), REPLACING (a stuck
# instance's replacement is loading; requests queue) and FAILED (no instance left) report not ready.
State = Literal["READY", "DEGRADED", "UNHEALTHY", "REPLACING", "FAILED", "AVAILABLE"]
SERVING_STATES = ("READY", "DEGRADED", "AVAILABLE")


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    """What readiness, model metadata and metrics report about a model's engine."""

    state: State
    backend: str
    devices: tuple[str, ...]
    precision: str
    ungated: bool = False  # an INT8 artifact written with --int8-ungated: its agreement with fp32 unproven
    note: str | None = None
    fallbacks: int = 0
    replaced: int = 0  # stuck instances abandoned and replaced
    # Many models per device (service/engine/ondemand.py): loaded at start and kept ("pinned"), or on demand; in
    # memory now or not (and why not); what it was charged to its device's memory budget.
    residency: str = "pinned"
    resident: bool = True
    resident_bytes: int = 0
    resident_bytes_estimated: bool = False
    why_not_resident: str | None = None


LOGITS_OUTPUT = "logits"


class OutputInfo(msgspec.Struct, frozen=True, array_like=True):
    """One named output of a model, as its runtime learned it at load: ``dtype`` a numpy dtype name (``float32``,
    ``int64``), ``shape`` the shape of one image's part (the batch dimension left out; fixed per model, any rank)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def empty(self, n: int) -> np.ndarray:
        """Zeros for ``n`` images: the rows of images that fail stay zero."""
        return np.zeros((n, *self.shape), dtype=self.dtype)


def classification_outputs(num_classes: int) -> tuple[OutputInfo, ...]:
    """A classifier's one output, as exported (``export/artifacts.py`` names it ``logits``): float32 per class."""
    return (OutputInfo(LOGITS_OUTPUT, "float32", (num_classes,)),)


@dataclass
class InferResult:
    """A request's answer, on either side of the transport: each named output of the model, batch-first in the
    model's order (rows of failed images are zero), and each image's own error, if any."""

    outputs: dict[str, np.ndarray]
    errors: list[VisionServeError | None]
    queue_s: float = 0.0
    compute_s: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)
    # The batcher's ``time.monotonic()`` stamps (the last batch, for a split request): queued, an instance free for
    # the batch, the batch dispatched, the answer complete. 0.0 where a result did not come from a batcher.
    received: float = 0.0
    instance: float = 0.0
    batch: float = 0.0
    done: float = 0.0
    cold_start_s: float = 0.0  # waited for the model's load (an on-demand model's first request, or a miss)
    version: int = 0  # the version that answered, where it is not the one asked (a canary's candidate); 0: that one

    @property
    def logits(self) -> np.ndarray:
        """The first output: a classifier's logits ``[N, classes]`` (its only output)."""
        return next(iter(self.outputs.values()))
