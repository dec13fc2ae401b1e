"""One source: a URL the server pulls and decodes (:class:`~service.frontend.sources.reader.Reader`), its frames fed
to a stream (:class:`~service.frontend.stream.FrameStream`), its answers fanned out to subscribers, each through
the streams' bounded outbox. A frame's fates, its age and the last ``ended`` message: docs/sources.md.
"""

from __future__ import annotations

import asyncio
import base64
import io
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from service.core.boxes import Transform
from service.core.source_metrics import SourceState
from service.core.spec import ModelSpec
from service.core.tasks import Want
from service.core.tracking import TrackAsk, Tracking
from service.frontend.outbox import Outbox
from service.frontend.request import Target
from service.frontend.sources.frames import frame_input
from service.frontend.sources.reader import Pace, Picture, Reader
from service.frontend.sources.urls import SourceUrl
from service.frontend.stream import Frame, FrameStream

RATE_WINDOW_S = 5.0  # fps in and answered: over the last this many seconds
FINAL = ("ended", "failed", "stopped")
SHOWN_WIDTH = 640  # a frame sent to a subscriber that shows frames is at most this wide
IMAGES_KEPT = 8


class Subscriber(Outbox[dict[str, Any]]):
    """One reader of a source's answers (a WebSocket or an event stream): an outbox of answer dicts, the ``ended``
    one the last."""

    def __init__(self, frames: bool = False) -> None:
        super().__init__()
        self.frames = frames  # each result also carries its frame as a JPEG (``image``, base64): the demo page's


@dataclass
class SourceOptions:
    """What a source runs with, changeable while it runs (``PATCH``): ``max_fps`` (0: every frame), ``max_age_ms``,
    a file's pace (``realtime`` or ``answered``), and what each answer holds (``want``, from the task's options as
    given, ``task_options``)."""

    max_fps: float
    max_age_ms: float
    realtime: bool
    want: Want
    task_options: dict[str, Any] = field(default_factory=dict)
    track: TrackAsk | None = None  # its tracks, lines and zones (docs/tracking.md)


