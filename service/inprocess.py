"""The engine link's in-process side: the engine on the front end's own event loop, no process and no shared
memory between them (the front end's links are described in ``service.frontend.link``).

The messages are the transport's own (:class:`Submit`, :class:`Result`, :class:`Failed`, a query's value as
MessagePack would carry it), handed over as objects, so that what the front end sees is what it sees across
processes: the same errors, the same catalog, the same metrics. What is about processes (start, drain, kill, shared
memory) still needs ``visionserve serve``; everything else (the APIs' semantics, errors, parameters, stages,
metrics) runs here in one process, under a debugger if need be:

    app = inprocess.create_app(ServerSettings(repository="model_repository"))
    with litestar.testing.TestClient(app) as client:
        client.post("/v1/models/digits/classify", content=png, headers={"Content-Type": "image/png"})

It imports the engine and implements the link the front end takes, so it stands above both rooms.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import httpx
import msgspec
import numpy as np
import uvicorn
from litestar import Litestar

from service.core.errors import DeadlineExceededError, OverloadedError
from service.core.settings import ServerSettings
from service.engine.server import EngineServer
from service.frontend.http.app import create_app as create_http_app
from service.frontend.link import EngineLink, LinkOwner
from service.frontend.server import uvicorn_options
from service.transport.client import BEAT_S, UNAVAILABLE, ControlCalls
from service.transport.messages import (
    ENCODER,
    Answer,
    Catalog,
    CatalogQuery,
    ControlQuery,
    Failed,
    Result,
    Snapshot,
    Submit,
    WireError,
    query_name,
)

PEER = b"in-process"  # the one front end's name on the engine's side


class InProcessEngine:
    """A :class:`~service.frontend.link.Linker` whose one link runs an :class:`EngineServer` on the front end's
    event loop. ``gpus``: as the engine process takes them (None: every usable GPU, or the CPU)."""

    def __init__(self, settings: ServerSettings, *, gpus: list[str] | None = None) -> None:
        self.settings = settings
        self.gpus = gpus

    def connect(self, owner: LinkOwner) -> list[EngineLink]:
        return [InProcessLink(self.settings, owner, gpus=self.gpus)]

    def close(self) -> None:
        """Nothing is shared between its link and others (the link closes its engine)."""


class InProcessLink(ControlCalls):
    """An :class:`~service.frontend.link.EngineLink` to an engine in this process, and that engine's endpoint."""

    name = "in-process"

    def __init__(self, settings: ServerSettings, owner: LinkOwner, *, gpus: list[str] | None = None) -> None:
        self.owner = owner
        self.engine = EngineServer(settings, self, gpus=gpus, primary=True)
        self.snapshots: dict[bytes, Snapshot] = {}
        self.up = False
        self.catalog: Catalog | None = None
        self.frontends = 0
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[Result | Failed]] = {}
        self._answered: dict[int, float] = {}
        self._catalog_version = -1
        self._tasks: set[asyncio.Task[None]] = set()

    # ---- the link, as the front end sees it --------------------------------------------------------------------
    @property
    def inflight(self) -> int:
        return len(self._waiting)

    async def start(self) -> None:
        """Load and warm up every model (as the engine process does before it binds), then say what it serves."""
        self._loop = asyncio.get_running_loop()
        await self.engine.load_all()
        self.frontends = 1
        await self.refresh()
        self._spawn(self._beat())

    async def _beat(self) -> None:
        """As the engine process beats: a model's state that changed (a fallback, a stuck instance) reaches the
        catalog within a beat even where nothing announced it."""
        while True:
            await asyncio.sleep(BEAT_S)
            self.announce()

    def _spawn(self, work: Any) -> None:
        task = self._loop.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Refuse new work, finish what is queued within the drain timeout, close every model."""
        await self.engine.drain()
        self.up = False
        for task in list(self._tasks):
            task.cancel()
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_result(Failed(0, WireError("OverloadedError", f"{UNAVAILABLE}: shutting down", 503)))

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
        if not self.up:
            raise OverloadedError(UNAVAILABLE)
        # One copy, as into the arena: the engine owns its batch, whatever the caller does with its buffers.
        batch = np.stack(images) if isinstance(images, list) else np.array(images, copy=True)
        n, c, h, w = batch.shape
        sent = time.perf_counter()
        number = next(self._ids)
        future: asyncio.Future[Result | Failed] = self._loop.create_future()
        self._waiting[number] = future
        message = Submit(number, model, version, 0, (n, c, h, w), timeout_ms or 0.0, priority, request_id, route)
        self.engine.submit(PEER, message, batch)
        guard = self._loop.call_later(guard_s, _expire, future, guard_s)
        try:
            answer = await future
        except asyncio.CancelledError:
            if self._waiting.pop(number, None) is not None:  # the client went away: drop what is still queued
                self.engine.cancel(PEER, number)
            raise
        finally:
            guard.cancel()
            self._waiting.pop(number, None)
        answered = self._answered.pop(number, time.perf_counter())
        if isinstance(answer, Failed):
            raise answer.error.exception()
        return Answer(answer, sent, answered)

    async def call(self, query: ControlQuery, timeout_s: float = 30.0) -> Any:
        """A control call, answered as across processes: the value as MessagePack carries it, the error as the
        project's exception."""
        if not self.up and not isinstance(query, CatalogQuery):
            raise OverloadedError(UNAVAILABLE)
        try:
            value = await asyncio.wait_for(self.engine.query(PEER, query), timeout_s)
        except TimeoutError:
            raise OverloadedError(f"the engine did not answer {query_name(query)!r} within {timeout_s:g} s") from None
        except Exception as exc:
            raise WireError.of(exc).exception() from exc
        return msgspec.msgpack.decode(ENCODER.encode(value))

    async def refresh(self) -> None:
        catalog = await self.fetch_catalog()
        self.catalog = catalog
        self._catalog_version = catalog.version
        self.up = True
        self.owner.catalog_changed()

    # ---- the endpoint, as the engine sees it -------------------------------------------------------------------
    def send(self, peer: bytes, message: Any) -> None:
        if isinstance(message, Result | Failed):
            future = self._waiting.get(message.id)
            if future is not None and not future.done():
                self._answered[message.id] = time.perf_counter()
                future.set_result(message)

    def announce(self) -> None:
        if self.up and self.engine.catalog_version() != self._catalog_version:
            self._catalog_version = self.engine.catalog_version()  # one refresh per change
            self._spawn(self.refresh())

    def live_peer(self, peer: bytes) -> bool:
        """The one front end in process is always the current one."""
        return True

    async def flush(self, timeout_s: float = 0.5) -> None:
        self.snapshots[PEER] = self.owner.snapshot(0)


