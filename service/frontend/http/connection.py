"""Limits on one HTTP/1.1 connection that uvicorn's httptools protocol does not keep: the size of a request's head
and how long its head and body may take to arrive.

Without them (uvicorn 0.54, httptools 0.9) a head of any size is taken (10,000 header lines, 198 KB, were answered
200) and a header that never ends is buffered as it comes; and a client that opens a connection and then trickles a
head or a body one byte a second holds its socket, its parser and, for a body, an application task forever (all
still open after 11 s with 2 s limits asked for): only the idle time *between* requests is timed
(``timeout_keep_alive``). The limits, after the usual servers' (nginx ``client_header_timeout`` and
``client_body_timeout``, Kestrel's minimum body rate):

- the head (request line and headers) is refused with 431 once past ``max_header_bytes``, counted on the wire
  before it is parsed in full, so a front end holds at most the limit plus one socket read of it;
- the head must be complete ``header_timeout_s`` after the connection opened or the request began, else 408
  (a connection that never sent a byte is closed without an answer);
- a body that receives nothing for ``body_timeout_s``, or that after ``body_timeout_s`` has averaged less than
  ``min_body_bytes_per_s``, is answered 408 and the connection closed.

And one that uvicorn's protocol keeps too loosely: it parses every request in a socket read before it pauses
reading for pipelining, so a client that pipelines thousands of tiny requests and never reads the answers has the
front end hold a queued request for each (100 such connections, 1,000 requests each: the front ends grew by
300 MiB and an ordinary client's p99 by 3.2x); here at most ``MAX_PIPELINED`` wait per connection, and a client
that sends more gets the answers to those and then the connection closed (RFC 9112 section 9.3.2: a client retries
unanswered pipelined requests on a new connection).

The h11 protocol (used when httptools is not installed) gets only the size limit, through uvicorn's own
``h11_max_incomplete_event_size``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

MAX_PIPELINED = 32


class ConnectionLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one connection may cost: see the module's docstring."""

    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    min_body_bytes_per_s: int


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the protocol answers with its ``_refusal``."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ConnectionLimits`. Use :func:`limited_protocol` to make one."""

    limits: ConnectionLimits  # set on the subclass that limited_protocol makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False  # a request has begun and its head is not complete
        self._head_wire_bytes = 0  # bytes of the head as they came off the socket
        self._head_parsed_bytes = 0  # bytes of the head as the parser handed them over (URL, complete headers)
        self._began_in_read = False
        self._completed_in_read = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_pending = False  # the head is complete, the body is not
        self._body_started_at = 0.0
        self._body_progress_at = 0.0
        self._body_bytes = 0
        self._body_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None
        self._pipeline_full = False  # past MAX_PIPELINED: the queued requests are answered, the rest dropped

    # Connection events

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received, with the head counted and the refusals answered with their own status.
        self._unset_keepalive_if_required()
        if self._pipeline_full:
            return
        self._began_in_read = self._completed_in_read = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._pipeline_full:
                # The parser stopped at a request past the queue; the last queued one closes the connection.
                self.cycle.keep_alive = False
                self.flow.pause_reading()
                self._cancel_timers()
            elif self._refusal is not None:
                self._refuse(*self._refusal)
            else:
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            return
        if self._in_head:
            # The whole read is head when the request began before it, or at its start (no earlier request ended
            # in it); a pipelined read holding the end of one request and the start of the next is not counted
            # here, which leaves the parser at most one read of head beyond the limit.
            if not (self._began_in_read and self._completed_in_read):
                self._head_wire_bytes += len(data)
            if self._head_wire_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request head over {self.limits.max_header_bytes} bytes")
                return
        if self._body_pending and self._body_timer is None and not self.transport.is_closing():
            self._body_timer = self.loop.call_later(self._body_tick_s(), self._check_body)
        elif self._head_timer is None and self._idle() and not self.transport.is_closing():
            # Data that began no request (blank lines between keep-alive requests, which the parser skips) has
            # stopped uvicorn's keep-alive timer: the head clock runs instead, or CRLFs would hold it for ever.
            self._arm_head_timer()

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._began_in_read = True
        self._head_wire_bytes = self._head_parsed_bytes = 0
        if self._head_timer is None:
            self._arm_head_timer()

    def on_url(self, url: bytes) -> None:
        self._count_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_parsed(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if len(self.pipeline) >= MAX_PIPELINED:
            self._pipeline_full = True
            raise _Refused
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()
        now = time.monotonic()
        self._body_pending = True  # until on_message_complete, which follows at once for a request with no body
        self._body_started_at = self._body_progress_at = now
        self._body_bytes = 0

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        self._body_progress_at = time.monotonic()
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._completed_in_read = True
        self._body_pending = False
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # The limits

    def _count_parsed(self, size: int) -> None:
        self._head_parsed_bytes += size
        if self._head_parsed_bytes > self.limits.max_header_bytes:
            self._refusal = (431, f"request head over {self.limits.max_header_bytes} bytes")
            raise _Refused

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._in_head:
            self._refuse(408, f"request head not received within {self.limits.header_timeout_s:g} s")
        elif self._idle():  # connected (or answered) and never sent a request since
            self.transport.close()

    def _idle(self) -> bool:
        """No request in progress: none begun, none being answered, none waiting in the pipeline."""
        cycle = self.cycle
        return (
            not self._in_head
            and not self._body_pending
            and not self.pipeline
            and (cycle is None or cycle.response_complete)
        )

    def _body_tick_s(self) -> float:
        return min(1.0, self.limits.body_timeout_s / 4)

    def _check_body(self) -> None:
        self._body_timer = None
        if not self._body_pending or self.transport.is_closing():
            return
        now = time.monotonic()
        grace = self.limits.body_timeout_s
        stalled = now - self._body_progress_at >= grace
        elapsed = now - self._body_started_at
        slow = elapsed >= grace and self._body_bytes < self.limits.min_body_bytes_per_s * elapsed
        if stalled or slow:
            why = "stalled" if stalled else f"slower than {self.limits.min_body_bytes_per_s} bytes/s"
            self._refuse(408, f"request body {why} ({self._body_bytes} bytes in {elapsed:.1f} s)")
            return
        self._body_timer = self.loop.call_later(self._body_tick_s(), self._check_body)

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` (unless an answer has begun) and close the connection."""
        self._cancel_timers()
        cycle = self.cycle
        # Answer only where the answer cannot land inside, or after, another one to the same request.
        if self._in_head:  # ``cycle``, if any, is the request before this one
            answer = cycle is None or cycle.response_complete
        else:  # ``cycle`` is the request refused (its body is late)
            answer = cycle is not None and not cycle.response_started
        if answer and not self.pipeline:
            self.logger.warning("%s:%s - %d: %s", *(self.client or ("?", 0)), status, message)
            body = message.encode("ascii", "replace")
            head = b"".join(name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers)
            plain = b"content-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            self.transport.write(STATUS_LINE[status] + head + plain % len(body) + body)
        if cycle is not None and not cycle.response_complete:
            # The application, if it waits for the body, sees a disconnect; what it sends is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None


def limited_protocol(limits: ConnectionLimits) -> type[LimitedHttpToolsProtocol]:
    """A protocol class for uvicorn's ``http=`` option that keeps ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})
