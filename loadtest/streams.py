"""The load tester's streams mode (README, "Load testing"; docs/streams.md): N WebSocket streams, each sending
frames at its own rate, evenly spaced, the streams' first frames staggered so that together they arrive evenly
(stream ``k`` starts at ``k / total fps``). The loop is open: client latency counts from each frame's scheduled
moment, and a sender that falls behind keeps the gap as the frame's send lag. Every frame is recorded with its fate,
``age_ms``, the batch compute it rode in and when its answer came; unanswered after ``drain_s`` it is ``lost``, and an
answer for no frame sent (or a frame's second answer) is ``unexpected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from loadtest.runner import on_fresh_loop, sleep_until

START_DELAY_S = 0.2  # after every stream is open, before the first frame: the schedules start together
TICK_S = 0.25  # how often ``on_tick`` hears of the counts
STATUSES = ("result", "superseded", "expired", "error", "lost")
STAGES = ("wait", "decode", "queue")  # where an expired frame was dropped (docs/streams.md)


@dataclass(frozen=True)
class StreamPlan:
    """What a streams run does: ``streams`` streams to ``model`` at ``url``, each at ``fps`` frames per second
    (the first at ``fps_first`` when given) for ``warmup_s + duration_s``; frames scheduled in the warm-up are
    sent and accounted for but left out of the figures."""

    url: str
    model: str
    streams: int
    fps: float
    max_age_ms: float = 500.0
    fps_first: float | None = None
    duration_s: float = 10.0
    warmup_s: float = 0.0
    drain_s: float = 10.0
    connect_timeout_s: float = 30.0
    top_k: int = 1

    def __post_init__(self) -> None:
        rates = (self.fps, self.fps_first if self.fps_first is not None else self.fps)
        if self.streams < 1 or min(rates) <= 0 or self.duration_s <= 0 or self.warmup_s < 0 or self.drain_s < 0:
            raise ValueError(
                f"a streams run needs streams >= 1, fps > 0, duration > 0, warm-up and drain >= 0; got streams "
                f"{self.streams}, fps {self.fps:g} (first {rates[1]:g}), duration {self.duration_s:g} s, warm-up "
                f"{self.warmup_s:g} s, drain {self.drain_s:g} s"
            )

    def rate(self, stream: int) -> float:
        """Stream ``stream``'s frames per second."""
        return self.fps_first if stream == 0 and self.fps_first is not None else self.fps

    @property
    def total_fps(self) -> float:
        return sum(self.rate(k) for k in range(self.streams))

    @property
    def end_s(self) -> float:
        return self.warmup_s + self.duration_s

    def phase_s(self, stream: int) -> float:
        """When stream ``stream``'s first frame is due: the streams' schedules interleave."""
        return stream / self.total_fps

    def frames(self, stream: int) -> int:
        """How many frames stream ``stream`` sends: those due before the run's end."""
        return max(0, math.ceil((self.end_s - self.phase_s(stream)) * self.rate(stream)))

    @property
    def ws_url(self) -> str:
        base = self.url.rstrip("/").replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        return f"{base}/v1/models/{quote(self.model, safe='')}/stream?max_age_ms={self.max_age_ms:g}&top_k={self.top_k}"


@dataclass(slots=True)
class FrameRecord:
    """One frame: when it was due and sent, its answer, and when that came back (seconds from the run's start)."""

    stream: int
    id: int
    due_s: float
    sent_s: float = math.nan
    done_s: float = math.nan
    status: str = "lost"  # until its answer comes
    age_ms: float = math.nan
    stage: str = ""  # of an expired frame
    compute_ms: float = math.nan  # of an answered frame: its batch's compute (timings_ms.compute)
    error: str = ""

    @property
    def latency_ms(self) -> float:
        """From the frame's scheduled send to its answer: what the camera's user waited."""
        return 1000.0 * (self.done_s - self.due_s)

    @property
    def send_lag_ms(self) -> float:
        return 1000.0 * (self.sent_s - self.due_s)


@dataclass
class StreamLog:
    """One stream's frames (index = frame id) and how it ended."""

    index: int
    fps: float
    frames: list[FrameRecord] = field(default_factory=list)
    scheduled: int = 0  # frames due before the run's end: sent unless the connection failed first
    unexpected: int = 0  # answers for no frame sent, or a second answer for a frame
    late: int = 0  # answers that came after the grace period (their frames stay lost)
    close_code: int | None = None
    close_reason: str = ""
    failure: str = ""  # the stream could not open, or the server ended it early