def _expire(future: asyncio.Future[Result | Failed], guard_s: float) -> None:
    if not future.done():
        future.set_exception(DeadlineExceededError(f"the engine did not answer within {guard_s:g} s"))


def create_app(settings: ServerSettings, *, gpus: list[str] | None = None) -> Litestar:
    """The HTTP app (and gRPC, where ``settings.grpc_port`` says so) with its engine in this process (``gpus``: as
    :class:`InProcessEngine` takes them)."""
    return create_http_app(settings, InProcessEngine(settings, gpus=gpus))


class InProcessServer:
    """The front end's HTTP server (uvicorn, as ``visionserve serve`` configures it) and its engine, in a thread of
    this process on 127.0.0.1: what a test or a benchmark needs from a server, minus the processes.

        with InProcessServer(ServerSettings(repository="model_repository", port=0, grpc_port=0)) as server:
            httpx.get(server.url + "/v2/health/ready")

    ``port`` 0 in the settings picks a free port (as ``grpc_port`` 0 leaves gRPC off; pass ``grpc=True`` for a free
    gRPC port); ``gpus``: as :class:`InProcessEngine` takes them ([]: the CPU alone)."""

    def __init__(
        self,
        settings: ServerSettings,
        *,
        grpc: bool = False,
        log_level: str = "warning",
        gpus: list[str] | None = None,
    ) -> None:
        from service.launcher import free_port

        changes: dict[str, Any] = {"host": "127.0.0.1", "port": settings.port or free_port()}
        if grpc:
            changes["grpc_port"] = free_port()
        self.settings = msgspec.structs.replace(settings, **changes)
        self.url = f"http://127.0.0.1:{self.settings.port}"
        self.app = create_app(self.settings, gpus=gpus)
        options = uvicorn_options(self.settings, log_level)
        self._server = uvicorn.Server(uvicorn.Config(self.app, **options))
        self._thread: threading.Thread | None = None

    @property
    def grpc_target(self) -> str:
        if not self.settings.grpc_port:
            raise RuntimeError("this server was started without gRPC (pass grpc=True)")
        return f"127.0.0.1:{self.settings.grpc_port}"

    @property
    def state(self) -> Any:
        """The front end's :class:`~service.frontend.state.ServerState` (for looking, in tests)."""
        return self.app.state.server

    def start(self, timeout_s: float = 120.0) -> InProcessServer:
        """Serve in a thread; return once ready (every model loaded); raise if it fails to start."""
        self._thread = threading.Thread(target=self._server.run, name="in-process-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not (self._server.started and self.state.ready):
            if not self._thread.is_alive():
                raise RuntimeError(f"the in-process server at {self.url} stopped while starting (see the log)")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the in-process server at {self.url} was not ready in {timeout_s:g} s")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Drain and stop (as SIGTERM does to a front end)."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kwargs.pop("timeout", 60), **kwargs)

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
