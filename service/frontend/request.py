"""One request path for every protocol: v2 over HTTP and gRPC, the image API, and each frame of both streams. A
protocol parses its request into one record (:class:`Ask`) and encodes the :class:`Answer`; everything between is
here, once: resolve and route (:func:`target`), then :func:`answer`, which records the request however it ends
around parse and :func:`run` (decode, infer, the task's postprocessing and the encoding). A stream resolves once
and runs each frame through :func:`run`, observed from the engine step on (docs/streams.md).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from service.core.boxes import Transform
from service.core.decoding import Decoded
from service.core.errors import RuntimeFailure, VisionServeError
from service.core.parameters import version_number
from service.core.status import InferResult
from service.core.tasks import OutputTensor, Want
from service.frontend.state import ModelSlot, ServerState
from service.frontend.timing import Timing

T = TypeVar("T")
# A model ``m`` is reached as ``m`` (its metadata lists INPUT, pixels) or ``m.image`` (IMAGE, encoded files):
# the README's v2 rules say why.
IMAGE_SUFFIX = ".image"
TENSOR, IMAGE = "INPUT", "IMAGE"


@dataclass
class Named:
    """A model version reached under one of its names; ``view`` is the input its metadata lists."""

    slot: ModelSlot
    name: str
    view: str


def resolve(server: ServerState, name: str, version: int | str | None = None) -> Named:
    """The slot behind ``name`` (``m``, or ``m.image`` where no model folder has that name); NotFoundError as
    ``server.slot``, BadInputError for a version that is not one."""
    number = version_number(version)
    if name.endswith(IMAGE_SUFFIX) and name not in server.slots and name[: -len(IMAGE_SUFFIX)] in server.slots:
        return Named(server.slot(name[: -len(IMAGE_SUFFIX)], number), name, IMAGE)
    return Named(server.slot(name, number), name, TENSOR)


@dataclass(slots=True)
class Target(Named):
    """A resolved request: the model version under the name it used, and what its Submit says of the version
    (``route``, :meth:`ServerState.route`)."""

    route: str | None = None


@dataclass(slots=True)
class Ask:
    """A request as every protocol parses it. ``images`` (encoded files, decoded here) or ``pixels`` (a uint8
    ``[N, C, H, W]`` batch); ``each``: an image that fails is answered in its place (the image API's multipart, a
    stream's frame), else it fails the request, its message naming it (``named``: "image 2: ...", with ``hint``
    on a decode error) or not; ``expires``: a frame's ``time.perf_counter()`` deadline, which bounds the queue."""

    want: Want
    images: list[bytes] | None = None
    pixels: np.ndarray | None = None
    priority: int = 0
    timeout_ms: float | None = None
    id: Any = None
    each: bool = False
    named: bool = False
    hint: str = ""
    expires: float | None = None
    transforms: list[Transform | None] | None = None  # each decoded image's (set by the path): boxes map back


@dataclass(slots=True)
class Answer:
    """What the path answers, for a protocol to encode: the version asked (``slot``) and the one that answered,
    each image's error (``each``) and, per the :class:`Want`, the v2 tensors and each image's predictions."""

    ask: Ask
    slot: ModelSlot
    version: int
    errors: list[VisionServeError | None]
    tensors: list[OutputTensor] = field(default_factory=list)
    predictions: list[list[dict[str, object]] | None] = field(default_factory=list)
    detections: list[int] | None = None  # a detector's count per computed image


class Expired(Exception):
    """A frame too old to compute: it aged past its deadline while it was decoded."""

    stage = "decode"


def target(
    server: ServerState, model: str, version: str | None, headers: Mapping[str, str], *, aliases: bool = True
) -> Target:
    """Resolve and route: ``model`` (with ``aliases``, also ``m.image``: :func:`resolve`) at ``version``.
    Called as a request arrives: once the server drains it is refused here (503)."""
    if aliases:
        named = resolve(server, model, version)
        slot, view = named.slot, named.view
    else:
        slot, view = server.slot(model, version_number(version)), TENSOR
    return Target(slot, model, view, server.route(slot.name, version, headers))


def answered_version(slot: ModelSlot, version: int) -> int:
    """The version an answer names: the one that computed it (a canary's candidate), ``version`` as the engine
    said it (0: the one asked)."""
    return version or slot.version.version


async def answer(
    where: Target,
    timing: Timing,
    parse: Callable[[Target], Awaitable[Ask]],
    encode: Callable[[Answer], T],
    protocol: str = "http",
) -> T:
    """One request, parsed (``parse``: a refusal is recorded too) and answered (``encode``), recorded once."""
    with where.slot.observe(timing, protocol):
        return await run(where, await parse(where), timing, encode)


