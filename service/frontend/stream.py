"""A stream of frames to one model with latest-frame semantics (docs/streams.md): the protocol-free part that the
WebSocket route and gRPC's ``ModelStreamInfer`` share. At most one frame waits and one computes per stream, so a
fast stream cannot crowd slow ones out of the engine's queue; a frame is computed through the one request path
(:func:`service.frontend.request.run`) like any request, and gets exactly one answer through ``emit``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

import numpy as np

from service.core.boxes import Transform
from service.core.errors import BadInputError, DeadlineExceededError, VisionServeError, shown
from service.core.spec import ModelSpec
from service.core.stream_metrics import FrameCounts
from service.core.tasks import Want
from service.frontend.request import Ask, Expired, Target, run
from service.frontend.state import ModelSlot
from service.frontend.timing import Timing

log = logging.getLogger("visionserve.stream")

DEFAULT_MAX_AGE_MS = 500.0
MAX_AGE_LIMIT_MS = 60_000.0


@dataclass
class Frame:
    """One frame as the server read it: its id and the client's timestamp (echoed), the encoded image, and when it
    was read off the connection (``time.perf_counter()``, the age's origin)."""

    id: Any
    client_ts: Any
    data: bytes
    received: float = field(default_factory=time.perf_counter)
    want: Want | None = None  # what its answer holds, where the frame says (gRPC's outputs); else the stream's
    # A frame decoded already (a source's): the model's input and the frame's Transform from its spec, computed
    # off the event loop when the frame is taken; ``data`` is then empty.
    prepare: Callable[[ModelSpec], tuple[np.ndarray, Transform]] | None = None

    def age_ms(self) -> float:
        return (time.perf_counter() - self.received) * 1000.0


Emit = Callable[[dict[str, Any]], None]


@dataclass(eq=False)
class FrameStream:
    """One client's stream to ``where`` (a resolved model version and its route). ``emit`` receives every answer (a
    dict, docs/streams.md; a frame that says what it wants, :attr:`Frame.want`, has its v2 ``outputs`` as
    :class:`~service.core.tasks.OutputTensor`, never JSON); ``on_outcome(outcome, age_s)`` hears each frame's fate."""

    where: Target
    emit: Emit
    _: KW_ONLY
    max_age_ms: float = DEFAULT_MAX_AGE_MS
    want: Want = field(default_factory=Want)
    on_outcome: Callable[[str, float], None] | None = None
    protocol: str = "stream"

    def __post_init__(self) -> None:
        self.slot = self.where.slot
        self.counts = FrameCounts()  # its frames by fate, and the answered ones' ages
        self._waiting: Frame | None = None
        self._wake = asyncio.Event()
        self._closing = False
        self._computing = False
        self._worker: asyncio.Task[None] | None = None

    @property
    def pending(self) -> bool:
        """A frame waits or computes."""
        return self._waiting is not None or self._computing

    # ---- intake ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._worker = asyncio.get_running_loop().create_task(self._run(), name=f"stream-{self.slot.name}")

    def offer(self, frame: Frame) -> None:
        """A frame read off the connection: it waits, replacing (superseding) the frame waiting before it."""
        self.counts.sent += 1
        if self._closing:
            self._answer(frame, "expired", stage="wait", reason="the stream is closing")
            return
        older, self._waiting = self._waiting, frame
        if older is not None:
            self._answer(older, "superseded", by=frame.id)
        self._wake.set()

    def reject(self, frame_id: Any, client_ts: Any, message: str) -> None:
        """A message that is not a usable frame (a bad header): answered as an error, counted as sent."""
        self.counts.sent += 1
        self._answer(Frame(frame_id, client_ts, b""), "error", error=message)

    async def close(self, reason: str = "the stream ended", timeout_s: float = 30.0) -> None:
        """No more frames: the waiting one is answered ``expired``; the one computing is answered (within
        ``timeout_s``), then the worker stops."""
        self._closing = True
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            self._answer(waiting, "expired", stage="wait", reason=reason)
        self._wake.set()
        if self._worker is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._worker), timeout_s)
            except TimeoutError:
                self._worker.cancel()

    # ---- the worker -------------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            frame, self._waiting = self._waiting, None
            if frame is None:
                if self._closing:
                    return
                continue
            self._computing = True
            try:
                await self._process(frame)
            except asyncio.CancelledError:
                self._answer(frame, "expired", stage="queue", reason="the stream was cut off")
                raise
            except Exception as exc:  # never lose a frame, whatever went wrong
                log.exception("stream frame %r failed", frame.id)
                self._answer(frame, "error", error=f"{type(exc).__name__}: {exc}")
            finally:
                self._computing = False
            if self._waiting is not None:
                self._wake.set()

    async def _process(self, frame: Frame) -> None:
        waited_ms = frame.age_ms()
        if waited_ms > self.max_age_ms:
            self._answer(frame, "expired", stage="wait")
            return
        timing = Timing(arrived=frame.received)
        if frame.prepare is None:
            ask = Ask(frame.want or self.want, [frame.data], id=frame.id, each=True)
        else:
            started = time.perf_counter()
            pixels, transform = await asyncio.to_thread(frame.prepare, self.slot.spec)
            timing.preprocess_s = time.perf_counter() - started
            want = frame.want or self.want
            ask = Ask(want, pixels=pixels[np.newaxis], id=frame.id, each=True, transforms=[transform])
        ask.expires = frame.received + self.max_age_ms / 1000.0  # the queue's deadline: the frame's age
        try:
            answer = await run(self.where, ask, timing, lambda done: done, observe=self.protocol)
        except (Expired, DeadlineExceededError) as exc:  # aged past its deadline while decoded, or in the queue
            self._answer(frame, "expired", stage=getattr(exc, "stage", "queue"))
            return
        except VisionServeError as exc:
            self._answer(frame, "error", error=str(exc))
            return
        error = answer.errors[0]
        if error is not None:
            self._answer(frame, "error", error=str(error))
            return
        seconds = {"decode": timing.preprocess_s, "queue": timing.queue_s, "compute": timing.compute_s}
        timings = {"wait": round(waited_ms, 3)} | {k: round(s * 1000.0, 3) for k, s in seconds.items()}
        if ask.want.outputs:
            held: dict[str, Any] = {"outputs": answer.tensors}
        else:
            held = self.slot.task.fields(answer.predictions[0] or [], ask.transforms[0] if ask.transforms else None)
        self._answer(frame, "result", version=answer.version, **held, timings_ms=timings)

    # ---- answers ----------------------------------------------------------------------------------------------
    def _answer(self, frame: Frame, status: str, **fields: Any) -> None:
        age_ms = frame.age_ms()
        outcome = "answered" if status == "result" else status
        self.counts.add(outcome, age_ms / 1000.0)
        if self.on_outcome is not None:
            self.on_outcome(outcome, age_ms / 1000.0)
        self.emit({"id": frame.id, "ts": frame.client_ts, "status": status, "age_ms": round(age_ms, 3), **fields})


def stream_max_age(value: Any) -> float:
    """A stream's ``max_age_ms``, checked (BadInputError names it): default 500, in (0, 60000]; a number, or its
    text (a query's)."""
    if value is None or value == "":
        return DEFAULT_MAX_AGE_MS
    try:
        age = float(value) if not isinstance(value, bool) and isinstance(value, int | float | str) else math.nan
    except (ValueError, OverflowError):  # not a number's text; an integer past float64's range
        age = math.nan
    if not 0 < age <= MAX_AGE_LIMIT_MS:  # False for NaN
        raise BadInputError(f"max_age_ms must be a number in (0, {MAX_AGE_LIMIT_MS:g}], got {shown(value)}")
    return age


def stream_want(slot: ModelSlot, options: Mapping[str, Any], text: bool = False) -> Want:
    """What each frame's answer holds, from a stream's (or a source's) options: the model's task's options, each
    checked (BadInputError names it); ``text``: a query's text."""
    return Want(options=slot.task.options(options, text=text))
