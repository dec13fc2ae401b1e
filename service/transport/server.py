"""The engine's end of the transport: one ROUTER socket that every front end's DEALER connects to.

It attaches each front end's arena on Hello, turns a Submit into a read-only view of the pixels and hands it to
the engine's handler, and sends the handler's answers back. It beats every ``BEAT_S`` so front ends can tell a
silent engine from an idle one, and gathers Snapshots from every front end when a scrape asks (``flush``).
The engine binds only once its models are loaded and warmed up: a front end that can connect can be served.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import Awaitable
from typing import Any, Protocol

import msgspec
import numpy as np
import zmq

from service.core.errors import BadInputError
from service.transport.client import BEAT_S, ZMQ_EVENTS, ZMQ_POLLIN
from service.transport.messages import (
    ENCODER,
    TO_ENGINE,
    Beat,
    Cancel,
    ControlQuery,
    Failed,
    Flush,
    Hello,
    Query,
    Reply,
    Snapshot,
    Submit,
    Welcome,
    WireError,
    query_name,
)
from service.transport.shm import ArenaReader

log = logging.getLogger(__name__)


class Handler(Protocol):
    """What the engine does with what arrives."""

    def submit(self, peer: bytes, message: Submit, images: np.ndarray) -> None: ...
    def cancel(self, peer: bytes, request: int) -> None: ...
    def query(self, peer: bytes, call: ControlQuery) -> Awaitable[Any]: ...
    def catalog_version(self) -> int: ...


class EngineEndpoint:
    """Receives on the engine's event loop; ``send`` may be called from it only."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.endpoint = endpoint
        self.name = name
        self._arenas: dict[bytes, ArenaReader] = {}  # peer -> its arena
        self._by_frontend: dict[str, bytes] = {}  # "fe0" -> the live peer of that front end
        self._retired: list[ArenaReader] = []
        self._tokens = itertools.count(1)
        self._flushes: dict[int, tuple[set[bytes], asyncio.Future[None]]] = {}
        self.snapshots: dict[bytes, Snapshot] = {}  # the latest from each front end, live or gone
        self._draining = False

    async def start(self, handler: Handler) -> None:
        self._handler = handler
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(self.endpoint)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._loop = loop
        # The raw socket on the loop's reader, drained until empty per wake-up (zmq's fd is edge-triggered: after
        # every send, look again for what arrived meanwhile). Many Submits are read per wake-up under load.
        loop.add_reader(sock.fileno(), self._drain)
        loop.call_soon(self._drain)
        self._beat_task = loop.create_task(self._beat(), name="beat")
        log.info("engine %s listening on %s", self.name, self.endpoint)

    async def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        self._beat_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._beat_task
        self._sock.close(0)
        self._ctx.term()
        for arena in [*self._arenas.values(), *self._retired]:
            arena.close()

    def send(self, peer: bytes, message: Any) -> None:
        sock = self._sock
        try:
            sock.send(peer, zmq.SNDMORE | zmq.NOBLOCK)
            sock.send(ENCODER.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the front end went away; its answer has nowhere to go
            log.debug("answer to a gone front end dropped: %s", exc)
        if not self._draining and sock.getsockopt(ZMQ_EVENTS) & ZMQ_POLLIN:  # type: ignore[operator]
            self._draining = True
            self._loop.call_soon(self._drain)

    async def flush(self, timeout_s: float = 0.5) -> None:
        """Ask every connected front end for its Snapshot and wait for them (up to ``timeout_s``)."""
        peers = set(self._arenas)
        if not peers:
            return
        token = next(self._tokens)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._flushes[token] = (peers, done)
        for peer in peers:
            self.send(peer, Flush(token))
        try:
            await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            log.warning("metrics snapshot: %d front ends did not answer in %.2f s", len(peers), timeout_s)
        finally:
            self._flushes.pop(token, None)

    # ---- receiving --------------------------------------------------------------------------------------------
    def _drain(self) -> None:
        self._draining = False
        sock = self._sock
        # Asking zmq whether a message waits is cheaper than the exception a recv on an empty socket raises.
        while sock.getsockopt(ZMQ_EVENTS) & ZMQ_POLLIN:  # type: ignore[operator]
            peer, data = sock.recv_multipart(zmq.NOBLOCK)
            try:
                message = TO_ENGINE.decode(data)
            except msgspec.DecodeError:
                log.exception("undecodable message from a front end")
                continue
            try:
                self._dispatch(peer, message)
            except Exception:  # one bad message must not stop the engine
                log.exception("handling %s failed", type(message).__name__)

    def _dispatch(self, peer: bytes, message: Any) -> None:
        if isinstance(message, Submit):
            arena = self._arenas.get(peer)
            if arena is None:
                self.send(peer, Failed(message.id, WireError.of(BadInputError("Submit before Hello"))))
                return
            try:
                images = arena.view(message.offset, message.shape)
            except ValueError as exc:
                self.send(peer, Failed(message.id, WireError.of(BadInputError(str(exc)))))
                return
            self._handler.submit(peer, message, images)
        elif isinstance(message, Cancel):
            self._handler.cancel(peer, message.id)
        elif isinstance(message, Query):
            asyncio.get_running_loop().create_task(self._answer(peer, message))
        elif isinstance(message, Snapshot):
            self.snapshots[peer] = message
            entry = self._flushes.get(message.token)
            if entry is not None:
                waiting, done = entry
                waiting.discard(peer)
                if not waiting and not done.done():
                    done.set_result(None)
        elif isinstance(message, Hello):
            self._hello(peer, message)

    def _hello(self, peer: bytes, hello: Hello) -> None:
        old_peer = self._by_frontend.get(hello.frontend)
        if old_peer is not None and old_peer != peer and old_peer in self._arenas:  # restarted: retire its old arena
            self._retired.append(self._arenas.pop(old_peer))
        self._retired = [a for a in self._retired if not a.close()]  # unmapped once no view of it is left
        current = self._arenas.get(peer)
        if current is None or current.name != hello.arena:
            self._arenas[peer] = ArenaReader(hello.arena)
        self._by_frontend[hello.frontend] = peer
        log.info("front end %s (pid %d) connected with arena %s", hello.frontend, hello.pid, hello.arena)
        self.send(peer, Welcome(self.name, os.getpid(), self._handler.catalog_version()))
        self.announce()  # every front end learns at once how many have reached this engine (their readiness)

    def live_peer(self, peer: bytes) -> bool:
        """``peer`` is the current connection of its front end (not one a restarted front end left behind)."""
        return peer in self._by_frontend.values()

    @property
    def frontends(self) -> int:
        """Front ends (by name) that have reached this engine; a restarted one counts once."""
        return len(self._by_frontend)

    async def _answer(self, peer: bytes, query: Query) -> None:
        try:
            value = await self._handler.query(peer, query.call)
        except Exception as exc:
            if not isinstance(exc, BadInputError):
                log.exception("query %s failed", query_name(query.call))
            self.send(peer, Reply(query.id, error=WireError.of(exc)))
            return
        self.send(peer, Reply(query.id, value=value))

    def announce(self) -> None:
        """Beat now, out of turn: the catalog changed (a model's state), and readiness should not wait for the
        next beat to say so. Call on the engine's event loop."""
        if getattr(self, "_handler", None) is None:
            return
        beat = Beat(self._handler.catalog_version(), self.frontends)
        for peer in list(self._arenas):
            self.send(peer, beat)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            self.announce()
