"""Clients for the hostile-client tests: an ordinary closed-loop client that measures latency, and the hostile
ones (slowloris bodies, answers never read) over raw asyncio streams. Every loop is bounded in count and in time."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtest.http1 import ConnectionFailed, Http1Client
from service.launcher import roles
from tests.conftest import encode_image

CLASSIFY = "/v1/models/digits/classify"


def digit_png() -> bytes:
    """A small PNG of a digit-like stroke (8x8 scaled up), a few hundred bytes."""
    image = np.zeros((32, 32), np.uint8)
    image[4:28, 14:18] = 255
    return encode_image(image, "PNG")


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


@dataclass
class Run:
    latencies_s: list[float] = field(default_factory=list)
    statuses: Counter[object] = field(default_factory=Counter)
    wall_s: float = 0.0

    @property
    def p50_ms(self) -> float:
        return percentile(self.latencies_s, 50) * 1e3

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies_s, 99) * 1e3

    def line(self, name: str) -> str:
        return (
            f"{name}: {len(self.latencies_s)} requests in {self.wall_s:.1f} s, p50 {self.p50_ms:.1f} ms, "
            f"p99 {self.p99_ms:.1f} ms, statuses {dict(self.statuses)}"
        )


async def ordinary(url: str, body: bytes, *, requests: int, concurrency: int, timeout_s: float = 30) -> Run:
    """``requests`` classify calls from ``concurrency`` closed loops, each answered request timed."""
    client = Http1Client(url, timeout_s=timeout_s)
    run = Run()
    left = requests

    async def loop() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            started = time.perf_counter()
            try:
                status: object = await client.post(CLASSIFY, body, {"Content-Type": "image/png"})
            except (TimeoutError, ConnectionFailed) as exc:
                status = type(exc).__name__
            run.latencies_s.append(time.perf_counter() - started)
            run.statuses[status] += 1

    started = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(loop() for _ in range(concurrency))), timeout_s * 4)
    finally:
        await client.aclose()
    run.wall_s = time.perf_counter() - started
    return run


def head(path: str, port: int, extra: list[str], method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def read_status(reader: asyncio.StreamReader, timeout_s: float) -> int | None:
    """The status code of the next answer, or None when the connection closed first (or ``timeout_s`` passed)."""
    try:
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    except (TimeoutError, ConnectionError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[0].startswith(b"HTTP/") else None


@dataclass
class SlowStats:
    opened: int = 0
    answers: Counter[object] = field(default_factory=Counter)  # what a connection got when it ended: status or None
    bytes_sent: int = 0


async def slowloris(port: int, *, connections: int, stop: asyncio.Event, length: int = 100_000) -> SlowStats:
    """``connections`` connections, each a complete classify head with ``Content-Length: length`` then one body
    byte a second; one the server ends is opened again (as an attacker would), until ``stop`` is set."""
    stats = SlowStats()
    data = head(CLASSIFY, port, ["Content-Type: image/png", f"Content-Length: {length}"])

    async def one(i: int) -> None:
        await asyncio.sleep(i * 0.01)  # spread the connects
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            stats.opened += 1
            answer = asyncio.ensure_future(read_status(reader, 3600))
            try:
                writer.write(data)
                sent = 0
                while not stop.is_set() and sent < length and not answer.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(answer), 1.0)
                    if answer.done() or stop.is_set():
                        break
                    writer.write(b"\x89")
                    await writer.drain()
                    sent += 1
                    stats.bytes_sent += 1
                if answer.done():
                    stats.answers[answer.result()] += 1
            except (ConnectionError, OSError):
                stats.answers["reset"] += 1
            finally:
                answer.cancel()
                writer.close()

    await asyncio.gather(*(one(i) for i in range(connections)))
    return stats


@dataclass
class UnreadStats:
    connections: int = 0
    bytes_sent: int = 0
    requests_sent: int = 0


async def never_read(port: int, *, connections: int, pipelined: int, stop: asyncio.Event) -> UnreadStats:
    """``connections`` connections (a 4 KiB receive buffer each) that each write, in one go, four requests for the
    OpenAPI schema (large answers, which fill the socket buffers) and then ``pipelined`` small requests, and never
    read an answer; held open until ``stop`` is set."""
    stats = UnreadStats()
    schema = head("/schema/openapi.json", port, [], method="GET")
    live = head("/v2/health/live", port, [], method="GET")
    data = schema * 4 + live * pipelined
    writers: list[asyncio.StreamWriter] = []

    async def one() -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
        _, writer = await asyncio.open_connection(sock=sock)
        writers.append(writer)
        stats.connections += 1
        writer.write(data)
        # A server that stops reading leaves the drain waiting, which is the point: bounded by ``stop``.
        drain = asyncio.ensure_future(writer.drain())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({drain, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if drain.done() and drain.exception() is None:
            stats.bytes_sent += len(data)
            stats.requests_sent += 4 + pipelined
        drain.cancel()

    try:
        await asyncio.gather(*(one() for _ in range(connections)))
        await stop.wait()
    finally:
        for writer in writers:
            writer.transport.abort()
    return stats


def rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def frontends(pid: int) -> list[int]:
    """The supervisor's front-end processes (``python -m service.frontend.server``)."""
    return roles(pid)["frontend"]