@dataclass
class StreamRun:
    plan: StreamPlan
    streams: list[StreamLog]
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time: a busy client may set the pace

    @property
    def client_cpu(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s else 0.0


Tick = Callable[[float, int, int], None]  # (elapsed s, frames sent, answers) about every TICK_S


def frame_message(frame_id: int, ts: float, image: bytes) -> bytes:
    """A binary frame: 4-byte big-endian header length, the JSON header, the encoded image."""
    header = json.dumps({"id": frame_id, "ts": ts}, separators=(",", ":")).encode()
    return struct.pack(">I", len(header)) + header + image


def _connect(plan: StreamPlan) -> Any:
    from websockets.asyncio.client import connect

    # No compression (JPEGs do not shrink; it would cost both sides CPU), no proxy from the environment, and room
    # for every answer the server may have in flight, so the client's reading never backs the server up.
    return connect(plan.ws_url, compression=None, proxy=None, open_timeout=plan.connect_timeout_s,
                   max_queue=4096, close_timeout=5)  # fmt: skip


class _Stream:
    def __init__(self, plan: StreamPlan, index: int, images: Sequence[bytes], counts: list[int]) -> None:
        self.plan, self.index, self.images, self.counts = plan, index, images, counts
        self.log = StreamLog(index, plan.rate(index), scheduled=plan.frames(index))
        self.sending_done = False
        self.given_up = False  # the grace period has passed: an answer now is late
        self.all_answered = asyncio.Event()
        self.answered = 0

    def _answer(self, text: str | bytes, origin: float) -> None:
        done = time.perf_counter() - origin
        try:
            answer = json.loads(text)
            frame_id = answer.get("id")
            known = type(frame_id) is int and 0 <= frame_id < len(self.log.frames)
            record = self.log.frames[frame_id] if known else None
            if record is None or record.status != "lost":  # no such frame, or its second answer
                self.log.unexpected += 1
                return
            fields = (
                str(answer["status"]),
                float(answer.get("age_ms", math.nan)),
                str(answer.get("stage", "")),
                str(answer.get("error", "")),
                float((answer.get("timings_ms") or {}).get("compute", math.nan)),
            )
        except (ValueError, TypeError, AttributeError, KeyError):  # not an answer as docs/streams.md writes them
            self.log.unexpected += 1
            return
        if self.given_up:
            self.log.late += 1
            return
        record.done_s = done
        record.status, record.age_ms, record.stage, record.error, record.compute_ms = fields
        self.answered += 1
        self.counts[1] += 1
        if self.sending_done and self.answered >= len(self.log.frames):
            self.all_answered.set()

    async def _receive(self, ws: Any, origin: float) -> None:
        with contextlib.suppress(Exception):  # the connection ends: the close code says how
            async for message in ws:
                self._answer(message, origin)

    async def run(self, ws: Any, origin: float) -> StreamLog:
        plan, log = self.plan, self.log
        receiver = asyncio.get_running_loop().create_task(self._receive(ws, origin))
        rate, phase = plan.rate(self.index), plan.phase_s(self.index)
        try:
            for i in range(log.scheduled):
                due = phase + i / rate
                await sleep_until(origin + due)
                if receiver.done():  # the server closed the stream: nothing more can be sent
                    break
                record = FrameRecord(self.index, i, due)
                log.frames.append(record)
                image = self.images[(self.index * 7 + i) % len(self.images)]
                record.sent_s = time.perf_counter() - origin
                await ws.send(frame_message(i, round(1000.0 * due, 3), image))
                self.counts[0] += 1
        except Exception as exc:  # the connection failed under a send
            log.failure = f"sending failed: {type(exc).__name__}: {exc}"
        self.sending_done = True
        if self.answered >= len(log.frames):
            self.all_answered.set()
        waiter = asyncio.ensure_future(self.all_answered.wait())
        grace_s = origin + plan.end_s + plan.drain_s - time.perf_counter()
        await asyncio.wait([waiter, receiver], timeout=max(0.0, grace_s), return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        self.given_up = True
        with contextlib.suppress(Exception):
            await ws.close()
        with contextlib.suppress(TimeoutError, asyncio.CancelledError):
            await asyncio.wait_for(receiver, 5.0)
        log.close_code, log.close_reason = ws.close_code, ws.close_reason or ""
        if log.close_code not in (None, 1000) and not log.failure:
            log.failure = f"the server closed the stream: {log.close_code} {log.close_reason}".strip()
        return log


async def run_streams_async(plan: StreamPlan, images: Sequence[bytes], on_tick: Tick | None = None) -> StreamRun:
    """Open every stream, run the schedules, wait for the answers; every frame's record in the result."""
    if not images:
        raise ValueError("a streams run needs at least one image")
    counts = [0, 0]  # frames sent, answers
    streams = [_Stream(plan, k, images, counts) for k in range(plan.streams)]
    sockets: list[Any] = await asyncio.gather(*(_open(plan, s.log) for s in streams))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    origin = time.perf_counter() + START_DELAY_S
    tasks = [asyncio.ensure_future(s.run(ws, origin)) for s, ws in zip(streams, sockets, strict=True) if ws is not None]
    ticker = asyncio.ensure_future(_tick(origin, counts, on_tick)) if on_tick is not None else None
    if tasks:
        await asyncio.gather(*tasks)
    if ticker is not None:
        ticker.cancel()
        on_tick(time.perf_counter() - origin, counts[0], counts[1])  # type: ignore[misc]
    return StreamRun(plan, [s.log for s in streams], time.perf_counter() - wall0, time.process_time() - cpu0)


async def _open(plan: StreamPlan, log: StreamLog) -> Any:
    try:
        return await _connect(plan)
    except Exception as exc:
        log.failure = f"could not open {plan.ws_url}: {type(exc).__name__}: {exc}"
        return None


async def _tick(origin: float, counts: list[int], on_tick: Tick) -> None:
    while True:
        await asyncio.sleep(TICK_S)
        on_tick(max(0.0, time.perf_counter() - origin), counts[0], counts[1])


def run_streams(plan: StreamPlan, images: Sequence[bytes], on_tick: Tick | None = None) -> StreamRun:
    """:func:`run_streams_async` on a fresh event loop (uvloop where installed)."""
    return on_fresh_loop(run_streams_async(plan, images, on_tick))


async def _preflight_async(plan: StreamPlan, image: bytes) -> str | None:
    try:
        async with _connect(plan) as ws:
            await ws.send(frame_message(0, 0.0, image))
            answer = json.loads(await asyncio.wait_for(ws.recv(), plan.connect_timeout_s))
    except Exception as exc:
        return f"{plan.ws_url}: {type(exc).__name__}: {exc}"
    if answer.get("status") != "result":
        return f"{plan.ws_url} answered a first frame with {json.dumps(answer)[:300]}"
    return None


def preflight(plan: StreamPlan, image: bytes) -> str | None:
    """One frame on one stream before any clock starts (the model warm, the route proven); why not, or None."""
    return asyncio.run(_preflight_async(plan, image))
