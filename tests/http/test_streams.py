"""Streams over WebSocket against real server processes (docs/streams.md), with a real client (``websockets``).

The model is the shipped digits model slowed by its config (``[faults] delay_ms``), so a frame computes for a known
time whatever the machine: frames sent while one computes wait, and supersede each other, deterministically.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import signal
import socket
import struct
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from service import launcher
from tests.http.conftest import metric_value, stop_server

EXAMPLES = Path(__file__).parents[2] / "examples"
DIGIT = (EXAMPLES / "digit-3.png").read_bytes()


def _server(tmp_path: Path, delay_ms: float, *extra: str) -> launcher.RunningServer:
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "model_repository" / "digits", repo / "digits")
    (repo / "digits" / "config.toml").write_text(f"max_queue_delay_ms = 0\n[faults]\ndelay_ms = {delay_ms}\n")
    return launcher.start(repo, *extra, log=tmp_path / "server.log", ready_timeout_s=120)


@pytest.fixture
def slow(tmp_path: Path) -> Any:
    server = _server(tmp_path, 300)
    try:
        yield server
    finally:
        stop_server(server)


def frame(frame_id: Any, image: bytes = DIGIT) -> bytes:
    header = json.dumps({"id": frame_id, "ts": time.time() * 1000}).encode()
    return struct.pack(">I", len(header)) + header + image


def ws_url(server: launcher.RunningServer, **params: Any) -> str:
    query = "&".join(f"{k}={v}" for k, v in params.items())
    return server.url.replace("http://", "ws://") + "/v1/models/digits/stream" + (f"?{query}" if query else "")


async def until_computing(server: launcher.RunningServer) -> None:
    """Until the model computes a batch (observed on /metrics): the frame sent before is in the engine."""
    deadline = time.monotonic() + 10
    while await asyncio.to_thread(metric_value, server.url, "visionserve_inflight_batches", model="digits") < 1:
        assert time.monotonic() < deadline, "the first frame never reached the engine"


async def answers(ws: Any, n: int) -> list[dict[str, Any]]:
    return [json.loads(await asyncio.wait_for(ws.recv(), 10)) for _ in range(n)]


def test_supersede_and_expiry_are_counted_exactly(slow: launcher.RunningServer) -> None:
    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with websockets.connect(ws_url(slow, max_age_ms=2000, top_k=1)) as ws:
            await ws.send(frame(0))
            await until_computing(slow)  # frame 0 computes for 300 ms: 1..9 arrive meanwhile
            for i in range(1, 10):
                await ws.send(frame(i))
            burst = await answers(ws, 10)
        async with websockets.connect(ws_url(slow, max_age_ms=100)) as ws:
            await ws.send(frame("a"))  # computes for 300 ms: past its 100 ms, answered at its engine deadline
            await until_computing(slow)
            await ws.send(frame("b"))  # queued behind "a"'s batch, which still computes: past its age in the queue
            late = await answers(ws, 2)
        return burst, late

    burst, late = asyncio.run(run())
    by_id = {a["id"]: a for a in burst}
    judged = [(a["id"], a.get("stage"), a["age_ms"]) for a in late]
    print(f"\nburst: {[(a['id'], a['status']) for a in burst]}; late: {judged}")
    assert sorted(by_id) == list(range(10))  # one answer per frame
    assert [i for i in range(10) if by_id[i]["status"] == "result"] == [0, 9]
    assert [i for i in range(10) if by_id[i]["status"] == "superseded"] == list(range(1, 9))
    assert all(by_id[i]["by"] == i + 1 for i in range(1, 9))
    assert by_id[9]["predictions"][0]["label"] == "3" and by_id[9]["age_ms"] > 0
    assert by_id[9]["version"] == 1  # the version that answered
    assert [(a["id"], a["status"], a["stage"]) for a in late] == [("a", "expired", "queue"), ("b", "expired", "queue")]
    assert all(100 <= a["age_ms"] < 300 for a in late)  # answered at the bound, not when the batch ended


def test_a_corrupt_frame_fails_alone(tmp_path: Path) -> None:
    server = _server(tmp_path, 0)
    try:

        async def run() -> list[dict[str, Any]]:
            async with websockets.connect(ws_url(server)) as ws:
                got = []
                for data in (frame(1, DIGIT[:-40]), b"\x00\x00\x00\x09not json!", frame(2), frame(3, b"")):
                    await ws.send(data)
                    got += await answers(ws, 1)
                return got

        got = asyncio.run(run())
    finally:
        stop_server(server)
    print(f"\ncorrupt frames: {[(a['id'], a['status'], a.get('error', '')[:40]) for a in got]}")
    assert [(a["id"], a["status"]) for a in got] == [(1, "error"), (None, "error"), (2, "result"), (3, "error")]
    assert "corrupt" in got[0]["error"] and "not a frame" in got[1]["error"] and "no image" in got[3]["error"]


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _raw_websocket(server: launcher.RunningServer) -> socket.socket:
    """A WebSocket client that will never read again once connected: a plain socket with a small receive buffer
    (client libraries read in the background, so none of them stops reading for real)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = server.url.removeprefix("http://").split(":")
    sock.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /v1/models/digits/stream HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)  # byte by byte: nothing past the handshake is read
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _masked(payload: bytes) -> bytes:
    """One binary WebSocket frame as a client sends it (masked)."""
    mask = os.urandom(4)
    n = len(payload)
    size = bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack(">H", n)
    return b"\x82" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def test_a_client_that_stops_reading_is_cut_off(tmp_path: Path) -> None:
    server = _server(tmp_path, 0, "--stream-send-timeout-s", "1")
    try:
        frontends = server.roles()["frontend"]
        rss_before = sum(_rss_kb(p) for p in frontends)
        sock = _raw_websocket(server)
        sock.settimeout(5)
        sent = 0
        data = _masked(frame(0))
        try:
            for _ in range(200_000):  # bounded; each frame is answered (superseded) and never read
                sock.sendall(data)
                sent += 1
        except OSError:  # the server stopped reading (cut off), then closed: the send times out or fails
            pass
        rss_after = sum(_rss_kb(p) for p in frontends)
        sock.close()
        status = httpx.post(server.url + "/v1/models/digits/classify", content=DIGIT,
                            headers={"Content-Type": "image/png"}).status_code  # fmt: skip
    finally:
        stop_server(server)
    log = (tmp_path / "server.log").read_text()
    print(f"\nnot reading: the server stopped taking frames after {sent}; front-end RSS "
          f"{rss_before / 1024:.0f} -> {rss_after / 1024:.0f} MB")  # fmt: skip
    assert sent < 200_000
    assert "cut off" in log  # its answers backed up: the outbox filled, or one waited past the send timeout
    assert rss_after - rss_before < 64 * 1024  # nothing held per frame: bounded by the outbox and the socket
    assert status == 200  # everyone else is served


