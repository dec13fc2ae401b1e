"""A source's reader: one thread that opens its URL with PyAV (FFmpeg's libraries), decodes every frame, and hands
the ones it keeps to the source (docs/sources.md: the pacing, the reconnects and their backoff). Blocking reads are
bounded: PyAV's ``timeout`` (open, read) interrupts FFmpeg, the URL's own socket options
(:mod:`service.frontend.sources.urls`) bound its sockets, and :meth:`Reader.stop` is noticed between frames and
within a read's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, InitVar, dataclass
from typing import Any

from service.frontend.sources.urls import SourceUrl

log = logging.getLogger("visionserve.sources")

BACKOFF_START_S = 0.1


@dataclass(slots=True)
class Picture:
    """A decoded frame as the reader hands it on: its index in the source (from 0, across reconnects), its
    presentation time in seconds (None where the stream gives none), when it was decoded (``time.perf_counter()``;
    a file's frame at realtime pace: when its play time came; a frame's age runs from here) and the frame itself (a
    PyAV ``VideoFrame``)."""

    index: int
    pts: float | None
    decoded: float
    frame: Any


@dataclass(frozen=True, slots=True)
class Pace:
    """How the reader hands frames on: at most ``max_fps`` (0: every frame); a file ``realtime`` (at its own rate)
    or as fast as answered."""

    max_fps: float = 0.0
    realtime: bool = True


@dataclass(eq=False)
class Reader:
    """The decode thread of one source. ``hand(picture)`` is called on the thread with each frame kept;
    ``on_state(state, reason)`` on each change (``connecting``, ``running``, ``reconnecting``, ``ended``,
    ``failed``); ``on_skip()`` for each frame ``max_fps`` leaves out. With ``answered`` pacing the reader waits,
    after handing a frame, for :meth:`answered` before it decodes the next."""

    url: SourceUrl
    _: KW_ONLY
    name: InitVar[str]
    hand: Callable[[Picture], object]
    on_state: Callable[[str, str], object]
    on_skip: Callable[[], object]
    pace: Pace
    max_pixels: int
    connect_timeout_s: float
    read_timeout_s: float
    backoff_cap_s: float = 1.0

    def __post_init__(self, name: str) -> None:
        self.decoded = 0
        self.reconnects = 0
        self.decode_s = 0.0  # the thread's time decoding, for the cost per frame
        self.decode_errors = 0  # packets FFmpeg could not decode (passed over)
        self._stop = threading.Event()
        self._answered = threading.Event()
        self._answered.set()
        self._thread = threading.Thread(target=self._run, name=f"source-{name}", daemon=True)

    # ---- control (any thread) ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._answered.set()

    def set_pace(self, pace: Pace) -> None:
        self.pace = pace
        self._answered.set()

    def answered(self) -> None:
        """The last frame handed on has its answer: with ``answered`` pacing, the next may be decoded."""
        self._answered.set()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end; True once it has (its decoder and connection freed)."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---- the thread --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        backoff = BACKOFF_START_S
        opened_once = False
        self.on_state("connecting", "")
        while not self._stop.is_set():
            try:
                container = self._open()
            except Exception as exc:
                why = self._reason(exc)
                if not opened_once or not self.url.live:
                    self.on_state("failed", f"cannot open {self.url.shown}: {why}")
                    return
                self.on_state("reconnecting", why)
                self._stop.wait(backoff)
                backoff = min(self.backoff_cap_s, backoff * 2)
                continue
            opened_once = True
            try:
                ended = self._play(container)
                why = "the stream ended"
            except _Refused as exc:
                self.on_state("failed", str(exc))
                return
            except Exception as exc:
                ended, why = False, self._reason(exc)
            finally:
                _close(container)
            if self._stop.is_set():
                return
            if not self.url.live:  # a file read again would fail again where it did
                self.on_state(*(("ended", "the file ended") if ended else ("failed", why)))
                return
            self.on_state("reconnecting", why)
            backoff = BACKOFF_START_S  # it was running: the first retry comes soon
            self._stop.wait(backoff)
            self.reconnects += 1

    def _reason(self, exc: BaseException) -> str:
        """What went wrong, the URL in it masked (FFmpeg's messages name the URL, credentials and all)."""
        text = str(exc) or type(exc).__name__
        text = text if type(exc).__name__ in text else f"{type(exc).__name__}: {text}"
        return self.url.redact(text)

    def _open(self) -> Any:
        import av  # PyAV: imported where a source starts (the serving install without it still serves images)

        return av.open(
            self.url.target,
            format=self.url.format,
            options=dict(self.url.options),
            timeout=(self.connect_timeout_s, self.read_timeout_s),
        )

    def _play(self, container: Any) -> bool:
        """Decode until the stream ends (True), or the reader stops (False); raises what broke the stream."""
        from av.error import InvalidDataError

        if not container.streams.video:
            raise _Refused(f"{self.url.shown} has no video stream")
        stream = container.streams.video[0]
        self._check_size(stream.codec_context.width, stream.codec_context.height, "the stream's header gives frames of")
        stream.thread_count = 1  # one thread a source: many sources share the cores
        started_wall: float | None = None
        first_pts: float | None = None
        last_handed = 0.0
        running = False
        clock = time.perf_counter
        for packet in container.demux(stream):
            if self._stop.is_set():
                return False
            began = clock()
            try:
                frames = packet.decode()
            except InvalidDataError:  # a corrupt packet costs its own frame(s), not the source
                self.decode_errors += 1
                frames = []
            self.decode_s += clock() - began
            for frame in frames:
                decoded = clock()
                self.decoded += 1
                self._check_size(frame.width, frame.height, "a decoded frame is")  # a stream may change size
                if not running:
                    running = True
                    self.on_state("running", "")
                pts = float(frame.pts * frame.time_base) if frame.pts is not None and frame.time_base else None
                pace = self.pace
                if not self.url.live and pace.realtime and pts is not None:
                    if started_wall is None or first_pts is None:
                        started_wall, first_pts = decoded, pts
                    wait = started_wall + (pts - first_pts) - clock()
                    if wait > 0 and self._stop.wait(wait):
                        return False
                    # Its age runs from its play time: decoding runs ahead of it (up to a frame's interval, more
                    # with reordering), and at 1 fps every frame was past a 500 ms max_age_ms before it was handed on.
                    decoded = clock()
                if pace.max_fps > 0 and decoded - last_handed < 1.0 / pace.max_fps:
                    self.on_skip()
                    continue
                last_handed = decoded
                if not self.url.live and not pace.realtime:
                    self._answered.clear()
                self.hand(Picture(self.decoded - 1, pts, decoded, frame))
                while not self._answered.wait(0.5):  # as fast as answered: the next once this one is
                    if self._stop.is_set():
                        return False
        return True

    def _check_size(self, width: int, height: int, said: str) -> None:
        """Refuse a frame over the pixel cap. The stream's header (what FFmpeg's probe read at open: H.264's SPS, a
        JPEG's frame header) is checked before any frame is decoded, so an oversized stream costs no decode and no
        frame buffer; each decoded frame is checked again, as a stream may change its size mid-way (a header that
        gives no size, 0x0, is left to that check)."""
        if width * height > self.max_pixels:
            raise _Refused(
                f"{said} {width}x{height}, over the {self.max_pixels} pixels a frame may have (--source-max-pixels)"
            )


class _Refused(Exception):
    """The stream is readable but not servable (no video, frames over the pixel cap): the source fails."""


def _close(container: Any) -> None:
    try:
        container.close()
    except Exception:  # closing a broken connection: nothing more to free
        log.debug("closing a source's container", exc_info=True)
