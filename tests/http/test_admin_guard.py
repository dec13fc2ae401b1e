"""One admin guard (issue 53): every admin route, found from the app's own routes rather than a hand list, refuses
a missing and a wrong token, and every refusal goes through the one check, :func:`protocol.require_admin`, whose
comparison is the constant-time one (:func:`hmac.compare_digest`). gRPC's admin RPCs go through it too."""

from __future__ import annotations

import asyncio
import hmac
import re
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from litestar.handlers import HTTPRouteHandler, WebsocketRouteHandler
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from service.core.errors import ForbiddenError
from service.frontend import protocol
from service.frontend.grpc import servicer
from service.inprocess import InProcessServer
from tests.http.conftest import ADMIN_TOKEN

WRONG = ["", "Bearer", f"Bearer {ADMIN_TOKEN[:-1]}", f"Bearer {ADMIN_TOKEN}x", ADMIN_TOKEN, "Bearer wrong"]


def admin_routes(server: InProcessServer) -> list[tuple[str, str]]:
    """(method, path) of every admin route: an HTTP handler the API documents as admin (its summary says
    "(admin)"), and a WebSocket on the path of one (the results route: its events are admin, so is its socket)."""
    found: list[tuple[str, str]] = []
    for route in server.app.routes:
        for handler in getattr(route, "route_handlers", None) or [route.route_handler]:  # type: ignore[union-attr]
            if isinstance(handler, HTTPRouteHandler) and "(admin)" in (handler.summary or ""):
                found.extend((method, route.path) for method in sorted(handler.http_methods))
            elif isinstance(handler, WebsocketRouteHandler):
                found.append(("WEBSOCKET", route.path))
    admin_paths = {path for method, path in found if method != "WEBSOCKET"}
    return sorted({(method, path) for method, path in found if method != "WEBSOCKET" or path in admin_paths})


def concrete(path: str) -> str:
    """A route's path with each parameter filled in (a model that is there, a source that is not)."""
    return re.sub(r"\{(\w+):\w+\}", lambda m: "digits" if m.group(1) == "model" else "nosuch", path)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts calls of the one admin check and of the constant-time comparison, wherever they come from."""
    counted = {"require_admin": 0, "compare_digest": 0}

    def counting(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            counted[name] += 1
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(protocol, "require_admin", counting("require_admin", protocol.require_admin))
    monkeypatch.setattr(hmac, "compare_digest", counting("compare_digest", hmac.compare_digest))
    yield counted


def test_the_admin_routes_are_found_from_the_app(server: InProcessServer) -> None:
    routes = admin_routes(server)
    paths = {path for _, path in routes}
    # what the issue names, found rather than listed: model load and unload, rollouts, sources (their socket too)
    assert "/v2/repository/models/{model:str}/load" in paths and "/v2/repository/models/{model:str}/unload" in paths
    assert ("POST", "/v2/models/{model:str}/rollout/promote") in routes
    assert ("WEBSOCKET", "/v1/sources/{id:str}/results") in routes and ("DELETE", "/v1/sources/{id:str}") in routes
    assert ("GET", "/v2/models/{model:str}/rollout") not in routes  # reading a rollout is open to all


def test_every_admin_route_refuses_a_missing_and_a_wrong_token_through_the_one_constant_time_check(
    server: InProcessServer, calls: dict[str, int]
) -> None:
    routes = admin_routes(server)
    with server.client() as client:
        for method, path in routes:
            for given in WRONG:
                headers = {"authorization": given} if given else {}
                before = dict(calls)
                url = concrete(path)
                if method == "WEBSOCKET":
                    ws_url = server.url.replace("http", "ws", 1) + url + ("?token=wrong" if given else "")
                    with pytest.raises(InvalidStatus) as refused:
                        connect(ws_url, additional_headers=headers, open_timeout=30).close()
                    status = refused.value.response.status_code
                else:
                    status = client.request(method, url, headers=headers, json={}).status_code
                assert status == 403, (method, path, given, status)
                assert calls["require_admin"] == before["require_admin"] + 1, ("not the one check", method, path)
                assert calls["compare_digest"] > before["compare_digest"] or not given.strip(), (method, path)
            # and the right token passes the guard (whatever the route then answers: never 403)
            if method == "GET" and "{" not in path:
                answer = client.get(path, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
                assert answer.status_code != 403, (path, answer.text)


def test_a_wrong_token_is_compared_in_constant_time_even_when_its_length_differs(calls: dict[str, int]) -> None:
    """The check itself: the comparison is hmac's for every wrong token, however long (``==`` and ``!=`` stop at
    the first differing byte; a length check before compare_digest would say the token's length)."""

    class Settings:
        admin_token = ADMIN_TOKEN

    class State:
        settings = Settings()

    # and what httpx will not send: a header value that ends in a space, one not in ASCII
    for given in [*WRONG, "Bearer ", "Bearer é"]:
        before = calls["compare_digest"]
        with pytest.raises(ForbiddenError):
            protocol.require_admin(State(), given)  # type: ignore[arg-type]
        assert calls["compare_digest"] == before + 1, given
    protocol.require_admin(State(), f"Bearer {ADMIN_TOKEN}")  # type: ignore[arg-type]
    assert calls["compare_digest"] == len(WRONG) + 3


async def called(guarded: servicer.Method, context: _Context) -> Any:
    return await guarded(object(), context)


class _Aborted(Exception):
    pass


class _Context:
    """What ``_guarded`` reads of a gRPC call's context: its metadata, and abort."""

    def __init__(self, authorization: str) -> None:
        self.metadata = (("authorization", authorization),) if authorization else ()
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise _Aborted(details)

    def set_trailing_metadata(self, _metadata: object) -> None:
        pass


def test_every_admin_rpc_refuses_a_missing_and_a_wrong_token_through_the_one_check(
    server: InProcessServer, calls: dict[str, int]
) -> None:
    """gRPC's admin RPCs (``servicer.ADMIN``, the set its handler registration guards) go through the same check."""
    reached: list[str] = []

    async def method(request: object, context: object) -> str:
        reached.append("called")
        return "done"

    assert {"RepositoryModelLoad", "RepositoryModelUnload"} <= servicer.ADMIN
    for name in sorted(servicer.ADMIN):
        guarded = servicer._guarded(name, method, admin=server.state)
        for given in WRONG:
            before = calls["require_admin"]
            context = _Context(given)
            with pytest.raises(_Aborted):
                asyncio.run(called(guarded, context))
            assert context.code == grpc.StatusCode.PERMISSION_DENIED and calls["require_admin"] == before + 1
        assert asyncio.run(called(guarded, _Context(f"Bearer {ADMIN_TOKEN}"))) == "done"
    assert reached == ["called"] * len(servicer.ADMIN)
