"""The one delivery of answers to readers (docs/streams.md, docs/sources.md): a bounded :class:`Outbox` per reader, a
stream session's client or a source's subscriber; and :class:`StreamSession`, the one stream session of both stream
transports (the WebSocket route and gRPC's ``ModelStreamInfer``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Generic, TypeVar

from service.core.tracking import Tracking, read_track
from service.frontend.state import ModelSlot, ServerState
from service.frontend.stream import FrameStream

log = logging.getLogger("visionserve.stream")

OUTBOX_LIMIT = 64  # answers not yet taken by a reader before it is cut off
M = TypeVar("M")  # an answer as its wire carries it


class Outbox(Generic[M]):
    """One reader's answers not yet taken, at most :data:`OUTBOX_LIMIT`: one more cuts the reader off (``cut_off``
    says why) and never waits. The last message (``last``) always finds room and nothing follows it."""

    reader = ""  # who is cut off, as its reason names it

    def __init__(self) -> None:
        self.held: deque[M] = deque()
        self.ready = asyncio.Event()  # something to take, or the end
        self.cut_off: str | None = None
        self.ended = False

    def put(self, message: M, last: bool = False) -> None:
        if self.cut_off is not None or self.ended:
            return
        if len(self.held) >= OUTBOX_LIMIT and not last:
            self.cut(f"{self.reader}left {OUTBOX_LIMIT} answers unread")
            return
        self.held.append(message)
        self.ended = last
        self.ready.set()

    def cut(self, why: str) -> None:
        if self.cut_off is None:
            self.cut_off = why
        self.ready.set()

    def end(self) -> None:
        """Nothing more will be put: :meth:`messages` ends once the held ones are taken."""
        self.ended = True
        self.ready.set()

    async def messages(self) -> AsyncIterator[M]:
        """Each message in order until the last one, or those held when the reader was cut off."""
        while True:
            while self.held:
                yield self.held.popleft()
            if self.cut_off is not None or self.ended:
                return
            self.ready.clear()
            await self.ready.wait()


class StreamSession(Outbox[M]):
    """One client's stream, whatever carries it. A transport subclasses it with :meth:`encode` (an answer dict to
    its wire's message) and :meth:`send` (one message to the client), sets :attr:`stream` and calls :meth:`run`
    with its reader. ``what`` names the transport in the log; ``done`` is set by the transport once the session
    has ended (what ``ServerState.drain`` waits for). The outbox ends once every frame read has its answer in it."""

    what = "stream"
    reader = "the client "

    def __init__(self, server: ServerState) -> None:
        super().__init__()
        self.server = server
        self.stream: FrameStream | None = None
        self.stop = asyncio.Event()  # read no more frames: draining, cut off, refused, the client gone
        self.done = asyncio.Event()
        self.draining = False
        self.send_timeout_s = server.settings.stream_send_timeout_s
        self.tracking: Tracking | None = None  # the stream asked to track its objects (docs/tracking.md)

    def track(self, asked: Any, slot: ModelSlot) -> None:
        """Track the stream's boxes where it asked (``asked``: its ``track``, None where it did not say): a
        BadInputError for a model whose answers are not boxes."""
        ask = read_track({} if asked is None else {"track": asked}, None, slot.spec.labels,
                         slot.task.boxes_field is not None)  # fmt: skip
        self.tracking = Tracking(ask) if ask is not None else None

    def encode(self, answer: dict[str, Any]) -> M:
        raise NotImplementedError

    async def send(self, message: M) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """The server drains: read no more frames, answer those held, then end."""
        self.draining = True
        self.stop.set()

    def frames_read(self) -> str:
        return f"{self.stream.counts.sent if self.stream is not None else 0} frames read"

    # ---- answers out ----------------------------------------------------------------------------------------
    def emit(self, answer: dict[str, Any]) -> None:
        """The stream's ``emit``: one answer into the outbox, or the client cut off when it is full."""
        events = []
        if self.tracking is not None and self.stream is not None and answer.get("status") == "result":
            stream = self.stream
            events = self.tracking.answered(answer, stream.slot.task, stream.want.options, answer["ts"])
        for message in (answer, *events):
            if self.cut_off is None:
                self.put(self.encode(message))

    def cut(self, why: str) -> None:
        if self.cut_off is None:
            log.warning("%s to %s cut off: %s", self.what, self.stream.slot.name if self.stream else "", why)
        super().cut(why)
        self.stop.set()

    async def _write(self) -> None:
        async for message in self.messages():
            if self.cut_off is not None:  # what it holds is not sent
                return
            try:
                await asyncio.wait_for(self.send(message), self.send_timeout_s)
            except TimeoutError:
                self.cut(f"an answer waited {self.send_timeout_s:g} s for the client to read it")
                return
            except Exception:  # the connection went away: nothing more to tell it
                self.stop.set()
                return

    # ---- the session ----------------------------------------------------------------------------------------
    async def run(self, read: Coroutine[Any, Any, None]) -> None:
        """Read frames (``read``) until the client closes, the server drains or the client is cut off; close the
        stream (every frame read is answered) and write what is left. Raises what failed the reader."""
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self._write())
        reader = loop.create_task(read)
        stopped = loop.create_task(self.stop.wait())
        try:
            await asyncio.wait([reader, stopped], return_when=asyncio.FIRST_COMPLETED)
            reader.cancel()  # read no more: a frame read now would only be answered expired
            if self.stream is not None:
                why = self.cut_off or ("the server is draining" if self.draining else "the client closed")
                await self.stream.close(why, timeout_s=self.server.settings.drain_timeout_s)
        except asyncio.CancelledError:  # the client cancelled, or the server stopped: nobody to answer
            writer.cancel()
            if self.stream is not None:  # every frame is still counted: the one computing as expired
                await self.stream.close("the call was cancelled", timeout_s=0)
            raise
        finally:
            stopped.cancel()
            reader.cancel()
            self.end()
        if self.cut_off is not None:  # its write is stuck, and nothing more will be written
            writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await writer
        failed = reader.exception() if reader.done() and not reader.cancelled() else None
        if failed is not None:
            raise failed  # every frame read is answered; the session fails as any request that went wrong
