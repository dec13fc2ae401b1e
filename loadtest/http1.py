"""A lean HTTP/1.1 client for the load generator: keep-alive connections over asyncio streams, one request each at a
time, a new connection whenever none is idle.

Why not httpx here: its connection pool does work per request that grows with the number of open connections. In an
open loop a stall leaves dozens of connections open, and measured on the 2-core development machine the generator
then fell behind its own schedule by 10-50 ms per request for the rest of the step, which is exactly the client-made
latency a load tester must not add. This client does only what sending a POST and reading the answer needs
(Content-Length or chunked bodies, ``Connection: close``), so its cost per request stays flat.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
IDLE_REUSE_S = 4.0  # under uvicorn's 5 s keep-alive timeout: older idle connections are closed, not reused


class ConnectionFailed(Exception):
    """The connection was refused, reset or closed before a whole answer came back."""


@dataclass(slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def close(self) -> None:
        self.writer.close()


class Http1Client:
    """``await post(path, body, headers)`` returns the status code; raises ``TimeoutError`` or ``ConnectionFailed``."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected an http:// or https:// address, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self.host_header = parts.netloc
        self.timeout_s = timeout_s
        self.idle: list[_Connection] = []

    def head(self, path: str, headers: dict[str, str], length: int) -> bytes:
        lines = [f"POST {path} HTTP/1.1", f"Host: {self.host_header}", f"Content-Length: {length}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _reusable(self) -> _Connection | None:
        """An idle connection the server has not closed (servers close idle keep-alives: uvicorn after 5 s)."""
        now = time.monotonic()
        while self.idle:
            conn = self.idle.pop()
            if now - conn.idle_since < IDLE_REUSE_S and not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn
            conn.close()
        return None

    async def _exchange(self, data: bytes, held: list[_Connection]) -> tuple[int, bool, dict[str, str], bytes]:
        """Send and read one answer; ``held`` names the connection in use, for the caller to drop on failure."""
        conn = self._reusable()
        if conn is not None:
            held.append(conn)
            try:
                conn.writer.write(data)
                return await _read_response(conn.reader)
            except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError) as exc:
                if isinstance(exc, asyncio.IncompleteReadError) and exc.partial:
                    raise
                # Closed or reset by the server before a byte of the answer: the keep-alive race every HTTP/1.1
                # client meets (the close crossed our request), sent again once on a new connection.
                held.pop().close()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self.ssl, limit=MAX_HEAD_BYTES)
        held.append(_Connection(reader, writer))
        writer.write(data)
        return await _read_response(reader)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> int:
        return (await self.fetch(path, body, headers))[0]

    async def fetch(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        """POST and return (status, response header fields, names lower-cased, the answer's body: read either way,
        keeping it costs nothing more); raises as :meth:`post`."""
        held: list[_Connection] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                status, keep_alive, fields, answer = await self._exchange(
                    self.head(path, headers, len(body)) + body, held
                )
            if keep_alive:
                held[-1].idle_since = time.monotonic()
                self.idle.append(held.pop())
            return status, fields, answer
        except TimeoutError:
            raise  # an OSError as well, but counted apart from a failed connection
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise ConnectionFailed(str(exc) or type(exc).__name__) from exc
        finally:
            self._drop_held(held)  # not kept alive, or its state unknown (failed, timed out, cancelled mid-answer)

    def _drop_held(self, held: list[_Connection]) -> None:
        while held:
            held.pop().close()

    async def aclose(self) -> None:
        self._drop_held(self.idle)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, code, *_ = lines[0].split(" ", 2)
    status = int(code)
    fields: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip()
            # A field sent on several lines is one list (RFC 9110 5.3): Server-Timing may come in pieces.
            fields[name] = f"{fields[name]}, {value}" if name in fields else value
    keep_alive = fields.get("connection", "").lower() != "close" and version == "HTTP/1.1"
    body = b""
    if "content-length" in fields:
        body = await reader.readexactly(int(fields["content-length"]))
    elif fields.get("transfer-encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunks.append((await reader.readexactly(size + 2))[:size])  # the chunk and its CRLF
            if size == 0:
                break
        body = b"".join(chunks)
    elif status >= 200 and status not in (204, 304):
        body = await reader.read()  # the body runs to the end of the connection
        keep_alive = False
    return status, keep_alive, fields, body
