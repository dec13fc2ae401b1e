"""The OpenAPI UI (``/docs`` -> ``/schema/``) with Swagger UI's script, styles and icon served by this server.

litestar's ``SwaggerRenderPlugin`` loads them from a CDN by default, so on a machine with no network the page was
blank. The files come from the ``swagger-ui-bundle-v2`` package (Swagger UI 5.x, which reads the OpenAPI 3.1
document litestar writes; the 4.x of ``swagger-ui-bundle`` 1.1 does not), under a path that names the Swagger UI
version, so browsers may keep them for a day.
"""

from __future__ import annotations

import functools
from pathlib import Path

from litestar import get
from litestar.exceptions import NotFoundException
from litestar.openapi.plugins import SwaggerRenderPlugin
from litestar.params import FromPath
from litestar.response import Response
from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped]

ASSET_TYPES = {  # litestar adds "; charset=utf-8" to text/* types
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui-standalone-preset.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "favicon-32x32.png": "image/png",
}
ASSETS_ROOT = "/docs/assets"
VERSIONED = Path(str(swagger_ui_path)).name  # "swagger-ui-5.31.0"


def asset_url(name: str) -> str:
    return f"{ASSETS_ROOT}/{VERSIONED}/{name}"


@functools.cache
def _asset(name: str) -> bytes:
    return (Path(str(swagger_ui_path)) / name).read_bytes()


@get(f"{ASSETS_ROOT}/{{version:str}}/{{name:str}}", include_in_schema=False, sync_to_thread=True)
def swagger_asset(version: FromPath[str], name: FromPath[str]) -> Response[bytes]:
    """One of Swagger UI's files (read once, then held: about 2 MB in all)."""
    media_type = ASSET_TYPES.get(name)
    if media_type is None or version != VERSIONED:
        raise NotFoundException(f"no such OpenAPI UI asset: {version}/{name}")
    return Response(_asset(name), media_type=media_type, headers={"Cache-Control": "public, max-age=86400"})


def swagger_plugin() -> SwaggerRenderPlugin:
    """Swagger UI at ``/schema/``, every file it loads from this server."""
    return SwaggerRenderPlugin(
        path="/",
        js_url=asset_url("swagger-ui-bundle.js"),
        css_url=asset_url("swagger-ui.css"),
        standalone_preset_js_url=asset_url("swagger-ui-standalone-preset.js"),
        favicon=f"<link rel='icon' type='image/png' href='{asset_url('favicon-32x32.png')}'>",
    )
