"""A timed HTTP server: the instrument that checks the load tester's own accuracy.

It answers every POST after a known delay, and can stall: requests arriving inside ``[stall_start_s,
stall_end_s)`` (seconds from the first request it sees) wait until the stall ends. Its answers are therefore known
in advance for any schedule, which is what the tests compare the load tester's numbers against. It runs on
127.0.0.1 and a free port, one thread per connection (HTTP/1.1 keep-alive, as the load tester's client uses).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest


@dataclass
class Timing:
    delay_s: float = 0.02
    stall_start_s: float = -1.0
    stall_end_s: float = -1.0
    origin: float | None = None  # perf_counter of the first request


class TimedServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # a stall piles up connections; the default backlog of 5 would add its own delays

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self.arrivals: list[float] = []
        self.gets: list[str] = []  # paths of GET requests (the step's reads of /metrics)
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes; Nagle would hold the second for 40 ms
    server: TimedServer

    def do_POST(self) -> None:
        now = time.perf_counter()
        self.rfile.read(int(self.headers.get("content-length", 0)))
        t = self.server.timing
        with self.server.lock:
            if t.origin is None:
                t.origin = now
            self.server.arrivals.append(now - t.origin)
        since = now - t.origin
        if t.stall_start_s <= since < t.stall_end_s:
            time.sleep(t.origin + t.stall_end_s - time.perf_counter())
        time.sleep(t.delay_s)
        body = b'{"results": []}'
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # no /metrics here: the report must cope without the server's split
        with self.server.lock:
            self.server.gets.append(self.path)
        self.send_response(404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def timed_server() -> Iterator[TimedServer]:
    server = TimedServer(Timing())
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
