"""``/v1/models/{m}/stream``: a WebSocket of frames in, one JSON answer per frame out (docs/streams.md), through the
stream session both stream transports share (:mod:`service.frontend.outbox`). The query holds the model's task's
options, read and checked as its image route reads them; a query the task does not take is passed over.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import struct
from typing import Annotated, Any

from litestar import WebSocket, websocket
from litestar.params import FromPath, PathParameter

from service.core.errors import VisionServeError
from service.frontend import request as path
from service.frontend.http.image_api import query_values, server_of
from service.frontend.outbox import StreamSession
from service.frontend.state import ServerState
from service.frontend.stream import Frame, FrameStream, stream_max_age, stream_want

FRAME_FORMAT = 'docs/streams.md: a binary message is a 4-byte header length, a JSON header {"id", "ts"}, then the image'
CLOSE_TIMEOUT_S = 2.0
NOT_READING, GOING_AWAY, POLICY, INTERNAL, NOT_FOUND = 1008, 1001, 1008, 1011, 4404
MAX_REASON_BYTES = 123  # a close frame's payload is at most 125 bytes, 2 of them the code


def close_reason(text: str) -> str:
    """``text`` cut to what a close frame holds: 123 bytes of UTF-8 (RFC 6455, 5.5.1), not 120 characters (a query's
    unicode echoed in the refusal made the close a protocol error, and the socket ended 4500 instead of 1008)."""
    return text.encode("utf-8", "replace")[:MAX_REASON_BYTES].decode("utf-8", "ignore")


class Session(StreamSession[str]):
    """One WebSocket stream: its frames read off the socket, its answers sent as JSON text."""

    def __init__(self, socket: WebSocket[Any, Any, Any], server: ServerState, stream_args: dict[str, Any]) -> None:
        super().__init__(server)
        self.socket = socket
        self.stream = FrameStream(emit=self.emit, **stream_args)

    def encode(self, answer: dict[str, Any]) -> str:
        return json.dumps(answer, separators=(",", ":"))

    async def send(self, message: str) -> None:
        await self.socket.send_text(message)

    async def serve(self) -> None:
        """Frames in, answers out, then the close: 1008 when cut off, else 1001 (the client may be gone)."""
        assert self.stream is not None
        self.stream.start()
        try:
            await self.run(self._read())
        finally:
            # The close says how many frames the server read: the client knows the ones sent after them were not.
            read = self.frames_read()
            code, why = (NOT_READING, f"{read}; {self.cut_off}") if self.cut_off else (GOING_AWAY, f"{read}; draining")
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.socket.close(code=code, reason=close_reason(why)), CLOSE_TIMEOUT_S)

    async def _read(self) -> None:
        stopped = asyncio.get_running_loop().create_task(self.stop.wait())
        try:
            while not self.stop.is_set():
                # Each receive raced with the stop: the writer gets its turns while a burst is read, so a client
                # is cut off for not reading its answers, not for sending fast.
                receive = asyncio.ensure_future(self.socket.receive())
                await asyncio.wait([receive, stopped], return_when=asyncio.FIRST_COMPLETED)
                if not receive.done():
                    receive.cancel()
                    return
                message = receive.result()
                if message["type"] == "websocket.disconnect":
                    return
                self._frame(dict(message))
        finally:
            stopped.cancel()

    def _frame(self, message: dict[str, Any]) -> None:
        """One message: a frame offered, or, for one that is not a frame, an error answered for it alone."""
        stream = self.stream
        assert stream is not None
        data, text = message.get("bytes"), message.get("text")
        try:
            if data is not None:
                (length,) = struct.unpack(">I", data[:4])
                header, image = json.loads(data[4 : 4 + length]), data[4 + length :]
            else:
                header, image = json.loads(text or ""), None
            if not isinstance(header, dict):  # ``[]`` or ``5``: JSON, but no header ("[]".get was an AttributeError)
                raise ValueError(f"the header is not a JSON object but {type(header).__name__}")
            if image is None:
                image = base64.b64decode(header.get("image_b64") or "", validate=True)
        except (struct.error, ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError) as exc:
            stream.reject(None, None, f"not a frame: {exc} ({FRAME_FORMAT})")
            return
        frame_id, ts = header.get("id"), header.get("ts")
        if not image:
            stream.reject(frame_id, ts, "the frame holds no image")
            return
        stream.offer(Frame(frame_id, ts, bytes(image)))


@websocket(["/v1/models/{model:str}/stream", "/v1/models/{model:str}/versions/{version:str}/stream"])
async def stream(
    socket: WebSocket[Any, Any, Any], model: FromPath[str], version: Annotated[str | None, PathParameter()] = None
) -> None:
    """Frames in, an answer per frame out, newest frame first: docs/streams.md."""
    server = server_of(socket)
    await socket.accept()
    params = socket.query_params
    try:
        max_age_ms = stream_max_age(params.get("max_age_ms"))
        where = path.target(server, model, version, dict(socket.headers), aliases=False)
        want = stream_want(where.slot, query_values(params, where.slot.task.Options), text=True)
        name = where.slot.name
        stream_args = {"where": where, "max_age_ms": max_age_ms, "want": want,
                       "on_outcome": server.stream_outcome(name)}  # fmt: skip
        session = Session(socket, server, stream_args)
        session.track(params["track"] in ("1", "true") if "track" in params else None, where.slot)
    except VisionServeError as exc:
        code = NOT_FOUND if exc.http_status == 404 else POLICY if exc.http_status == 400 else INTERNAL
        await socket.send_text(json.dumps({"id": None, "status": "error", "error": str(exc)}))
        await socket.close(code=code, reason=close_reason(str(exc)))
        return
    try:
        with server.stream_open(name, session):
            await session.serve()
    finally:
        session.done.set()
