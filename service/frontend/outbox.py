"""One stream session for both stream transports (the WebSocket route and gRPC's ``ModelStreamInfer``,
docs/streams.md): a reader feeds a :class:`~service.frontend.stream.FrameStream`, whose answers go, encoded for the
wire, through one bounded outbox to one writer.

A client that leaves :data:`OUTBOX_LIMIT` answers unsent, or does not take one within ``--stream-send-timeout-s``,
is cut off rather than holding answers (and frames) in server memory. The session ends once the client has closed
its side or the server drains (every frame read is answered first), or at once when cut off; the transport's last
word starts with "N frames read" (:meth:`StreamSession.frames_read`): the frames sent after those N were never read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from service.frontend.state import ServerState
from service.frontend.stream import FrameStream

log = logging.getLogger("visionserve.stream")

OUTBOX_LIMIT = 64  # answers not yet taken by the client before it is cut off
M = TypeVar("M")  # an answer as its wire carries it


class StreamSession(Generic[M]):
    """One client's stream, whatever carries it. A transport subclasses it with :meth:`encode` (an answer dict to
    its wire's message) and :meth:`send` (one message to the client), sets :attr:`stream` and calls :meth:`run`
    with its reader. ``what`` names the transport in the log; ``done`` is set by the transport once the session
    has ended (what ``ServerState.drain`` waits for)."""

    what = "stream"

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.stream: FrameStream | None = None
        self.outbox: deque[M] = deque()
        self.ready = asyncio.Event()  # something to write, or the end
        self.stop = asyncio.Event()  # read no more frames: draining, cut off, refused, the client gone
        self.done = asyncio.Event()
        self.draining = False
        self.cut_off: str | None = None
        self.finished = False  # every frame read has its answer in the outbox
        self.send_timeout_s = server.settings.stream_send_timeout_s

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
        if self.cut_off is not None:
            return
        if len(self.outbox) >= OUTBOX_LIMIT:
            self.cut(f"the client left {OUTBOX_LIMIT} answers unread")
            return
        self.outbox.append(self.encode(answer))
        self.ready.set()

    def cut(self, why: str) -> None:
        if self.cut_off is None:
            self.cut_off = why
            log.warning("%s to %s cut off: %s", self.what, self.stream.slot.name if self.stream else "", why)
        self.stop.set()
        self.ready.set()

    async def _write(self) -> None:
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.outbox and self.cut_off is None:
                try:
                    await asyncio.wait_for(self.send(self.outbox.popleft()), self.send_timeout_s)
                except TimeoutError:
                    self.cut(f"an answer waited {self.send_timeout_s:g} s for the client to read it")
                    return
                except Exception:  # the connection went away: nothing more to tell it
                    self.stop.set()
                    return
            if self.cut_off is not None or self.finished:
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
            self.finished = True
            self.ready.set()
        if self.cut_off is not None:  # its write is stuck, and nothing more will be written
            writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await writer
        failed = reader.exception() if reader.done() and not reader.cancelled() else None
        if failed is not None:
            raise failed  # every frame read is answered; the session fails as any request that went wrong
