"""The front end's end of the transport: one DEALER socket per engine, futures keyed by request number.

Whether the engine is up is known at once, not by timing out requests: zmq's socket monitor reports the
connection closing the moment the engine process dies (its end of the ipc socket goes with it), and every request
waiting on it is answered 503 there and then; the engine also beats every ``BEAT_S``, and silence for
``SILENCE_S`` counts as down (a stopped or wedged process). When the engine comes back (warm-up done, it binds
only then), the connection reopens by itself, the front end says Hello, fetches the catalog and is ready again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from service.core.errors import DeadlineExceededError, OverloadedError, VisionServeError
from service.transport.messages import (
    ENCODER,
    TO_FRONTEND,
    Answer,
    Beat,
    Cancel,
    Catalog,
    CatalogQuery,
    ControlQuery,
    Failed,
    Flush,
    Hello,
    HoldQuery,
    IndexQuery,
    LoadQuery,
    MetricsQuery,
    Query,
    Reply,
    Result,
    RolloutQuery,
    Snapshot,
    StatsQuery,
    Submit,
    UnloadQuery,
    Welcome,
    WireError,
    query_name,
)
from service.transport.shm import Arena

log = logging.getLogger(__name__)
# Plain ints: pyzmq's enum members cost microseconds per operation on the hot path.
ZMQ_EVENTS, ZMQ_POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)

BEAT_S = 0.5  # the engine's heartbeat period
SILENCE_S = 3.0  # no word from the engine for this long: treat it as down
UNAVAILABLE = "the inference engine is not available (restarting or not started yet); try again shortly"


class ControlCalls(Protocol):
    """An engine link's control calls, one typed method each (as vLLM's engine client has), every one a
    :data:`~service.transport.messages.ControlQuery` sent through the link's own :meth:`call`. Both sides of the
    link (shared memory here, in process in ``service.inprocess``) inherit them, and the front end's
    ``EngineLink`` protocol extends this one."""

    async def call(self, query: ControlQuery, timeout_s: float = 30.0) -> Any:
        raise NotImplementedError

    async def fetch_catalog(self, timeout_s: float = 30.0) -> Catalog:
        """What the engine serves now."""
        return msgspec.convert(await self.call(CatalogQuery(), timeout_s), Catalog)

    async def metrics(self) -> bytes:
        """The whole server's metrics, Prometheus text."""
        return bytes(await self.call(MetricsQuery()))

    async def stats(self) -> list[dict[str, Any]]:
        """A row per model version: the front ends' counts and the engine's batches."""
        return list(await self.call(StatsQuery()))

    async def index(self) -> list[dict[str, Any]]:
        """The repository index: every model with its state, the ones not loaded too."""
        return list(await self.call(IndexQuery()))

    async def load(self, name: str, config: Any = None) -> dict[str, Any]:
        """Load (or reload) ``name``, with ``config`` in place of its config.toml where given."""
        return dict(await self.call(LoadQuery(name, config)))

    async def unload(self, name: str) -> dict[str, Any]:
        """Take ``name`` out of service."""
        return dict(await self.call(UnloadQuery(name)))

    async def rollout(
        self, name: str, *, action: str | None = None, settings: Any = None, reason: str = ""
    ) -> dict[str, Any] | None:
        """``name``'s rollout document (None where this engine does not serve it), after ``action`` if given."""
        document = await self.call(RolloutQuery(name, action, settings, reason))
        return None if document is None else dict(document)

    async def hold(self, name: str, holder: str, hold: bool = True) -> int:
        """Keep ``name`` resident while ``holder`` runs (a source), or let it go: how many hold it now."""
        return int(await self.call(HoldQuery(name, holder, hold)))


class _Waiting(msgspec.Struct):
    future: asyncio.Future[Result | Failed]
    offset: int  # the arena region the engine may still read; freed only when it answers
    answered: float = 0.0  # time.perf_counter() when the answer was read off the socket


