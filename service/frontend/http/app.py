"""``create_app(settings)``: the litestar application. The lifespan owns the repository and the engines."""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from litestar import Litestar, Request, Response, get
from litestar.exceptions import HTTPException
from litestar.middleware import DefineMiddleware
from litestar.openapi import OpenAPIConfig

from service.core.errors import ConfigError, VisionServeError
from service.core.metrics import CONTENT_TYPE
from service.core.settings import ServerSettings
from service.frontend.grpc import start_grpc
from service.frontend.http.control import ROUTES as CONTROL_ROUTES
from service.frontend.http.demo import docs, index, list_models
from service.frontend.http.errors import handle_http, handle_ours, handle_unexpected
from service.frontend.http.image_api import IMAGE_ROUTES, server_of
from service.frontend.http.openapi_ui import swagger_asset, swagger_plugin
from service.frontend.http.sources_api import ROUTER as SOURCES_ROUTER
from service.frontend.http.stream_ws import stream
from service.frontend.http.timing import ServerTimingMiddleware
from service.frontend.http.v2 import ROUTES, SERVER_VERSION
from service.frontend.link import Linker
from service.frontend.sources.forward import Owner
from service.frontend.sources.registry import Sources
from service.frontend.sources.store import SourceStore, store_path
from service.frontend.state import ServerState

log = logging.getLogger("visionserve.server")


def operation_id(handler: Any, method: Any, components: list[Any]) -> str:
    """Unique per path: one handler serves several paths (with and without /versions/{version})."""
    parts = [getattr(c, "name", c) for c in components]
    return "_".join([handler.handler_name, str(method).lower(), *(re.sub(r"\W+", "_", str(p)) for p in parts)])


@get("/metrics", summary="Prometheus metrics", include_in_schema=False, media_type=CONTENT_TYPE)
async def metrics(request: Request[Any, Any, Any]) -> Response[bytes]:
    # The header given whole: litestar appends "; charset=utf-8" to any text/* media type, and CONTENT_TYPE (the
    # Prometheus exposition format's) already names its charset, so it went out twice.
    return Response(await server_of(request).render_metrics(), headers={"Content-Type": CONTENT_TYPE})


def start_sources(server: ServerState) -> None:
    """The sources' registry over its store (none, logged, where it cannot be opened), and the sources of
    ``--sources FILE`` and of the store started; a row that cannot start is logged, and the server serves on."""
    settings, path = server.settings, store_path(server.settings)
    store: SourceStore | None = None
    # Created only for a server that can have sources (a repository served without them is left as it is).
    if settings.admin_token or settings.sources or path.exists():
        try:
            store = SourceStore(path)
        except ConfigError as exc:
            log.error("%s: sources will not be kept across restarts", exc)
    server.sources = Sources(server, store)
    try:
        started = server.sources.start_stored(settings.sources)
        if started:
            log.info("started %d source(s) (--sources and the store)", len(started))
    except ConfigError as exc:
        log.error("%s", exc)


def create_app(
    settings: ServerSettings | None = None,
    linker: Linker | None = None,
    *,
    frontend: str = "fe0",
    frontends: int = 1,
    sources_owner: str = "",
) -> Litestar:
    """The HTTP app of one front end. ``linker`` gives its links to the engines: shared memory when the supervisor
    starts it (``service.supervisor``), or in process (``service.inprocess``); ``frontends``: how many front ends
    the server runs (readiness waits for all of them). Its start-up returns only once every engine link is up, so
    uvicorn accepts no connection this front end could not serve. ``sources_owner``: the Unix socket of the front
    end that runs the sources, where that is another one (service.frontend.sources.forward)."""
    settings = settings or ServerSettings()
    server = ServerState(settings, linker, frontend=frontend, frontends=frontends)
    if sources_owner:
        server.sources_owner = Owner(sources_owner)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        app.state.server = server
        await server.start()
        grpc_server = await start_grpc(server)
        if await server.wait_linked():
            log.info("front end %s linked to %d engine(s)", frontend, len(server.links))
        if server.sources_owner is None:
            start_sources(server)
        try:
            yield
        finally:
            log.info("shutting down: draining queued requests (up to %.1f s)", settings.drain_timeout_s)
            if grpc_server is not None:
                await grpc_server.stop(settings.drain_timeout_s)
            if server.sources is not None:
                await server.sources.close()
            await server.close()

    app = Litestar(
        route_handlers=[
            *IMAGE_ROUTES,
            stream,
            index,
            docs,
            swagger_asset,
            list_models,
            *ROUTES,
            *CONTROL_ROUTES,
            SOURCES_ROUTER,
            *([metrics] if settings.metrics else []),
        ],
        lifespan=[lifespan],
        exception_handlers={VisionServeError: handle_ours, HTTPException: handle_http, Exception: handle_unexpected},
        middleware=[
            DefineMiddleware(ServerTimingMiddleware, json_log=settings.log_format == "json")  # type: ignore[arg-type]
        ],
        openapi_config=OpenAPIConfig(
            title="visionserve",
            version=SERVER_VERSION,
            path="/schema",
            render_plugins=[swagger_plugin()],
            operation_id_creator=operation_id,
        ),
        request_max_body_size=settings.max_body_bytes,
        debug=False,
    )
    app.state.server = server
    return app
