"""The one exception tree of visionserve.

::

    VisionServeError                 base; never shown to clients with a traceback
    ├── ConfigError                  bad settings, spec, checkpoint or repository entry (refused at startup)
    │   ├── UnknownNameError         an architecture, dataset or model name that does not exist
    │   ├── DatasetError             a dataset that cannot be used (empty folder, unreadable image)
    │   └── CheckpointError          a file that is not a visionserve checkpoint, or is corrupt
    ├── BadInputError                a request or an image we refuse                        -> 400
    │   ├── UnsupportedMediaError    a media type or image format we do not take            -> 415
    │   └── PayloadTooLargeError     a body, image count or pixel count over the limits     -> 413
    ├── NotFoundError                an unknown model or version                            -> 404
    ├── OverloadedError              the queue is full; try again later                     -> 503 or 429
    ├── DeadlineExceededError        the request's deadline passed before compute           -> 504
    ├── CancelledError               the caller went away before compute
    └── RuntimeFailure               a failure of ours (runtime, device)                    -> 500
        ├── InstanceStuckError       a runtime instance gave no answer within its bound (it is replaced)
        └── DeviceFailure            the device itself failed (CUDA error, out of memory)
            └── OutOfMemoryError     the device ran out of memory (a smaller batch may fit)

Runtimes translate torch and onnxruntime exceptions into this tree at their seam (``raise ... from exc``).
"""

from __future__ import annotations


class VisionServeError(Exception):
    """Base of every error visionserve raises on purpose."""


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


class BadInputError(VisionServeError):
    """A request or image that we refuse."""


class UnsupportedMediaError(BadInputError):
    """A media type or image format we do not take."""


class PayloadTooLargeError(BadInputError):
    """A body, image count or pixel count over the configured limits."""


class NotFoundError(VisionServeError):
    """An unknown model or version."""


class OverloadedError(VisionServeError):
    """The queue is full."""


class DeadlineExceededError(VisionServeError):
    """The deadline passed before the item was computed."""


class CancelledError(VisionServeError):
    """The caller went away before the item was computed."""


class RuntimeFailure(VisionServeError):
    """A failure of ours while running a model."""


class InstanceStuckError(RuntimeFailure):
    """A runtime instance gave no answer within ``instance_stuck_after_s``: it is abandoned and replaced."""


class DeviceFailure(RuntimeFailure):
    """The device failed (a CUDA error or out of memory)."""


class OutOfMemoryError(DeviceFailure):
    """The device ran out of memory: the batcher halves the batch before it counts this against the device."""
