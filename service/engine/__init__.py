"""The engine process: the dynamic batcher, each model version's engine (devices, instances, fallback), and the
in-process ``bench``. Imports ``service.transport``, ``service.runtime`` and ``service.core``; never HTTP code.
"""

from __future__ import annotations

from service.engine.batcher import Batcher, BatcherConfig, InferRequest, InferResult

__all__ = ["Batcher", "BatcherConfig", "InferRequest", "InferResult"]