class Source:
    """One running (or finished) source. Built and started on the event loop; its reader thread reports back
    through the loop. ``on_outcome`` hears of each frame's fate (the model's stream metrics); ``on_final`` once
    the source has finished and freed its reader."""

    def __init__(
        self,
        id: str,
        url: SourceUrl,
        where: Target,
        options: SourceOptions,
        *,
        max_pixels: int,
        connect_timeout_s: float,
        read_timeout_s: float,
        backoff_cap_s: float,
        on_outcome: Callable[[str, float], None] | None = None,
        on_final: Callable[[Source], None] | None = None,
    ) -> None:
        self.id = id
        self.holder = f"{id}#{secrets.token_hex(4)}"  # its hold on its model (a later source of its id: another)
        self.url = url
        self.where = where
        self.model = where.slot.name
        self.options = options
        self.state = "connecting"
        self.reason = ""
        self.created = time.time()
        self._started_perf = time.perf_counter()
        self.dropped = 0  # frames decoded and never offered (left out by max_fps, or decoded as it stopped)
        self.subscribers: set[Subscriber] = set()
        self._on_outcome = on_outcome
        self._on_final = on_final
        self._loop = asyncio.get_running_loop()
        self._decoded_at: deque[float] = deque()
        self._answered_at: deque[float] = deque()
        self.done = asyncio.Event()  # set once finished: reader ended, every frame answered, subscribers told
        self._finishing: asyncio.Task[None] | None = None
        self._final: tuple[str, str] | None = None  # the reader's last word (ended, failed), said once finished
        self._images: dict[int, bytes] = {}  # frame index -> its JPEG, while it computes (for frames=1 subscribers)
        self.tracking = Tracking(options.track) if options.track is not None else None
        self.stream = FrameStream(
            where, self._emit, max_age_ms=options.max_age_ms, want=options.want, on_outcome=self._outcome,
            protocol="source",
        )  # fmt: skip
        post = self._loop.call_soon_threadsafe  # the reader calls from its thread: each call runs on the loop
        self.reader = Reader(
            url, name=id, hand=lambda picture: post(self._offer, picture),
            on_state=lambda state, reason: post(self._set_state, state, reason),
            on_skip=lambda: post(self._skipped_by_rate),
            pace=Pace(options.max_fps, options.realtime), max_pixels=max_pixels,
            connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s, backoff_cap_s=backoff_cap_s,
        )  # fmt: skip

    # ---- life ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.stream.start()
        self.reader.start()

    @property
    def finished(self) -> bool:
        return self.state in FINAL

    def change(self, options: SourceOptions) -> None:
        """New options from now on (the frame computing keeps the ones it started with)."""
        self.options = options
        self.stream.max_age_ms = options.max_age_ms
        self.stream.want = options.want
        self.reader.set_pace(Pace(options.max_fps, options.realtime))
        if options.track is None or self.tracking is None:
            self.tracking = Tracking(options.track) if options.track is not None else None
        else:
            self.tracking.change(options.track)

    async def stop(self, reason: str = "deleted", timeout_s: float = 10.0) -> None:
        """Stop pulling, answer the frame computing, tell subscribers, free the reader: the source is ``stopped``."""
        await asyncio.shield(self._finish_once(reason, timeout_s, stopped=True))

    def drain(self) -> None:
        """The server drains (``ServerState.drain``): stop as if deleted, the reason said."""
        self._finish_once("the server is draining", 10.0, stopped=True)

    def _finish_once(self, reason: str, timeout_s: float, stopped: bool = False) -> asyncio.Task[None]:
        """The one task that finishes the source (a task of its own: a caller cancelled does not stop it halfway);
        ``stopped``: stopped from outside, unless finished already."""
        if stopped and not self.finished:
            self.state, self.reason = "stopped", reason
        if self._finishing is None:
            self._finishing = self._loop.create_task(self._finish(reason, timeout_s))
        return self._finishing

    async def _finish(self, reason: str, timeout_s: float) -> None:
        self.reader.stop()
        deadline = time.monotonic() + timeout_s  # polled: a thread of the shared pool would wait here meanwhile
        if self._final is not None and self._final[0] == "ended":  # a file's last frames are answered, not expired
            while self.stream.pending and time.monotonic() < deadline and self.state != "stopped":
                await asyncio.sleep(0.01)
        await self.stream.close(reason, timeout_s=timeout_s)
        while self.reader.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._final is not None:
            self.state, self.reason = self._final
        for subscriber in list(self.subscribers):
            subscriber.put(self._ended_message(), last=True)
        self.done.set()
        if self._on_final is not None:
            self._on_final(self)

    # ---- on the loop, from the reader's thread --------------------------------------------------------------------
    def _offer(self, picture: Picture) -> None:
        _note(self._decoded_at, picture.decoded)
        if self.finished:  # decoded while it stopped: never computed, still counted
            self.dropped += 1
            return
        frame = Frame(picture.index, picture.pts, b"", received=picture.decoded, prepare=self._preparer(picture))
        self.stream.offer(frame)

    def _skipped_by_rate(self) -> None:
        self.dropped += 1
        _note(self._decoded_at, time.perf_counter())

    def _set_state(self, state: str, reason: str) -> None:
        if self.finished or self._final is not None:
            return
        if state in ("ended", "failed"):  # said once it is so: every frame answered, the reader gone
            self._final = (state, reason)
            self._finish_once(reason or state, 30.0)
            return
        self.state, self.reason = state, reason

    def _outcome(self, outcome: str, age_s: float) -> None:
        """A frame's fate, counted by its stream already: the rate answered, the model's metrics, the reader's pace."""
        if outcome == "answered":
            _note(self._answered_at, time.perf_counter())
        if self._on_outcome is not None and outcome != "superseded":
            self._on_outcome(outcome, age_s)
        self.reader.answered()

    def _preparer(self, picture: Picture) -> Callable[[ModelSpec], tuple[np.ndarray, Transform]]:
        """The model's input from a decoded frame, run off the loop when the frame is taken (never for a skipped
        one); with a subscriber that shows frames, the frame as a JPEG too."""

        def run(spec: ModelSpec) -> tuple[np.ndarray, Transform]:
            if any(s.frames for s in list(self.subscribers)):
                self._images[picture.index] = _jpeg(picture.frame.to_image())
            return frame_input(picture.frame, spec)

        return run

    def _emit(self, answer: dict[str, Any]) -> None:
        if answer.get("status") == "superseded":
            return
        message = {"source": self.id, "frame": answer.pop("id"), "pts": answer.pop("ts"), **answer}
        events = self._track(message) if self.tracking is not None and message["status"] == "result" else []
        image = self._images.pop(message["frame"], None)
        while len(self._images) > IMAGES_KEPT:  # frames that expired after their JPEG was made
            self._images.pop(next(iter(self._images)))
        shown = {**message, "image": base64.b64encode(image).decode()} if image is not None else message
        for subscriber in list(self.subscribers):
            subscriber.put(shown if subscriber.frames else message)
            for event in events:
                subscriber.put({"source": self.id, **event})

    def _track(self, message: dict[str, Any]) -> list[dict[str, Any]]:
        """The frame's boxes given their tracks (at its pts, else when it was decoded), and its events."""
        assert self.tracking is not None
        options, task = self.options.want.options, self.where.slot.task
        return self.tracking.answered(message, task, options, message["pts"], since=self._started_perf)

    def counts(self) -> dict[str, Any]:
        """Its lines' and zones' counts (docs/tracking.md); a source that does not track has none."""
        return self.tracking.counts() if self.tracking is not None else {"lines": {}, "zones": {}}

    # ---- subscribers ------------------------------------------------------------------------------------------
    def subscribe(self, frames: bool = False) -> Subscriber:
        subscriber = Subscriber(frames)
        if self.done.is_set():
            subscriber.put(self._ended_message(), last=True)
        else:
            self.subscribers.add(subscriber)
        return subscriber

    def _ended_message(self) -> dict[str, Any]:
        return {"source": self.id, "status": "ended", "state": self.state, "reason": self.reason}

    # ---- what it shows ------------------------------------------------------------------------------------------
    def rates(self) -> tuple[float, float]:
        """Frames decoded and answered per second, over the last :data:`RATE_WINDOW_S` seconds."""
        now = time.perf_counter()
        out = []
        for times in (self._decoded_at, self._answered_at):
            while times and times[0] < now - RATE_WINDOW_S:
                times.popleft()
            span = min(RATE_WINDOW_S, now - self._started_perf)
            out.append(len(times) / span if span > 0 else 0.0)
        return out[0], out[1]

    def frames(self) -> dict[str, int]:
        """Its frames: decoded, then each decoded frame's fate (``SOURCE_OUTCOMES``), from its stream's counts."""
        counts = self.stream.counts
        return {"decoded": counts.sent + self.dropped, "skipped": counts.superseded + self.dropped,
                "answered": counts.answered, "expired": counts.expired, "error": counts.error}  # fmt: skip

    def record(self, frontend: str) -> SourceState:
        """What the metrics show of it (reported to the engine with the front end's other counts)."""
        fps_in, fps_answered = self.rates()
        counts = self.tracking.counter.counts() if self.tracking is not None else {}
        return SourceState(self.id, self.model, self.state, self.frames(), list(self.stream.counts.ages),
                           self.reader.reconnects, fps_in, fps_answered, frontend, counts)  # fmt: skip

    def describe(self) -> dict[str, Any]:
        fps_in, fps_answered = self.rates()
        p50, p99 = self.stream.counts.percentiles_ms()
        decode_ms = 1000.0 * self.reader.decode_s / self.reader.decoded if self.reader.decoded else None
        return {
            "id": self.id,
            "url": self.url.shown,
            "model": self.model,
            "state": self.state,
            "reason": self.reason,
            "created": self.created,
            "max_fps": self.options.max_fps,
            "max_age_ms": self.options.max_age_ms,
            "pace": "realtime" if self.options.realtime else "answered",
            "rtsp_transport": self.url.options.get("rtsp_transport"),  # None: not an RTSP source
            "options": self.options.task_options,
            "track": self.options.track.shown() if self.options.track is not None else None,
            "frames": self.frames(),
            "fps": {"in": round(fps_in, 3), "answered": round(fps_answered, 3)},
            "age_ms": {"p50": p50, "p99": p99},
            "decode_ms_per_frame": round(decode_ms, 3) if decode_ms is not None else None,
            "reconnects": self.reader.reconnects,
            "decode_errors": self.reader.decode_errors,  # packets FFmpeg could not decode, passed over
            "reader_alive": self.reader.alive,  # its thread, connection and decoder: false once finished
            "subscribers": len(self.subscribers),
        }


def _note(times: deque[float], now: float) -> None:
    """One more event at ``now``; those older than the rate window go (memory stays flat whoever reads it)."""
    times.append(now)
    while times[0] < now - RATE_WINDOW_S:
        times.popleft()


def _jpeg(image: Image.Image) -> bytes:
    """A frame as a page shows it: at most :data:`SHOWN_WIDTH` wide, JPEG."""
    if image.width > SHOWN_WIDTH:
        image = image.resize((SHOWN_WIDTH, round(image.height * SHOWN_WIDTH / image.width)))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=75)
    return out.getvalue()
