"""``/v1/models/{m}/stream``: a WebSocket of frames in, one JSON answer per frame out (docs/streams.md).

The reader feeds :class:`~service.frontend.stream.FrameStream` (latest-frame semantics); answers go through a
bounded outbox to a sender task, so a client that stops reading is cut off (1008) instead of holding answers, and
frames, in server memory. A drain answers every frame the stream holds, then closes with 1001.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import struct
from collections import deque
from typing import Annotated, Any

from litestar import WebSocket, websocket
from litestar.params import FromPath, PathParameter

from service.core.errors import VisionServeError
from service.frontend.state import ServerState
from service.frontend.stream import Frame, FrameStream, stream_options

log = logging.getLogger("visionserve.stream")

OUTBOX_LIMIT = 64  # answers not yet taken by the client before it is cut off
CLOSE_TIMEOUT_S = 2.0
NOT_READING, GOING_AWAY, POLICY, INTERNAL, UNKNOWN_MODEL = 1008, 1001, 1008, 1011, 4404


class Session:
    """One WebSocket stream: reader, sender, and the frame stream between them."""

    def __init__(self, socket: WebSocket[Any, Any, Any], server: ServerState, stream_args: dict[str, Any]) -> None:
        self.socket = socket
        self.server = server
        self.outbox: deque[str] = deque()
        self.ready = asyncio.Event()
        self.stop = asyncio.Event()  # the reader stops: cut off, draining
        self.cut_off: str | None = None
        self.done = asyncio.Event()  # the stream has ended and the socket is closed
        self.stream = FrameStream(emit=self._emit, **stream_args)

    def _emit(self, answer: dict[str, Any]) -> None:
        if len(self.outbox) >= OUTBOX_LIMIT:
            self._cut(f"the client left {OUTBOX_LIMIT} answers unread")
            return
        self.outbox.append(json.dumps(answer, separators=(",", ":")))
        self.ready.set()

    def _cut(self, why: str) -> None:
        if self.cut_off is None:
            self.cut_off = why
            log.warning("stream to %s cut off: %s", self.stream.slot.name, why)
        self.stop.set()
        self.ready.set()

    def drain(self) -> None:
        """The server drains: read no more frames; answer those held; close (1001)."""
        self.stop.set()

    async def run(self) -> None:
        self.stream.start()
        sender = asyncio.get_running_loop().create_task(self._send())
        try:
            await self._read()
            reason = self.cut_off or ("the server is draining" if self.server.draining else "the client closed")
            await self.stream.close(reason, timeout_s=self.server.settings.drain_timeout_s)
        finally:
            self.ready.set()
            self.stop.set()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(sender, self.server.settings.stream_send_timeout_s)
        # The close says how many frames the server read: the client knows the ones sent after them were not.
        read = f"{self.stream.counts.sent} frames read"
        code, why = (NOT_READING, f"{read}; {self.cut_off}") if self.cut_off else (GOING_AWAY, f"{read}; draining")
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.socket.close(code=code, reason=why[:120]), CLOSE_TIMEOUT_S)

    async def _read(self) -> None:
        stopped = asyncio.get_running_loop().create_task(self.stop.wait())
        try:
            while not self.stop.is_set():
                receive = asyncio.ensure_future(self.socket.receive())
                await asyncio.wait([receive, stopped], return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    receive.cancel()
                    return
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    self.stop.set()
                    return
                self._frame(dict(message))
        finally:
            stopped.cancel()

    def _frame(self, message: dict[str, Any]) -> None:
        data, text = message.get("bytes"), message.get("text")
        try:
            if data is not None:
                (length,) = struct.unpack(">I", data[:4])
                header = json.loads(data[4 : 4 + length])
                image = data[4 + length :]
            else:
                header = json.loads(text or "")
                image = base64.b64decode(header.get("image_b64") or "", validate=True)
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
        except (struct.error, ValueError, TypeError, binascii.Error, UnicodeDecodeError) as exc:
            self.stream.reject(None, None, f"not a frame: {exc} (docs/streams.md: a binary message is a 4-byte "
                               "header length, a JSON header {\"id\", \"ts\"}, then the image)")  # fmt: skip
            return
        frame_id, ts = header.get("id"), header.get("ts")
        if not image:
            self.stream.reject(frame_id, ts, "the frame holds no image")
            return
        self.stream.offer(Frame(frame_id, ts, bytes(image)))

    async def _send(self) -> None:
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.outbox and self.cut_off is None:
                text = self.outbox.popleft()
                limit_s = self.server.settings.stream_send_timeout_s
                try:
                    await asyncio.wait_for(self.socket.send_text(text), limit_s)
                except TimeoutError:
                    self._cut(f"an answer waited {limit_s:g} s for the client to read it")
                    return
                except Exception:  # the connection went away: nothing more to tell it
                    self.stop.set()
                    return
            if self.cut_off is not None or (self.stop.is_set() and self.stream.closed):
                return


@websocket(["/v1/models/{model:str}/stream", "/v1/models/{model:str}/versions/{version:str}/stream"])
async def stream(
    socket: WebSocket[Any, Any, Any], model: FromPath[str], version: Annotated[str | None, PathParameter()] = None
) -> None:
    """Frames in, an answer per frame out, newest frame first: docs/streams.md."""
    server: ServerState = socket.app.state.server
    await socket.accept()
    params = socket.query_params
    try:
        max_age_ms, top_k = stream_options(params.get("max_age_ms"), params.get("top_k"))
        slot = server.slot(model, version)
    except VisionServeError as exc:
        code = UNKNOWN_MODEL if exc.http_status == 404 else POLICY if exc.http_status == 400 else INTERNAL
        await socket.send_text(json.dumps({"id": None, "status": "error", "error": str(exc)}))
        await socket.close(code=code, reason=str(exc)[:120])
        return
    route = server.route(slot.name, version, dict(socket.headers))
    session = Session(socket, server, {"slot": slot, "max_age_ms": max_age_ms, "top_k": top_k, "route": route,
                                       "on_outcome": server.stream_outcome(slot.name)})  # fmt: skip
    try:
        with server.stream_open(slot.name, session):
            await session.run()
    finally:
        session.done.set()
