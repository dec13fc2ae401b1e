"""The image API: ``POST /v1/models/{m}/classify?top_k=5`` with a raw image body or multipart files.

One result per image, in order: its top-k ``{"label", "index", "score"}`` (softmax scores) or its own ``error``.
A raw body that is not a usable image fails the request (400, or 415 for a media type we do not take); in a
multipart request each bad file fails alone.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, Parameter, PathParameter
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser  # type: ignore[import-untyped]

from service.core.answers import ClassifyResponse, ImageResult, Prediction
from service.core.errors import BadInputError, PayloadTooLargeError, UnsupportedMediaError
from service.frontend import request as path
from service.frontend.http.validation import integer_queries
from service.frontend.parameters import MAX_INT, MAX_TIMEOUT_MS, MAX_TOP_K
from service.frontend.state import ModelSlot, ServerState
from service.frontend.tasks import Want
from service.frontend.timing import Timing

IMAGE_TYPES = ("image/jpeg", "image/png", "image/webp", "image/bmp")


class ErrorBody(msgspec.Struct):
    """Every error: a message for a person; never a stack trace."""

    error: str


# The queries every image route takes (classify and detect), declared once: their ranges are refused by litestar
# before a handler runs (a 400 worded by validation.py).
PriorityQuery = Annotated[int, Parameter(ge=0, le=MAX_INT, description="lower is served first; 0 is the default level")]
TimeoutQuery = Annotated[
    float | None, Parameter(gt=0, le=MAX_TIMEOUT_MS, description="deadline in the queue (milliseconds)")
]

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


def require_task(slot: ModelSlot, task: str, route: str) -> None:
    """Refuse a request on the route of another task, naming the route that fits the model."""
    if slot.spec.task != task:
        fits = "detect" if slot.spec.task == "detect" else "classify"
        raise BadInputError(
            f"model {slot.name!r} is a {slot.spec.task} model: {route} does not fit it; "
            f"POST /v1/models/{slot.name}/{fits} instead"
        )


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
    top_k: Annotated[int, Parameter(ge=1, le=MAX_TOP_K, description="classes per image")] = 5,
    priority: PriorityQuery = 0,
    timeout_ms: TimeoutQuery = None,
) -> ClassifyResponse:
    # The ranges above are refused by litestar before this runs (a 400 worded by validation.py); NaN fails "> 0",
    # the infinities and 1e400 fail "<=", and nothing past int64 reaches the transport.
    server = server_of(request)
    where = path.target(server, model, version, request.headers, aliases=False)
    names: list[str | None] = []

    async def parse(where: path.Target) -> path.Ask:
        require_task(where.slot, "classify", "/classify")
        images, found, single = await read_images(request, server.settings.max_images_per_request)
        names.extend(found)
        # A raw body is the whole request: its image's failure is the request's (400, 500, 504, ...).
        return path.Ask(Want(top_k=top_k), images, priority=priority, timeout_ms=timeout_ms, each=not single)

    def encode(answer: path.Answer) -> ClassifyResponse:
        results = [
            ImageResult(filename=name, error=str(error))
            if error is not None
            else ImageResult(filename=name, predictions=[Prediction(**p) for p in best or []])  # type: ignore[arg-type]
            for name, error, best in zip(names, answer.errors, answer.predictions, strict=True)
        ]
        return ClassifyResponse(model=answer.slot.name, version=answer.version, results=results)

    return await path.answer(where, timing_of(request), parse, encode)
