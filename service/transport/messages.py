"""The typed records that cross between a front end and an engine, as MessagePack (msgspec tagged unions).

Pixels never travel here: a :class:`Submit` names a region of the sender's shared-memory arena (offset and
shape); everything else is a few dozen bytes. Errors travel as their class name in ``service.core.errors`` and
their message, and come back as the same exception on the other side.

    front end -> engine: Hello, Submit, Cancel, Query (a ControlQuery inside), Snapshot
    engine -> front end: Welcome, Result, Failed, Reply, Flush, Beat

A Submit's region is the engine's to read until its answer: a Result or Failed frees it; a Failed with ``held``
(a deadline passed while a batch read it) answers the caller at once and a second Failed frees it; a cancelled
request's region is freed by the Failed(cancelled) sent once no batch reads it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from service.core import errors as _errors
from service.core.errors import OverloadedError, VisionServeError
from service.core.metrics import ModelCounts, RequestState
from service.core.source_metrics import SourceState
from service.core.stream_metrics import StreamState


class WireError(msgspec.Struct, array_like=True, frozen=True):
    """An exception of the project's tree, by class name and message (a 429/503 choice rides along)."""

    kind: str
    message: str
    status: int = 0

    @classmethod
    def of(cls, exc: BaseException) -> WireError:
        if isinstance(exc, VisionServeError):
            own = exc.http_status if exc.http_status != type(exc).http_status else 0  # an instance's own choice
            return cls(type(exc).__name__, str(exc), own)
        return cls("RuntimeFailure", f"{type(exc).__name__}: {exc}")

    def exception(self) -> VisionServeError:
        kind = getattr(_errors, self.kind, None)
        if not (isinstance(kind, type) and issubclass(kind, VisionServeError)):
            kind = _errors.RuntimeFailure
        if self.status and issubclass(kind, OverloadedError):  # the one class with a status per instance
            return kind(self.message, http_status=self.status)
        return kind(self.message)


# ---- front end -> engine ------------------------------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", array_like=True, frozen=True):
    """A front end introduces itself and the shared-memory arena its Submits point into."""

    frontend: str
    arena: str
    arena_bytes: int
    pid: int


class Submit(msgspec.Struct, tag="submit", array_like=True, frozen=True):
    """Compute the uint8 ``shape`` [N, C, H, W] tensor at ``offset`` in the sender's arena."""

    id: int
    model: str
    version: int
    offset: int
    shape: tuple[int, int, int, int]
    timeout_ms: float
    priority: int
    request_id: str
    # None: the request named its version. Otherwise it named none and the engine picks (a rollout's primary or
    # canary, the promoted version); the value is its sticky header's ("" when absent), for a sticky canary.
    route: str | None = None


class Cancel(msgspec.Struct, tag="cancel", array_like=True, frozen=True):
    """The caller went away: drop the request's images that are still queued."""

    id: int


# ---- control calls: one record each, carried by a Query and answered by a Reply --------------------------------


class CatalogQuery(msgspec.Struct, tag="catalog", array_like=True, frozen=True):
    """What the engine serves: answered with a :class:`Catalog`."""


class MetricsQuery(msgspec.Struct, tag="metrics", array_like=True, frozen=True):
    """The whole server's metrics as Prometheus text (bytes)."""


class StatsQuery(msgspec.Struct, tag="stats", array_like=True, frozen=True):
    """Each model version's statistics: a row each (model, version, the front ends' counts, its batches)."""


class IndexQuery(msgspec.Struct, tag="index", array_like=True, frozen=True):
    """Every model of the repository with its state, the ones not loaded too (Triton's repository index)."""


class LoadQuery(msgspec.Struct, tag="load", array_like=True, frozen=True):
    """Load (or reload) model ``name``, with ``config`` (a config.toml's fields) in place of its own if given."""

    name: str
    config: Any = None


class UnloadQuery(msgspec.Struct, tag="unload", array_like=True, frozen=True):
    """Take model ``name`` out of service (an on-demand one out of memory only)."""

    name: str


class RolloutQuery(msgspec.Struct, tag="rollout", array_like=True, frozen=True):
    """Model ``name``'s rollout document (None where it is not served here), after ``action`` where given:
    ``start`` (with ``settings``, [rollout] fields), ``promote`` or ``abort`` (for ``reason``)."""

    name: str
    action: str | None = None
    settings: Any = None
    reason: str = ""


class HoldQuery(msgspec.Struct, tag="hold", array_like=True, frozen=True):
    """Keep model ``name`` resident while ``holder`` (a source of this front end) runs (``hold``), or no longer:
    a held model is never evicted. Answered with how many hold it now; a front end's holds end with it."""

    name: str
    holder: str
    hold: bool = True


ControlQuery = (
    CatalogQuery | MetricsQuery | StatsQuery | IndexQuery | LoadQuery | UnloadQuery | RolloutQuery | HoldQuery
)


class Query(msgspec.Struct, tag="query", array_like=True, frozen=True):
    """A control call (``call``, one of :data:`ControlQuery`), answered by the :class:`Reply` of the same ``id``."""

    id: int
    call: ControlQuery


