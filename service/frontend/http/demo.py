"""The demo page at ``GET /``: one HTML document with its style and script inline, composed once, at import, from the
files in ``static/demo/`` (their ``README.md`` says how), so no request reads the disk; and what it reads, ``GET
/v1/models`` (each model's ``task`` tells the page which route and view fit it). ``/docs`` leads to the OpenAPI UI.
"""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Any

from litestar import Request, get
from litestar.response import Redirect, Response

from service.frontend.http.image_api import server_of
from service.frontend.state import ModelSlot

# The lowest score the page asks a detector for: its slider's range starts here. The parity gate's threshold
# (examples/model_repository/digits-detect/1/spec.json) is 0.05 too: below it scores are noise.
REQUEST_SCORE_THRESHOLD = 0.05

ASSETS = files("service.frontend.http") / "static" / "demo"
INCLUDE = re.compile(r"^@include ([\w-]+\.(?:css|html|js))\n", re.MULTILINE)


def compose() -> str:
    """The page: ``index.html`` with each ``@include`` line replaced by its file, and the threshold filled in."""
    index = (ASSETS / "index.html").read_text(encoding="utf-8")
    page = INCLUDE.sub(lambda part: (ASSETS / part[1]).read_text(encoding="utf-8"), index)
    return page.replace("@REQUEST_SCORE_THRESHOLD@", str(REQUEST_SCORE_THRESHOLD))


PAGE = compose()


@get("/", summary="Demo page", include_in_schema=False, media_type="text/html")
async def index() -> Response[str]:
    return Response(PAGE, media_type="text/html")


@get("/docs", summary="OpenAPI UI", include_in_schema=False)
async def docs() -> Redirect:
    return Redirect(path="/schema/")


@get("/v1/models", summary="The served models", tags=["image API"])
async def list_models(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    return [_listed(versions[max(versions)], versions) for _, versions in sorted(server_of(request).slots.items())]


def _listed(slot: ModelSlot, versions: dict[int, ModelSlot]) -> dict[str, Any]:
    state = slot.engine
    return {
        "name": slot.name,
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