@dataclass(eq=False)
class EngineClient(ControlCalls):
    """Talks to one engine process. All methods run on the front end's event loop."""

    endpoint: str
    arena: Arena
    frontend: str
    _: KW_ONLY
    snapshot: Callable[[int], Snapshot]  # this front end's Snapshot, for a Flush
    on_change: Callable[[], None]  # told when the catalog, readiness or the count of front ends changes
    catalog: Catalog | None = field(default=None, init=False)
    up: bool = field(default=False, init=False)
    frontends: int = field(default=0, init=False)  # how many front ends have reached this engine (ready once all)
    engine_pid: int = field(default=0, init=False)
    _ids: Iterator[int] = field(default_factory=lambda: itertools.count(1), init=False, repr=False)
    _waiting: dict[int, _Waiting] = field(default_factory=dict, init=False, repr=False)
    _queries: dict[int, asyncio.Future[Reply]] = field(default_factory=dict, init=False, repr=False)
    _last_heard: float = field(default=0.0, init=False, repr=False)
    _catalog_version: int = field(default=-1, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

    # ---- lifecycle ----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue for an engine that is not connected: refuse instead
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 100)  # an engine still loading: found within 0.1 s once it binds
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        self._sock = sock
        loop = asyncio.get_running_loop()
        self._loop = loop
        # Raw sockets on the event loop's reader, drained until empty per wake-up: no future per message. zmq's fd
        # is edge-triggered, so every send is followed by a check for what may have arrived meanwhile.
        loop.add_reader(sock.fileno(), self._drain)
        loop.add_reader(self._monitor.fileno(), self._drain_monitor)
        self._watchdog_task = loop.create_task(self._watchdog(), name="engine-watchdog")
        loop.call_soon(self._drain)
        loop.call_soon(self._drain_monitor)

    async def close(self) -> None:
        self._closed = True
        self._loop.remove_reader(self._sock.fileno())
        self._loop.remove_reader(self._monitor.fileno())
        self._watchdog_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._watchdog_task
        self._mark_down("the front end is shutting down")
        with contextlib.suppress(Exception):
            self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)
        self._ctx.term()

    # ---- requests -----------------------------------------------------------------------------------------------
    async def submit(
        self,
        model: str,
        version: int,
        images: np.ndarray | list[np.ndarray],
        *,
        timeout_ms: float | None,
        priority: int,
        request_id: str,
        guard_s: float,
        route: str | None = None,
    ) -> Answer:
        """Compute a uint8 batch [N, C, H, W] (or a list of [C, H, W] images, stacked straight into the arena).
        Raises the engine's error, 503 when it is down, 504 when it has said nothing within ``guard_s`` (a wedged
        engine). The arena region is freed once the engine has answered (it may read it until then), or, after an
        error answered while a batch still read it (``Failed.held``), once the engine says so."""
        if not self.up:
            raise OverloadedError(UNAVAILABLE)
        n, c, h, w = (len(images), *images[0].shape) if isinstance(images, list) else images.shape
        shape = (int(n), int(c), int(h), int(w))
        offset, view = self.arena.allocate(shape)
        try:
            if isinstance(images, np.ndarray):
                np.copyto(view, images, casting="no")
            else:
                np.stack(images, out=view)
        except BaseException:
            self.arena.free(offset)
            raise
        del view
        sent = time.perf_counter()
        number = next(self._ids)
        message = Submit(number, model, version, offset, shape, timeout_ms or 0.0, priority, request_id, route)
        future: asyncio.Future[Result | Failed] = self._loop.create_future()
        if not self._send(ENCODER.encode(message)):
            self.arena.free(offset)
            raise OverloadedError(UNAVAILABLE)
        waiting = self._waiting[number] = _Waiting(future, offset)
        guard = self._loop.call_later(guard_s, _expire, future, guard_s)
        try:
            answer = await future
        except asyncio.CancelledError:
            if number in self._waiting:  # the client went away: the engine drops what is still queued
                self._send(ENCODER.encode(Cancel(number)))
            raise
        finally:
            guard.cancel()
        if isinstance(answer, Failed):
            raise answer.error.exception()
        return Answer(answer, sent, waiting.answered)

    async def call(self, query: ControlQuery, timeout_s: float = 30.0) -> Any:
        """Send one control call; its value as MessagePack carries it. Raises the engine's error, or 503."""
        if self._closed or (not self.up and not isinstance(query, CatalogQuery)):
            raise OverloadedError(UNAVAILABLE)
        number = next(self._ids)
        future: asyncio.Future[Reply] = self._loop.create_future()
        self._queries[number] = future
        try:
            if not self._send(ENCODER.encode(Query(number, query))):
                raise OverloadedError(UNAVAILABLE)
            reply = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise OverloadedError(f"the engine did not answer {query_name(query)!r} within {timeout_s:g} s") from None
        finally:
            self._queries.pop(number, None)
        if reply.error is not None:
            raise reply.error.exception()
        return reply.value

    @property
    def inflight(self) -> int:
        return len(self._waiting)

    # ---- the reader ---------------------------------------------------------------------------------------------
    def _send(self, data: bytes) -> bool:
        """Send without waiting; False when no engine is connected (the caller refuses at once)."""
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        if self._sock.getsockopt(ZMQ_EVENTS) & ZMQ_POLLIN:  # type: ignore[operator]
            self._loop.call_soon(self._drain)
        return True

    def _drain(self) -> None:
        sock = self._sock
        if self._closed:
            return
        # Asking zmq whether a message waits is cheaper than the exception a recv on an empty socket raises.
        while sock.getsockopt(ZMQ_EVENTS) & ZMQ_POLLIN:  # type: ignore[operator]
            data = sock.recv(zmq.NOBLOCK)
            try:
                self._handle(TO_FRONTEND.decode(data))
            except Exception:  # one bad message must not stop the reader
                log.exception("handling a message from the engine failed")

    def _handle(self, message: Any) -> None:
        self._last_heard = time.monotonic()
        if isinstance(message, Result | Failed):
            waiting = self._waiting.get(message.id)
            if waiting is None:
                return
            if not waiting.future.done():
                waiting.answered = time.perf_counter()
                waiting.future.set_result(message)
            if not (isinstance(message, Failed) and message.held):  # else the engine still reads it: kept till told
                del self._waiting[message.id]
                self.arena.free(waiting.offset)
        elif isinstance(message, Reply):
            query = self._queries.get(message.id)
            if query is not None and not query.done():
                query.set_result(message)
        elif isinstance(message, Flush):
            self._send(ENCODER.encode(self.snapshot(message.token)))
        elif isinstance(message, Beat):
            if message.frontends != self.frontends:
                self.frontends = message.frontends
                self.on_change()
            if message.catalog_version != self._catalog_version and self.catalog is not None:
                self._catalog_version = message.catalog_version
                self._loop.create_task(self.refresh())
            elif not self.up and self.catalog is not None:
                self.up = True  # silence ended (a stopped engine resumed)
                self.on_change()
        elif isinstance(message, Welcome):
            self.engine_pid = message.pid
            self._loop.create_task(self.refresh(welcome=True))

    async def refresh(self, *, welcome: bool = False) -> None:
        """Read the engine's catalog now (also done by itself whenever the engine says it changed)."""
        try:
            catalog = await self.fetch_catalog(timeout_s=10.0)
        except VisionServeError as exc:
            log.warning("could not read the engine's catalog: %s", exc)
            return
        self.catalog = catalog
        self._catalog_version = catalog.version
        if welcome or not self.up:
            self.up = True
            log.info("engine %s at %s is up: %d model versions", self.engine_pid, self.endpoint, len(catalog.models))
        self.on_change()

    def _drain_monitor(self) -> None:
        while not self._closed:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._last_heard = time.monotonic()
                self._send(ENCODER.encode(Hello(self.frontend, self.arena.name, self.arena.size, os.getpid())))
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._mark_down("the engine process went away")

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(BEAT_S)
            if self.up and time.monotonic() - self._last_heard > SILENCE_S:
                self._mark_down(f"the engine has been silent for more than {SILENCE_S:g} s")

    def _mark_down(self, why: str) -> None:
        was_up = self.up
        self.up = False
        waiting, self._waiting = self._waiting, {}
        for item in waiting.values():
            self.arena.free(item.offset)
            if not item.future.done():
                item.future.set_result(Failed(0, _unavailable(why)))
        for query in self._queries.values():
            if not query.done():
                query.set_result(Reply(0, error=_unavailable(why)))
        if was_up and not self._closed:
            log.error("engine at %s is down: %s; %d requests answered 503", self.endpoint, why, len(waiting))
            self.on_change()


def _expire(future: asyncio.Future[Result | Failed], guard_s: float) -> None:
    """A wedged engine: the caller gets a 504; the region stays reserved until the engine answers or goes."""
    if not future.done():
        future.set_exception(DeadlineExceededError(f"the engine did not answer within {guard_s:g} s"))


def _unavailable(why: str) -> WireError:
    return WireError("OverloadedError", f"{UNAVAILABLE}: {why}", 503)
