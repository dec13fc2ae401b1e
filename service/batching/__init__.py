"""Batching: the dynamic batcher and the engine that owns a model's runtimes, devices and fallback.

Imports ``service.runtime``; never HTTP code.
"""

from __future__ import annotations

from service.batching.batcher import Batcher, BatcherConfig, BatchRecord, InferRequest, InferResult
from service.batching.wire import decode_request, encode_request

__all__ = [
    "BatchRecord",
    "Batcher",
    "BatcherConfig",
    "InferRequest",
    "InferResult",
    "decode_request",
    "encode_request",
]
