"""One front-end process: the app on uvicorn (uvloop and httptools where installed), with a graceful SIGTERM (the
README's ``serve``). The supervisor starts it with ``python -m service.frontend.server`` and its launch record
(:class:`FrontendLaunch`) in the environment. A second SIGTERM skips the wait for accepted requests.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import msgspec
import uvicorn

from service.core.lifetime import die_with_parent
from service.core.settings import ServerSettings
from service.frontend.http.app import create_app
from service.frontend.link import SharedMemoryLinks

log = logging.getLogger("visionserve.server")


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.visionserve_app = app
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        state = getattr(self.visionserve_app.state, "server", None)
        if sig == signal.SIGTERM and state is not None and not state.draining and self._loop is not None:
            # First the drain, with the socket still open: a request that arrives now is answered 503 at once
            # (rather than finding the port closed), and every accepted one is answered. Then uvicorn's shutdown.
            # Measured at 70% load: before, every request sent after the signal met a closed port.
            state.draining = True  # readiness false, new inference refused from here on
            log.warning("signal %s: draining (up to %.1f s), then exiting", sig, state.settings.drain_timeout_s)
            self._loop.call_soon_threadsafe(self._start_drain, state, sig, frame)
            return
        if state is not None:
            state.draining = True
        self._shutdown(sig, frame)

    def _start_drain(self, state: Any, sig: int, frame: Any) -> None:
        assert self._loop is not None
        self._drain_task = self._loop.create_task(self._drain_then_exit(state, sig, frame))

    async def _drain_then_exit(self, state: Any, sig: int, frame: Any) -> None:
        bound_s = state.settings.drain_timeout_s
        started = time.monotonic()
        if not await state.drain(bound_s):
            log.error("drain timeout: %d requests still in flight", state.requests_inflight)
        # uvicorn's own graceful wait gets what is left of the one drain bound (the supervisor kills a front end
        # that takes more than drain_timeout_s + 10 s).
        self.config.timeout_graceful_shutdown = max(1, int(bound_s - (time.monotonic() - started)))
        self._shutdown(sig, frame)

    def _shutdown(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM and sig in self._captured_signals:
            # uvicorn re-raises the signal once it has shut down; a clean drain on SIGTERM exits 0 instead.
            self._captured_signals.remove(sig)


def uvicorn_options(settings: ServerSettings, log_level: str) -> dict[str, Any]:
    return {
        "host": settings.host,
        "port": settings.port,
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": _http_protocol(settings),
        # h11's own limit on a head; the httptools protocol counts its head itself (see _http_protocol).
        "h11_max_incomplete_event_size": settings.max_header_bytes,
        "lifespan": "on",
        "log_level": log_level,
        "access_log": False,
        "timeout_graceful_shutdown": max(1, int(settings.drain_timeout_s)),
    }


def _http_protocol(settings: ServerSettings) -> Any:
    """httptools with the connection limits (a head's size and time, a body's pace) where installed, else h11."""
    if not importlib.util.find_spec("httptools"):
        return "h11"
    # Imported here: the module imports httptools, which is optional (the "fast" extra).
    from service.frontend.http.connection import ConnectionLimits, limited_protocol

    # Each limit is the server setting of its name.
    limits = {name: getattr(settings, name) for name in ConnectionLimits.__struct_fields__}
    return limited_protocol(ConnectionLimits(**limits))


def _json_access_log() -> None:
    """One JSON line per request on stdout, whatever the log level of everything else."""
    access = logging.getLogger("visionserve.access")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.handlers[:] = [handler]
    access.setLevel(logging.INFO)
    access.propagate = False


LAUNCH_ENV = "VISIONSERVE_FRONTEND"


class FrontendLaunch(msgspec.Struct, frozen=True, kw_only=True):
    """What the supervisor hands a front end."""

    settings: ServerSettings
    name: str
    arena: str
    engines: tuple[str, ...]
    fd: int  # the listening socket, shared by every front end
    frontends: int = 1  # how many front ends the server runs: readiness waits until every engine has heard of all
    # The sources' owner (docs/sources.md): it is handed the Unix socket it also listens on (sources_fd); the other
    # front ends hand their sources requests to that socket's path (sources_socket).
    sources_fd: int = -1
    sources_socket: str = ""
    log_level: str = "warning"


def run_frontend(launch: FrontendLaunch) -> None:
    settings = launch.settings
    if settings.log_format == "json":
        _json_access_log()
    options = uvicorn_options(settings, launch.log_level)
    del options["host"], options["port"]
    links = SharedMemoryLinks(launch.arena, launch.engines)
    owner = launch.sources_socket if launch.sources_fd < 0 else ""
    app = create_app(settings, links, frontend=launch.name, frontends=launch.frontends, sources_owner=owner)
    server = _Server(uvicorn.Config(app, **options), app)
    # The inherited listening socket, with its real family: uvicorn's own ``fd=`` takes every fd for a Unix
    # socket, and then TCP_NODELAY is never set on connections, so a keep-alive client waited ~40 ms per answer
    # (Nagle against delayed ACKs; measured with the load tester: p50 48 ms at c=1 against 4 ms on the server).
    listener = socket.socket(fileno=launch.fd)
    listeners = [listener] + ([socket.socket(fileno=launch.sources_fd)] if launch.sources_fd >= 0 else [])
    # uvicorn restores the handler it found once it has shut down. Outside its run (before start-up, or after the
    # drain while threads and the loop wind down) a SIGTERM, e.g. a supervisor repeating itself, means "exit now",
    # and nothing accepted is left: exit 0 rather than die by the signal.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    started = time.perf_counter()
    server.run(sockets=listeners)
    log.info("front end %s stopped after %.1f s", launch.name, time.perf_counter() - started)


def main() -> None:
    launch = msgspec.json.decode(os.environ[LAUNCH_ENV], type=FrontendLaunch)
    logging.basicConfig(
        level=getattr(logging, launch.log_level.upper()),
        format=f"%(asctime)s %(levelname)s %(name)s[{launch.name}]: %(message)s",
    )
    die_with_parent()
    run_frontend(launch)


if __name__ == "__main__":
    main()
