"""The other front ends' way to the sources' owner, ``fe0`` (docs/sources.md, "One owner"): plain HTTP/1.1 over the
Unix socket the supervisor gives it, one connection a request (``Connection: close``); an answer is read whole, a
results stream as the owner's Server-Sent Events, line by line. Standard library only (the serving install has no
HTTP client).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from service.core.errors import OverloadedError

CONNECT_TIMEOUT_S = 5.0
ANSWER_TIMEOUT_S = 60.0
PASSED_HEADERS = ("authorization", "content-type")


@dataclass
class Forwarded:
    """The owner's answer: its status and its JSON body."""

    status: int
    body: Any


@dataclass
class Owner:
    """The front end that runs the sources, reached at ``path`` (a Unix socket)."""

    path: str

    async def _open(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, int, dict[str, str]]:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise OverloadedError(f"the front end that runs the sources cannot be reached: {exc}") from None
        try:
            lines = [f"{method} {target} HTTP/1.1", "Host: sources", "Connection: close"]
            lines += [f"Content-Length: {len(body)}"]
            lines += [f"{k}: {v}" for k, v in headers.items() if k.lower() in PASSED_HEADERS]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            status_line = await reader.readline()
            try:
                status = int(status_line.split()[1])
            except (IndexError, ValueError):
                raise OverloadedError("the front end that runs the sources answered nothing") from None
            answer_headers: dict[str, str] = {}
            while True:
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                answer_headers[name.strip().lower()] = value.strip()
        except BaseException:
            writer.close()
            raise
        return reader, writer, status, answer_headers

    async def request(self, method: str, target: str, headers: Mapping[str, str], body: bytes = b"") -> Forwarded:
        """``method target`` (path and query) answered by the owner, its JSON body read whole."""

        async def exchange() -> Forwarded:
            reader, writer, status, answer_headers = await self._open(method, target, headers, body)
            try:
                if "content-length" in answer_headers:
                    raw = await reader.readexactly(int(answer_headers["content-length"]))
                else:
                    raw = b"".join([data async for data in _chunks(reader, answer_headers)])
            finally:
                writer.close()
            try:
                return Forwarded(status, json.loads(raw) if raw else None)
            except ValueError:  # not one of the routes' answers (a refusal before them): passed on as text
                return Forwarded(status, {"error": raw.decode("utf-8", "replace")[:500]})

        try:
            return await asyncio.wait_for(exchange(), ANSWER_TIMEOUT_S)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            raise OverloadedError(f"the front end that runs the sources did not answer: {exc}") from None

    async def events(self, target: str, headers: Mapping[str, str]) -> AsyncIterator[str]:
        """The owner's Server-Sent Events at ``target``: each ``data:`` payload, as long as the owner sends them.
        A refusal (not 200) is yielded as one JSON error message."""
        reader, writer, status, answer_headers = await self._open("GET", target, headers, b"")
        try:
            if status != 200:
                raw = await reader.read()
                yield json.dumps({"status": "error", "code": status, "error": raw.decode("utf-8", "replace")[:500]})
                return
            pending = b""
            async for data in _chunks(reader, answer_headers):
                *lines, pending = (pending + data).split(b"\n")
                for line in lines:
                    if line.startswith(b"data:"):
                        yield line[5:].decode("utf-8", "replace").strip()
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


async def _chunks(reader: asyncio.StreamReader, headers: Mapping[str, str]) -> AsyncIterator[bytes]:
    """The body's bytes as they come, chunked or not (per the answer's ``headers``), until its end."""
    chunked = headers.get("transfer-encoding", "").lower() == "chunked"
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readline()
        else:
            data = await reader.read(65536)
            if not data:
                return
        yield data
