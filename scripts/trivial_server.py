"""A trivial HTTP endpoint for measuring the load generator itself: every POST gets a fixed 200 at once.

Raw asyncio streams (uvloop where installed), keep-alive, no framework: it costs as little per request as a Python
server can, so what ``visionserve loadtest`` reaches against it is the generator's own ceiling on this machine.

    .venv/bin/python scripts/trivial_server.py --port 8390 &
    .venv/bin/visionserve loadtest --url http://127.0.0.1:8390 --model any --concurrency 16,64 --processes 1
"""

from __future__ import annotations

import argparse
import asyncio

ANSWER = b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 15\r\n\r\n{"results": []}'


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            writer.write(ANSWER)
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def serve(host: str, port: int) -> None:
    server = await asyncio.start_server(handle, host, port, backlog=1024)
    async with server:
        await server.serve_forever()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8390, help="port (default 8390)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        import uvloop

        uvloop.run(serve(args.host, args.port))
    except ImportError:
        asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
