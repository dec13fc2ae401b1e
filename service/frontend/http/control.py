"""The control routes of the v2 API: the repository (index, load, unload) and rollouts (docs/rollouts.md).

Every route that changes the server is admin, guarded once on their router (:func:`admin`), never by a call in
each handler; reading a rollout is open to all.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import msgspec
from litestar import Request, Router, get, post
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.types import ControllerRouterHandler

from service.core.errors import BadInputError
from service.core.parameters import flag, load_config
from service.frontend import protocol
from service.frontend.http.image_api import ERROR_RESPONSES, server_of
from service.frontend.http.v2 import MODEL, Model


def admin(connection: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler) -> None:
    """The guard of the control routes: reading (GET) is open, every route that changes the server is admin
    (:func:`protocol.require_admin`, gRPC's too)."""
    if connection.scope.get("method") == "GET":
        return
    protocol.require_admin(server_of(connection), connection.headers.get("authorization", ""))


async def _json_object(request: Request[Any, Any, Any], refusal: str) -> dict[str, Any]:
    """The body as a JSON object ({} for an empty one), else BadInputError(``refusal``)."""
    body = await request.body()
    if not body.strip():
        return {}
    try:
        doc = msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        raise BadInputError(refusal)
    return doc


# Each group's tag and error answers, declared once.
repository_post = partial(post, status_code=200, tags=["v2 repository"], responses=ERROR_RESPONSES)
rollout_post = partial(post, status_code=200, tags=["v2 rollout"], responses=ERROR_RESPONSES)


@repository_post("/v2/repository/index", summary="Repository index (admin)")
async def repository_index(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    """Every model in the repository with its state, unloaded ones too (``UNAVAILABLE`` with a reason); with the
    body ``{"ready": true}``, only the ones ready (as Triton's index)."""
    doc = await _json_object(request, 'a repository index request\'s body must be a JSON object like {"ready": true}')
    return await protocol.repository_index(server_of(request), flag("ready", doc.get("ready")))


@repository_post("/v2/repository/models/{model:str}/load", summary="Load or reload a model (admin)")
async def repository_load(request: Request[Any, Any, Any], model: Model) -> dict[str, str]:
    """Load (or reload) ``model``; ``{"parameters": {"config": "<JSON of config.toml fields>"}}`` applies that
    config for this load, or is refused with 400, never ignored."""
    doc = await _json_object(request, 'a load request\'s body must be a JSON object like {"parameters": {...}}')
    await server_of(request).load_model(model, load_config(doc.get("parameters") or {}))
    return {"name": model, "state": "READY"}


@repository_post("/v2/repository/models/{model:str}/unload", summary="Unload a model (admin)")
async def repository_unload(request: Request[Any, Any, Any], model: Model) -> dict[str, str]:
    """Unload ``model``; unloading a model that is not loaded, or that the repository does not hold, is not an error
    (as in Triton: 200, so scripts stay idempotent)."""
    await protocol.unload(server_of(request), model)
    return {"name": model, "state": "UNAVAILABLE"}


@get(MODEL + "/rollout", summary="The model's rollout: candidate, comparison, verdict", tags=["v2 rollout"],
     responses=ERROR_RESPONSES)  # fmt: skip
async def rollout_status(request: Request[Any, Any, Any], model: Model) -> dict[str, Any]:
    """The rollout of ``model`` (``{"state": "none"}`` without one): the live comparison of its candidate with the
    version serving, and what the evidence says (docs/rollouts.md)."""
    return await protocol.rollout(server_of(request), model)


@rollout_post(MODEL + "/rollout", summary="Start a rollout (admin)")
async def rollout_start(request: Request[Any, Any, Any], model: Model) -> dict[str, Any]:
    """Start a shadow or canary of ``{"candidate": N, "mode": "shadow", "fraction": 0.1, ...}`` beside the version
    serving (any ``[rollout]`` field of config.toml)."""
    settings = await _json_object(request, "a rollout request's body must be a JSON object (docs/rollouts.md)")
    return await protocol.rollout(server_of(request), model, action="start", settings=settings)


@rollout_post([MODEL + "/rollout/promote", MODEL + "/rollout/abort"], summary="Promote or abort the rollout (admin)")
async def rollout_decide(request: Request[Any, Any, Any], model: Model) -> dict[str, Any]:
    """Promote the candidate (it serves every request naming no version; the old version is unloaded once drained)
    or abort it (the primary keeps serving; the candidate is unloaded). ``{"reason": "..."}`` is recorded."""
    doc = await _json_object(request, "a rollout decision request's body must be a JSON object (docs/rollouts.md)")
    action = request.url.path.rstrip("/").rsplit("/", 1)[1]
    return await protocol.rollout(server_of(request), model, action=action, reason=str(doc.get("reason") or ""))


ROUTES: list[ControllerRouterHandler] = [
    Router(
        "/",
        route_handlers=[
            repository_index,
            repository_load,
            repository_unload,
            rollout_status,
            rollout_start,
            rollout_decide,
        ],
        guards=[admin],
    )
]