def test_a_stream_across_a_drain_ends_cleanly_with_every_frame_accounted_for(tmp_path: Path) -> None:
    server = _server(tmp_path, 100)

    async def run() -> tuple[int, list[dict[str, Any]], int | None, str]:
        got: list[dict[str, Any]] = []
        sent = 0
        async with websockets.connect(ws_url(server, max_age_ms=5000)) as ws:

            async def read() -> None:
                try:
                    while True:
                        got.append(json.loads(await ws.recv()))
                except websockets.ConnectionClosed:
                    pass

            reader = asyncio.ensure_future(read())
            while sent < 400 and not reader.done():  # 50 frames/s; the drain begins once frame 9 has been read
                if sent == 10:
                    # Frame 9's answer (nothing sent after it supersedes it, so it comes) proves the server read it, a
                    # state that lasts; a signal 20 ms after sending raced the server's read on a busy core.
                    async with asyncio.timeout(30):
                        while not any(a["id"] == 9 for a in got):
                            await asyncio.sleep(0.01)
                    server.process.send_signal(signal.SIGTERM)
                try:
                    await ws.send(frame(sent))
                except websockets.ConnectionClosed:
                    break
                sent += 1
                await asyncio.sleep(0.02)
            await asyncio.wait_for(reader, 30)
            return sent, got, ws.close_code, ws.close_reason

    try:
        sent, got, code, reason = asyncio.run(run())
        exit_code = server.process.wait(60)
    finally:
        stop_server(server)
    read = int(reason.split(" frames read")[0])
    statuses = [a["status"] for a in got]
    print(f"\nacross a drain: {sent} sent, {read} read, answers {dict((s, statuses.count(s)) for s in set(statuses))}; "
          f"close {code} ({reason}); exit {exit_code}")  # fmt: skip
    assert code == 1001 and exit_code == 0
    assert sorted(a["id"] for a in got) == list(range(read))  # every frame read has exactly one answer
    assert 10 <= read <= sent
    assert "result" in statuses and set(statuses) <= {"result", "superseded", "expired"}
