"""What a model version's engine reports about itself: readiness, devices and fallback (metadata, metrics)."""

from __future__ import annotations

from typing import Literal

import msgspec

State = Literal["READY", "DEGRADED", "FAILED"]


class EngineState(msgspec.Struct, frozen=True, kw_only=True):
    """What readiness, model metadata and metrics report about a model's engine."""

    state: State
    backend: str
    devices: tuple[str, ...]
    precision: str
    note: str | None = None
    fallbacks: int = 0
