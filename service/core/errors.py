"""The one exception tree of visionserve; each class carries how it is answered.

::

                                     HTTP  gRPC code           outcome     what
    VisionServeError                  500  INTERNAL            error       base; never shown with a traceback
    ├── ConfigError                   500  INTERNAL            error       bad settings, spec, checkpoint or
    │   │                                                                  repository entry (refused at startup)
    │   ├── UnknownNameError          500  INTERNAL            error       a name that is not registered
    │   ├── DatasetError              500  INTERNAL            error       a dataset that cannot be used
    │   └── CheckpointError           500  INTERNAL            error       not a visionserve checkpoint, or corrupt
    ├── BadInputError                 400  INVALID_ARGUMENT    bad_input   a request or an image we refuse
    │   ├── UnsupportedMediaError     415  INVALID_ARGUMENT    bad_input   a media type or image format we do not take
    │   └── PayloadTooLargeError      413  RESOURCE_EXHAUSTED  bad_input   a body, image or pixel count over the limits
    ├── ForbiddenError                403  PERMISSION_DENIED   bad_input   repository control without the admin token
    ├── NotFoundError                 404  NOT_FOUND           error       an unknown model or version
    ├── OverloadedError               503  UNAVAILABLE         rejected    the queue is full; try again later
    │   │                            (429  RESOURCE_EXHAUSTED  rejected    where the model's queue_full_status = 429)
    │   └── MemoryBudgetError         503  UNAVAILABLE         rejected    no room in the memory budget for the model
    ├── DeadlineExceededError         504  DEADLINE_EXCEEDED   timeout     the deadline passed before compute
    ├── CancelledError                499  CANCELLED           cancelled   the caller went away before compute
    └── RuntimeFailure                500  INTERNAL            error       a failure of ours (runtime, device)
        ├── InstanceStuckError        500  INTERNAL            error       an instance gave no answer in its bound
        └── DeviceFailure             500  INTERNAL            error       the device failed (CUDA error, memory)
            └── OutOfMemoryError      500  INTERNAL            error       out of memory (a smaller batch may fit)

``http_status``, ``grpc_code`` (the name of a ``grpc.StatusCode`` member: this module does not import grpc) and
``outcome`` (the ``outcome`` label of ``visionserve_requests_total``) are class attributes, as Litestar's HTTP
exceptions carry their status, so the HTTP and gRPC front ends and the metrics read them instead of walking the
tree. Only an overload has a choice per instance (``OverloadedError(..., http_status=429)``). 499 is nginx's
"client closed request", the status grpc-gateway gives CANCELLED: nobody is left to read it.

Runtimes translate torch and onnxruntime exceptions into this tree at their seam (``raise ... from exc``).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

SHOWN_MAX_CHARS = 60  # a value quoted in a message past this is cut, its length said


class VisionServeError(Exception):
    """Base of every error visionserve raises on purpose."""

    http_status: int = 500
    grpc_code: str = "INTERNAL"
    outcome: str = "error"
    retry_after_s: int | None = None  # sent as Retry-After (HTTP) or retry-after (gRPC trailers) where set

    def __init_subclass__(cls, *, http_status: int = 0, grpc_code: str = "", outcome: str = "", **kwargs: Any) -> None:
        """A subclass declares how it is answered where that differs from its base's: ``class
        NotFoundError(VisionServeError, http_status=404, grpc_code="NOT_FOUND")``."""
        super().__init_subclass__(**kwargs)
        cls.http_status = http_status or cls.http_status
        cls.grpc_code = grpc_code or cls.grpc_code
        cls.outcome = outcome or cls.outcome


class ConfigError(VisionServeError):
    """A setting, spec, checkpoint or repository entry is wrong; the message names the file, field and value."""


class UnknownNameError(ConfigError, KeyError):
    """A name that is not registered; the message lists the valid choices."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the plain message
        return str(self.args[0]) if self.args else ""


