"""``GET /``: the demo page (``demo.py``), where a person drops images and sees the classes, or a detector's boxes
drawn over each image, the scores and the timings; ``/docs``; ``GET /v1/models`` (each model's ``task``,
``classify`` or ``detect``, tells the page which route and view fit it)."""

from __future__ import annotations

from typing import Any

from litestar import Request, get
from litestar.response import Redirect, Response

from service.frontend.http.demo import PAGE
from service.frontend.http.image_api import server_of


@get("/", summary="Demo page", include_in_schema=False, media_type="text/html")
async def index() -> Response[str]:
    return Response(PAGE, media_type="text/html")


@get("/docs", summary="OpenAPI UI", include_in_schema=False)
async def docs() -> Redirect:
    return Redirect(path="/schema/")


@get("/v1/models", summary="The served models", tags=["image API"])
async def list_models(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    server = server_of(request)
    rows = []
    for name, versions in sorted(server.slots.items()):
        slot = versions[max(versions)]
        state = slot.engine.state()
        rows.append(
            {
                "name": name,
                "task": slot.spec.task,
                "version": slot.version.version,
                "versions": sorted(versions),
                "state": state.state,
                "device": ",".join(state.devices),
                "backend": state.backend,
                "precision": state.precision + (" (ungated)" if state.ungated else ""),
                "note": state.note,
                "residency": state.residency,
                "resident": state.resident,
                "resident_bytes": state.resident_bytes,
                "classes": slot.spec.num_classes,
                "input": [slot.spec.input.channels, slot.spec.input.height, slot.spec.input.width],
            }
        )
    return rows
