"""The load generator's HTTP/1.1 client against answers a real server may give: chunked bodies, Connection: close,
a reset mid-answer, and a timeout."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.http1 import ConnectionFailed, Http1Client

ANSWERS = {
    b"/chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    b"/close": b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 2\r\n\r\nno",
    b"/length": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
    b"/reset": b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort",
    b"/then-drop": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
    b"/then-idle-close": b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc",
}


async def serve(connections: list[int]) -> asyncio.Server:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        drop_next = False
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            path = head.split(b" ")[1]
            if drop_next:  # the keep-alive race: the server closes as the next request arrives, answering nothing
                break
            drop_next = path == b"/then-drop"
            if path == b"/then-idle-close":  # a keep-alive timeout: close once idle, before any next request
                writer.write(ANSWERS[path])
                await writer.drain()
                break
            if path == b"/slow":
                await asyncio.sleep(5)
            writer.write(ANSWERS[path])
            await writer.drain()
            if path in (b"/close", b"/reset"):
                break
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_answers_of_every_shape_are_read_and_connections_reused_when_allowed() -> None:
    async def main() -> None:
        connections: list[int] = []
        server = await serve(connections)
        port = server.sockets[0].getsockname()[1]
        client = Http1Client(f"http://127.0.0.1:{port}", timeout_s=1.0)
        assert await client.post("/length", b"x", {}) == 200
        assert await client.post("/chunked", b"xy", {"content-type": "image/jpeg"}) == 200
        assert await client.post("/length", b"", {}) == 200
        assert len(connections) == 1  # keep-alive: one connection for all three
        assert await client.post("/close", b"x", {}) == 503
        assert client.idle == []  # the server said close: not reused
        with pytest.raises(ConnectionFailed):
            await client.post("/reset", b"x", {})
        with pytest.raises(TimeoutError):
            await client.post("/slow", b"x", {})
        assert await client.post("/length", b"x", {}) == 200  # a fresh connection after the failures
        await client.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_connections_the_server_closed_are_not_charged_to_the_request() -> None:
    async def main() -> None:
        connections: list[int] = []
        server = await serve(connections)
        port = server.sockets[0].getsockname()[1]
        client = Http1Client(f"http://127.0.0.1:{port}", timeout_s=1.0)
        assert await client.post("/then-idle-close", b"x", {}) == 200
        await asyncio.sleep(0.05)  # the server's close reaches the idle connection
        assert await client.post("/length", b"x", {}) == 200  # seen closed: a new connection, not an error
        assert await client.post("/then-drop", b"x", {}) == 200
        assert await client.post("/length", b"x", {}) == 200  # closed under the request: sent again, once
        assert len(connections) == 3
        with pytest.raises(ConnectionFailed):  # a reset in the middle of an answer is still an error
            await client.post("/reset", b"x", {})
        await client.aclose()
        server.close()
        await server.wait_closed()

    asyncio.run(main())


def test_a_refused_connection_is_a_connection_failure() -> None:
    async def main() -> None:
        with pytest.raises(ConnectionFailed):
            await Http1Client("http://127.0.0.1:9", timeout_s=1.0).post("/", b"", {})

    asyncio.run(main())


def test_only_http_addresses_are_accepted() -> None:
    with pytest.raises(ValueError, match="http"):
        Http1Client("ftp://example", 1.0)