class DatasetError(ConfigError):
    """A dataset that cannot be used; the message names the file or folder."""


class CheckpointError(ConfigError):
    """A checkpoint that is not ours, or is corrupt."""


class BadInputError(VisionServeError, http_status=400, grpc_code="INVALID_ARGUMENT", outcome="bad_input"):
    """A request or image that we refuse."""


class UnsupportedMediaError(BadInputError, http_status=415):
    """A media type or image format we do not take."""


class PayloadTooLargeError(BadInputError, http_status=413, grpc_code="RESOURCE_EXHAUSTED"):
    """A body, image count or pixel count over the configured limits (RESOURCE_EXHAUSTED: what grpc itself answers
    for a message over its size limit)."""


class ForbiddenError(VisionServeError, http_status=403, grpc_code="PERMISSION_DENIED", outcome="bad_input"):
    """Repository control without the admin token (or with none configured)."""


class NotFoundError(VisionServeError, http_status=404, grpc_code="NOT_FOUND"):
    """An unknown model or version."""


class OverloadedError(VisionServeError, http_status=503, grpc_code="UNAVAILABLE", outcome="rejected"):
    """The queue is full: 503 (gRPC UNAVAILABLE), or 429 (RESOURCE_EXHAUSTED) where the model's
    ``queue_full_status`` says so; either way with a Retry-After."""

    retry_after_s = 1

    def __init__(self, *args: object, http_status: int = 503) -> None:
        super().__init__(*args)
        if http_status == 429:
            self.http_status, self.grpc_code = 429, "RESOURCE_EXHAUSTED"
        elif http_status != 503:
            raise ValueError(f"an overload is answered 503 or 429, got {http_status}")


class MemoryBudgetError(OverloadedError):
    """A model cannot be loaded now: its device's memory budget is full and nothing may be evicted (always 503,
    whatever the model's ``queue_full_status``: it is not the model's queue that is full), or the model is larger
    than the whole budget."""


class DeadlineExceededError(VisionServeError, http_status=504, grpc_code="DEADLINE_EXCEEDED", outcome="timeout"):
    """The deadline passed before the item was computed."""


class CancelledError(VisionServeError, http_status=499, grpc_code="CANCELLED", outcome="cancelled"):
    """The caller went away before the item was computed."""


class RuntimeFailure(VisionServeError):
    """A failure of ours while running a model."""


class InstanceStuckError(RuntimeFailure):
    """A runtime instance gave no answer within ``instance_stuck_after_s``: it is abandoned and replaced."""


class DeviceFailure(RuntimeFailure):
    """The device failed (a CUDA error or out of memory)."""


class OutOfMemoryError(DeviceFailure):
    """The device ran out of memory: the batcher halves the batch before it counts this against the device."""


def outcome_label(exc: BaseException) -> str:
    """The ``outcome`` label of a request that ended with ``exc``: the error's own, ``cancelled`` for asyncio's
    cancellation, ``error`` for anything that is not ours."""
    if isinstance(exc, VisionServeError):
        return exc.outcome
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else "error"


def shown(value: Any) -> str:
    """``value`` as a message quotes it: JSON's spelling for the numbers JSON lacks (``NaN``, ``Infinity``),
    ``repr`` otherwise, cut past :data:`SHOWN_MAX_CHARS` with its length said. A long integer is said by its size
    alone: past 4300 digits Python refuses to write one (a ValueError, which made such a value a 500)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, int) and not isinstance(value, bool):
        digits = math.floor(value.bit_length() * math.log10(2)) + 1  # the count within one, without writing it
        if digits > SHOWN_MAX_CHARS:
            return f"an integer of about {digits} digits"
    try:
        text = repr(value)
    except ValueError:  # a list or an object holding such an integer
        return f"a {type(value).__name__} too long to show"
    if len(text) <= SHOWN_MAX_CHARS:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters written"
    return f"{text[: SHOWN_MAX_CHARS - 20]}... ({size})"