async def run(where: Target, ask: Ask, timing: Timing, encode: Callable[[Answer], T], observe: str | None = None) -> T:
    """Decode, infer, postprocess and encode ``ask``; ``observe``: record the engine step as one request of that
    protocol (a stream's frame), where no caller records the whole."""
    slot = where.slot
    decoded = await _decode(slot, ask, timing) if ask.images is not None else None
    if decoded is None:
        batch: np.ndarray | list[np.ndarray] = ask.pixels if ask.pixels is not None else []
        errors: list[VisionServeError | None] = [None] * len(batch)
        good = None
    else:
        errors = [d if isinstance(d, VisionServeError) else None for d in decoded]
        good = [i for i, e in enumerate(errors) if e is None] if ask.each else None
        batch = [d for d in decoded if isinstance(d, np.ndarray)]  # stacked straight into shared memory: one copy
    result = None
    if len(batch):
        result = await _infer(slot, batch, ask, timing, where.route, observe)
        _row_errors(result, ask, errors, good)
    started = time.perf_counter()

    def finish() -> tuple[list[int] | None, T]:
        """The answer encoded, and its detections counted; the answer itself is let go here (off the loop, its
        objects die in the worker thread)."""
        done = postprocess(slot, ask, result, errors, good)
        return done.detections, encode(done)

    if result is not None and sum(out.size for out in result.outputs.values()) > OFF_LOOP_VALUES:
        detections, encoded = await asyncio.to_thread(_uncollected, finish)
    else:
        detections, encoded = finish()
    timing.detections = detections  # recorded with the request (ModelSlot.observe)
    timing.postprocess_s += time.perf_counter() - started
    return encoded


# Past this many output values, postprocessing and encoding run on a worker thread, not the event loop: 64 images
# of an 8,400-anchor, 80-class YOLO head (45M values) at score_threshold 0 and max_detections 10,000 took about 3 s
# there (docs/detection.md, "What one request may cost"), and every other request waited for it. Under it (a
# classifier's 64 x 1,000, a trained detector's few rows) the thread's hop would cost more than the work.
OFF_LOOP_VALUES = 1 << 18


_COLLECTOR = threading.Lock()
_uncollected_runs = 0
_collector_was_on = True


def _uncollected(fn: Callable[[], T]) -> T:
    """``fn()`` with CPython's cyclic collector paused; reference counting still frees everything. A heavy
    answer makes half a million short-lived objects that are in no cycle (a dict and a list a box); each full
    collection they set off walks every object of the process holding the GIL, and so the event loop, about 250 ms
    at a time (2-core VM). Counted, so overlapping runs turn it back on once, at the last one's end (and only if it
    was on)."""
    global _uncollected_runs, _collector_was_on
    with _COLLECTOR:
        _uncollected_runs += 1
        if _uncollected_runs == 1:
            _collector_was_on = gc.isenabled()
            gc.disable()
    try:
        return fn()
    finally:
        with _COLLECTOR:
            _uncollected_runs -= 1
            if _uncollected_runs == 0 and _collector_was_on:
                gc.enable()


def postprocess(
    slot: ModelSlot,
    ask: Ask,
    result: InferResult | None,
    errors: list[VisionServeError | None],
    good: list[int] | None,
) -> Answer:
    """The task's postprocessing of ``result`` (:meth:`Task.postprocess`), its predictions put back in the places of
    the images they are for, with the version that answered."""
    version = answered_version(slot, result.version if result is not None else 0)
    done = Answer(ask, slot, version, errors)
    if result is None:
        done.predictions = [None] * len(errors)
        return done
    transforms = ask.transforms
    if transforms is not None and good is not None and len(good) != len(errors):
        transforms = [transforms[i] for i in good]  # the computed rows'
    post = slot.task.postprocess(result, ask.want, transforms)
    done.tensors = post.tensors
    done.detections = post.detections
    if good is None or len(good) == len(errors):
        done.predictions = list(post.predictions)
    elif post.predictions:
        done.predictions = [None] * len(errors)
        for row, i in enumerate(good):
            done.predictions[i] = post.predictions[row]
    for row, reason in post.failed.items():  # that image alone fails (the others' answers stand)
        i = good[row] if good is not None else row
        if not ask.each:
            raise RuntimeFailure(f"image {i}: {reason}" if ask.named else reason)
        done.errors[i] = RuntimeFailure(reason)
        if done.predictions:
            done.predictions[i] = None
    return done


async def _decode(slot: ModelSlot, ask: Ask, timing: Timing) -> list[Decoded]:
    assert ask.images is not None
    decoded, ask.transforms = await slot.decode(ask.images, timing)
    if not ask.each:
        for i, item in enumerate(decoded):
            if isinstance(item, VisionServeError):
                raise type(item)(f"image {i}: {item}{ask.hint}") if ask.named else item
    return decoded


async def _infer(
    slot: ModelSlot,
    batch: np.ndarray | list[np.ndarray],
    ask: Ask,
    timing: Timing,
    route: str | None,
    observe: str | None,
) -> InferResult:
    timeout_ms = ask.timeout_ms
    if ask.expires is not None:
        timeout_ms = (ask.expires - time.perf_counter()) * 1000.0
        if timeout_ms <= 0:
            raise Expired
    if observe is None:
        return await slot.infer(batch, timing, priority=ask.priority, timeout_ms=timeout_ms, route=route)
    with slot.observe(timing, protocol=observe):
        return await slot.infer(batch, timing, priority=ask.priority, timeout_ms=timeout_ms, route=route)


def _row_errors(result: InferResult, ask: Ask, errors: list[VisionServeError | None], good: list[int] | None) -> None:
    """Each computed image's own error, in its place (``each``), or the first one failing the request."""
    for row, error in enumerate(result.errors):
        if error is None:
            continue
        if not ask.each:
            raise type(error)(f"image {row}: {error}") if ask.named else error
        errors[good[row] if good is not None else row] = error