def query_name(call: ControlQuery) -> str:
    """A control call's name, as it travels (its tag): for log lines and errors."""
    return str(type(call).__struct_config__.tag)


class Snapshot(msgspec.Struct, tag="snapshot", array_like=True, frozen=True):
    """A front end's answer to :class:`Flush`: everything it has recorded so far (cumulative, so idempotent).
    ``streams``, then ``sources``, came later: a sender without them decodes with none."""

    token: int
    requests: list[RequestState]
    counts: list[ModelCounts]
    streams: list[StreamState] = []
    sources: list[SourceState] = []


# ---- engine -> front end ------------------------------------------------------------------------------------


class Welcome(msgspec.Struct, tag="welcome", array_like=True, frozen=True):
    """The engine's answer to Hello: it has attached the arena; ``catalog`` follows on request."""

    engine: str
    pid: int
    catalog_version: int


class Stamps(msgspec.Struct, array_like=True, frozen=True):
    """The engine's ``time.monotonic()`` stamps of a request (the last batch, for a split one): its images queued,
    an instance free for their batch, the batch dispatched, its answer back on the engine's loop. Front ends stamp
    with the same clock (CLOCK_MONOTONIC: one per machine), so the stages across the two processes line up."""

    received: float
    instance: float
    batch: float
    done: float


class Tensor(msgspec.Struct, array_like=True, frozen=True):
    """One named output of a request, row-major ``[N, *shape]`` in ``dtype`` (a numpy dtype name), as raw bytes:
    the few kilobytes of an answer travel in the message itself, not in shared memory."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # per image: the batch dimension left out
    data: bytes

    @classmethod
    def of(cls, name: str, array: np.ndarray) -> Tensor:
        """``array`` (batch-first) as a tensor: one copy, into the message's bytes."""
        return cls(name, array.dtype.name, tuple(array.shape[1:]), array.tobytes())

    def array(self, n: int) -> np.ndarray:
        """The ``[n, *shape]`` array, read-only, over the message's bytes (no copy)."""
        return np.frombuffer(self.data, dtype=self.dtype).reshape(n, *self.shape)


class Result(msgspec.Struct, tag="result", array_like=True, frozen=True):
    """Each named output of the model for the request's images (classification: one, its logits) and each image's
    own error, if any."""

    id: int
    outputs: list[Tensor]
    errors: list[WireError | None] | None
    queue_s: float
    compute_s: float
    batch_sizes: list[int]
    stamps: Stamps | None = None
    cold_start_s: float = 0.0  # the request waited this long for its model's load (0: it was resident)
    version: int = 0  # the version that answered (a rollout's choice); 0: the one the front end asked


class Answer(msgspec.Struct, frozen=True):
    """A front end's view of a computed request: the engine's Result, when its message left (``sent``) and when
    the answer was read (``answered``), both ``time.perf_counter()``. Never on the wire."""

    result: Result
    sent: float
    answered: float


class Failed(msgspec.Struct, tag="failed", array_like=True, frozen=True):
    """The whole request failed (rejected, deadline, shut down, unknown model...). ``held``: a batch still reads
    the request's pixels (a deadline passed while it computed); a second Failed says when they are free."""

    id: int
    error: WireError
    held: bool = False


class Reply(msgspec.Struct, tag="reply", array_like=True, frozen=True):
    """The answer to a Query: ``value`` or ``error``."""

    id: int
    value: Any = None
    error: WireError | None = None


class Flush(msgspec.Struct, tag="flush", array_like=True, frozen=True):
    """Send a Snapshot now (a scrape is waiting for it)."""

    token: int


class Beat(msgspec.Struct, tag="beat", array_like=True, frozen=True):
    """The engine is alive; ``catalog_version`` changes whenever a model's state does; ``frontends``: how many
    front ends (by name) have reached it, so each can tell whether the whole server is ready, not only itself."""

    catalog_version: int
    frontends: int = 0


ToEngine = Hello | Submit | Cancel | Query | Snapshot
ToFrontend = Welcome | Result | Failed | Reply | Flush | Beat

ENCODER = msgspec.msgpack.Encoder()
TO_ENGINE = msgspec.msgpack.Decoder(ToEngine)
TO_FRONTEND = msgspec.msgpack.Decoder(ToFrontend)


# ---- the catalog: what an engine serves ---------------------------------------------------------------------


class ModelInfo(msgspec.Struct, frozen=True):
    """One loaded model version as a front end needs it: the spec (JSON), the config and the engine's state."""

    model: str
    version: int
    spec_json: bytes
    config: dict[str, Any]
    state: dict[str, Any]


class VersionKey(msgspec.Struct, frozen=True, order=True):
    """One version of a model: the key of its memory charge and of its load error, written ``name/version`` (the
    form the catalog's ``errors`` carry)."""

    name: str
    version: int

    def __str__(self) -> str:
        return f"{self.name}/{self.version}"


class Catalog(msgspec.Struct, frozen=True):
    models: list[ModelInfo]
    errors: dict[str, str]
    unloaded: dict[str, str] = {}
    version: int = 0
    routes: dict[str, int] = {}  # model -> the version requests naming none are served by, where a rollout chose
    sticky_headers: dict[str, str] = {}  # model -> the request header a sticky canary routes by
