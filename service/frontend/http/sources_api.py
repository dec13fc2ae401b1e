"""``/v1/sources``: the sources the server pulls (docs/sources.md, "The routes"); every route is admin, reading
included, with ``?token=`` also taken on the results routes (a browser's WebSocket and EventSource cannot send a
header).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator
from typing import Any
from urllib.parse import quote

import msgspec
from litestar import Request, Response, Router, WebSocket, delete, get, patch, post, websocket
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import FromPath
from litestar.response import ServerSentEvent

from service.core.errors import BadInputError, OverloadedError
from service.core.parameters import json_number_error
from service.frontend import protocol
from service.frontend.http.image_api import ERROR_RESPONSES, server_of
from service.frontend.http.stream_ws import GOING_AWAY, NOT_FOUND, NOT_READING, close_reason
from service.frontend.sources.forward import Owner
from service.frontend.sources.registry import Sources
from service.frontend.sources.store import document, read_rows, store_path

RESULTS = "/v1/sources/{id:str}/results"


def sources_admin(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """Every sources route needs the admin token (:func:`protocol.require_admin`, the one check of every admin
    route): a server that fetches URLs must not be an open proxy."""
    given = connection.headers.get("authorization", "")
    if not given and handler.handler_name in ("source_events", "source_results"):
        given = f"Bearer {connection.query_params.get('token', '')}"
    protocol.require_admin(server_of(connection), given, what="a sources route",
                           hint=" (or ?token= on the results routes)")  # fmt: skip


def sources_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Sources:
    server = server_of(connection)
    if server.sources is None:
        raise OverloadedError("the server is starting: its sources are not up yet")
    return server.sources


async def _body(request: Request[Any, Any, Any]) -> Any:
    """The body as JSON, strictly: a number JSON cannot hold (``NaN``, ``Infinity``, ``1e999``, which Python's
    ``json`` takes) or an integer too long to read is refused naming its field (``top_k: Infinity`` was a 500)."""
    raw = await request.body()
    try:
        return msgspec.json.decode(raw or b"{}")
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise BadInputError(json_number_error(raw) or "the body must be a JSON object") from None
    except RecursionError:  # arrays or objects nested past msgspec's depth ('[' * 1000 was a 500)
        raise BadInputError("the body must be a JSON object, nested less deeply than this one") from None


def _owner(connection: ASGIConnection[Any, Any, Any, Any]) -> tuple[Owner | None, dict[str, str]]:
    """The front end that runs the sources, where it is not this one, and the headers it is asked with."""
    server = server_of(connection)
    return server.sources_owner, {"authorization": f"Bearer {server.settings.admin_token}"}


async def at_owner(request: Request[Any, Any, Any]) -> Any:
    """Every sources route but the results' (``before_request``): where another front end runs the sources, its
    answer, else None (the route runs here). Where it cannot be reached (``fe0`` restarting past the forward's
    timeouts), a read is answered from the sources as stored (docs/sources.md, "One owner"): a listing never loses
    a source while its owner is away."""
    if (owner := _owner(request)[0]) is None or request.route_handler.handler_name == "source_events":
        return None
    target = quote(request.url.path) + (f"?{request.url.query}" if request.url.query else "")
    try:
        answer = await owner.request(request.method, target, dict(request.headers), await request.body())
    except OverloadedError:
        if request.method != "GET":
            raise
        id = request.path_params.get("id")
        rows = await asyncio.to_thread(read_rows, store_path(server_of(request).settings))
        docs = [document(row_id, body) for row_id, body in rows if id is None or row_id == id]
        if id is None:
            return {"sources": docs}
        if not docs:
            raise
        return docs[0]
    return Response(answer.body, status_code=answer.status)


@post("/v1/sources", summary="Start a source (admin)", status_code=201, responses=ERROR_RESPONSES)
async def create_source(request: Request[Any, Any, Any]) -> Any:
    """Start pulling ``url`` into ``model``: docs/sources.md."""
    return sources_of(request).create(await _body(request)).describe()


@get("/v1/sources", summary="Every source (admin)", responses=ERROR_RESPONSES)
async def list_sources(request: Request[Any, Any, Any]) -> Any:
    return {"sources": sources_of(request).describe()}


@get("/v1/sources/{id:str}", summary="One source (admin)", responses=ERROR_RESPONSES)
async def show_source(request: Request[Any, Any, Any], id: FromPath[str]) -> Any:
    return sources_of(request).get(id).describe()


@patch("/v1/sources/{id:str}", summary="Change a source's options (admin)", responses=ERROR_RESPONSES)
async def change_source(request: Request[Any, Any, Any], id: FromPath[str]) -> Any:
    return sources_of(request).change(id, await _body(request)).describe()


@delete("/v1/sources/{id:str}", summary="Stop a source (admin)", status_code=200, responses=ERROR_RESPONSES)
async def delete_source(request: Request[Any, Any, Any], id: FromPath[str]) -> Any:
    return await sources_of(request).delete(id)


@get("/v1/sources/{id:str}/counts", summary="A source's line and zone counts (admin)", responses=ERROR_RESPONSES)
async def source_counts(request: Request[Any, Any, Any], id: FromPath[str]) -> Any:
    """Its tracks counted through its lines and zones: docs/tracking.md."""
    return sources_of(request).get(id).counts()


@post("/v1/sources/{id:str}/counts/reset", summary="Zero a source's counts (admin)", status_code=200,
      responses=ERROR_RESPONSES)  # fmt: skip
async def reset_counts(request: Request[Any, Any, Any], id: FromPath[str]) -> Any:
    source = sources_of(request).get(id)
    if source.tracking is not None:
        source.tracking.counter.reset()
    return source.counts()


@get(RESULTS, summary="A source's answers as Server-Sent Events (admin)", responses=ERROR_RESPONSES)
async def source_events(request: Request[Any, Any, Any], id: FromPath[str]) -> ServerSentEvent | Response[Any]:
    """One ``data:`` event per answer, the last one ``ended``."""
    owner, auth = _owner(request)
    if owner is not None:  # a source that is not there is refused before the events start
        found = await owner.request("GET", f"/v1/sources/{quote(id)}", auth)
        if found.status != 200:
            return Response(found.body, status_code=found.status)
    else:
        sources_of(request).get(id)
    return ServerSentEvent(_texts(request, id))


async def _texts(connection: ASGIConnection[Any, Any, Any, Any], id: str) -> AsyncGenerator[str, None]:
    """The source's answers as JSON texts, from the sources here or from their owner; with ``?frames=1``, each
    result carries its frame (``image``, a base64 JPEG), as the demo page shows it."""
    frames = connection.query_params.get("frames", "") in ("1", "true")
    owner, auth = _owner(connection)
    if owner is not None:
        target = f"/v1/sources/{quote(id)}/results" + ("?frames=1" if frames else "")
        async for text in owner.events(target, auth):
            yield text
        return
    source = sources_of(connection).get(id)
    subscriber = source.subscribe(frames)
    try:
        async for message in subscriber.messages():
            yield json.dumps(message, separators=(",", ":"))
        if subscriber.cut_off is not None:
            cut = {"source": source.id, "status": "cut_off", "reason": subscriber.cut_off}
            yield json.dumps(cut, separators=(",", ":"))
    finally:
        source.subscribers.discard(subscriber)


@websocket(RESULTS)
async def source_results(socket: WebSocket[Any, Any, Any], id: FromPath[str]) -> None:
    """The source's answers, a JSON text message each; the last is ``ended`` (1001 follows), or ``cut_off`` for a
    subscriber that stopped reading (1008)."""
    server = server_of(socket)
    await socket.accept()
    if server.sources_owner is None:
        try:
            sources_of(socket).get(id)
        except Exception as exc:
            await socket.send_text(json.dumps({"status": "error", "error": str(exc)}))
            await socket.close(code=NOT_FOUND, reason=close_reason(str(exc)))
            return
    code, why = GOING_AWAY, "the source ended"
    texts = _texts(socket, id)
    gone = asyncio.ensure_future(_until_closed(socket))  # a client that leaves while nothing is sent is noticed
    try:
        while True:
            following = asyncio.ensure_future(anext(texts))
            await asyncio.wait([following, gone], return_when=asyncio.FIRST_COMPLETED)
            if not following.done():
                following.cancel()
                return
            try:
                text = following.result()
            except StopAsyncIteration:
                break
            await asyncio.wait_for(socket.send_text(text), server.settings.stream_send_timeout_s)
            if '"status":"cut_off"' in text:
                code, why = NOT_READING, "cut off: it left answers unread"
    except TimeoutError:
        code, why = NOT_READING, "cut off: an answer waited too long to be read"
    except Exception:  # the subscriber went away
        return
    finally:
        gone.cancel()
        with contextlib.suppress(Exception):
            await texts.aclose()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(socket.close(code=code, reason=why[:120]), 2.0)


async def _until_closed(socket: WebSocket[Any, Any, Any]) -> None:
    """Returns once the client has closed (what it sends otherwise is not read: this route only answers)."""
    with contextlib.suppress(Exception):
        while (await socket.receive())["type"] != "websocket.disconnect":
            pass


ROUTER = Router(
    path="/",
    route_handlers=[
        create_source,
        list_sources,
        show_source,
        change_source,
        delete_source,
        source_counts,
        reset_counts,
        source_events,
        source_results,
    ],
    guards=[sources_admin],
    before_request=at_owner,
    tags=["sources"],
)
