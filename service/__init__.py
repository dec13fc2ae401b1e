"""The visionserve server: model repository, runtimes, batcher, preprocessing, HTTP API, metrics.

This package's top level stays light (no torch, no onnxruntime): the spec and the errors are what
``models/`` and ``export/`` share with it.
"""

from __future__ import annotations

from service.core.errors import ConfigError, VisionServeError
from service.core.spec import ExportRecord, InputSpec, ModelSpec, decode_spec, encode_spec, load_spec, write_spec

__all__ = [
    "ConfigError",
    "ExportRecord",
    "InputSpec",
    "ModelSpec",
    "VisionServeError",
    "decode_spec",
    "encode_spec",
    "load_spec",
    "write_spec",
]
