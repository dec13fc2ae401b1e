"""The image API: ``POST /v1/models/{m}/classify?top_k=5`` with a raw image body or multipart files.

One result per image, in order: its top-k ``{"label", "index", "score"}`` (softmax scores) or its own ``error``.
A raw body that is not a usable image fails the request (400, or 415 for a media type we do not take); in a
multipart request each bad file fails alone.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import msgspec
import numpy as np
from litestar import Request, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, Parameter, PathParameter
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser  # type: ignore[import-untyped]

from service.core.answers import ClassifyResponse, ImageResult, Prediction
from service.core.errors import BadInputError, PayloadTooLargeError, UnsupportedMediaError, VisionServeError
from service.core.scores import predictions, softmax
from service.frontend.http.validation import integer_queries
from service.frontend.parameters import MAX_INT, MAX_TIMEOUT_MS, version_number
from service.frontend.state import ModelSlot, ServerState
from service.frontend.timing import Timing

IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp")


class ErrorBody(msgspec.Struct):
    """Every error: a message for a person; never a stack trace."""

    error: str


ERROR_RESPONSES = {
    code: ResponseSpec(data_container=ErrorBody, description=text)
    for code, text in {
        400: "bad request, bad tensor or undecodable image",
        404: "unknown model or version",
        413: "body, image count or pixel count over the limits",
        415: "unsupported media type",
        429: "overloaded (queue_full_status = 429), with Retry-After",
        500: "a failure of ours",
        503: "overloaded or shutting down, with Retry-After",
        504: "the deadline passed in the queue",
    }.items()
}


def server_of(request: Request[Any, Any, Any]) -> ServerState:
    server: ServerState = request.app.state.server
    return server


def timing_of(request: Request[Any, Any, Any]) -> Timing:
    timing: Timing = request.scope["state"]["timing"]
    return timing


async def read_images(request: Request[Any, Any, Any], limit: int) -> tuple[list[bytes], list[str | None], bool]:
    """(images, filenames, single) from a raw image body or a multipart form of at most ``limit`` files."""
    ctype, options = request.content_type
    if ctype == "multipart/form-data":
        images, names = await _form_files(request, options.get("boundary"))
        if not images:
            raise BadInputError("the multipart request holds no files: send each image as a file part")
        if len(images) > limit:
            raise PayloadTooLargeError(f"{len(images)} images in one request, over the limit of {limit}")
        return images, names, False
    if ctype in IMAGE_TYPES:
        return [await request.body()], [None], True
    raise UnsupportedMediaError(
        f"Content-Type {ctype or '(none)'} is not taken: send image/jpeg, image/png, image/webp or image/bmp as "
        "the body, or multipart/form-data with one or more files"
    )


async def _form_files(request: Request[Any, Any, Any], boundary: str | None) -> tuple[list[bytes], list[str | None]]:
    """The file parts of a multipart form, in the order they were sent, with their filenames; other parts are skipped
    unread. (litestar's ``request.form()`` groups parts by field name, which reorders files sent under different
    names, and decodes every text part, failing on one that is not UTF-8: both found by tests/fuzz.)"""
    if not boundary:
        raise BadInputError(
            "multipart/form-data needs a boundary: send Content-Type: multipart/form-data; boundary=..."
        )
    images: list[bytes] = []
    names: list[str | None] = []
    part: bytearray | None = None  # the file being read; None inside a text part
    try:
        limit = request.app.multipart_form_part_limit
        # Leaving the block closes the parser, which refuses a form cut short.
        with PushMultipartParser(boundary.encode("latin-1"), max_segment_count=limit) as parser:
            async for chunk in request.stream():
                for event in parser.parse(chunk):
                    if isinstance(event, MultipartSegment):
                        part = bytearray() if event.filename else None
                        if part is not None:
                            names.append(event.filename)
                    elif event is None:  # the end of a part
                        if part is not None:
                            images.append(bytes(part))
                        part = None
                    elif part is not None:
                        part.extend(event)
    except ParserLimitReached as exc:
        raise PayloadTooLargeError(f"multipart/form-data over the limits: {exc}") from exc
    except ParserError as exc:
        raise BadInputError(f"invalid multipart/form-data: {exc}") from exc
    return images, names


@post(
    ["/v1/models/{model:str}/classify", "/v1/models/{model:str}/versions/{version:str}/classify"],
    summary="Classify images",
    description="Raw image body (image/jpeg, image/png, image/webp, image/bmp) or multipart/form-data files. "
    "One result per image, in order; a bad file in a multipart request gets its own error.",
    status_code=200,
    tags=["image API"],
    responses=ERROR_RESPONSES,
    opt={"records_requests": True},  # a request refused by parameter validation still counts (validation.py)
    guards=[integer_queries],
)
async def classify(
    request: Request[Any, Any, Any],
    model: FromPath[str],
    version: Annotated[str | None, PathParameter()] = None,
    top_k: Annotated[int, Parameter(ge=1, le=1000, description="classes per image")] = 5,
    priority: Annotated[
        int, Parameter(ge=0, le=MAX_INT, description="lower is served first; 0 is the default level")
    ] = 0,
    timeout_ms: Annotated[
        float | None, Parameter(gt=0, le=MAX_TIMEOUT_MS, description="deadline in the queue (milliseconds)")
    ] = None,
) -> ClassifyResponse:
    # The ranges above are refused by litestar before this runs (a 400 worded by validation.py); NaN fails "> 0",
    # the infinities and 1e400 fail "<=", and nothing past int64 reaches the transport.
    server = server_of(request)
    slot = server.slot(model, version_number(version))
    timing = timing_of(request)
    with slot.observe(timing):
        route = server.route(model, version, request.headers)
        return await _classify(request, server, slot, timing, top_k, priority, timeout_ms, route)


async def _classify(
    request: Request[Any, Any, Any],
    server: ServerState,
    slot: ModelSlot,
    timing: Timing,
    top_k: int,
    priority: int,
    timeout_ms: float | None,
    route: str | None,
) -> ClassifyResponse:
    images, names, single = await read_images(request, server.settings.max_images_per_request)
    decoded = await slot.decode(images, timing)
    if single and isinstance(decoded[0], VisionServeError):
        raise decoded[0]
    results = [ImageResult(filename=name) for name in names]
    good = [i for i, d in enumerate(decoded) if isinstance(d, np.ndarray)]
    for i, d in enumerate(decoded):
        if isinstance(d, VisionServeError):
            results[i].error = str(d)
    if good:
        batch = [decoded[i] for i in good]  # stacked straight into shared memory: one copy
        result = await slot.infer(batch, timing, priority=priority, timeout_ms=timeout_ms, route=route)  # type: ignore[arg-type]
        started = time.perf_counter()
        preds = predictions(softmax(result.logits), slot.spec.labels, top_k)
        for row, i in enumerate(good):
            error = result.errors[row]
            if error is not None and single:
                raise error  # a raw body is the whole request: its status says what happened (500, 504, ...)
            if error is not None:
                results[i].error = str(error)
            else:
                results[i].predictions = [Prediction(**p) for p in preds[row]]  # type: ignore[arg-type]
        timing.postprocess_s += time.perf_counter() - started
    return ClassifyResponse(model=slot.name, version=timing.version or slot.version.version, results=results)
