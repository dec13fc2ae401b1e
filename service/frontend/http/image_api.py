"""The image API (the README's "Image API"): ``POST /v1/models/{m}/{task}``, one route for each task of
:mod:`service.core.tasks` (``classify?top_k=5``, ``detect?score_threshold=0.5``), its queries the task's options,
read and described from their one declaration. A request on the route of another task is refused (400) naming the
route that fits; a raw body's bad image fails the request, a bad file of a multipart request fails alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from litestar import Request, post
from litestar.connection import ASGIConnection
from litestar.datastructures import MultiDict
from litestar.enums import MediaType, ParamType
from litestar.handlers import HTTPRouteHandler
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import OpenAPIType, Operation, Schema
from litestar.openapi.spec import Parameter as OpenAPIParameter
from litestar.params import FromPath, Parameter, PathParameter
from litestar.response import Stream
from multipart import MultipartSegment, ParserError, ParserLimitReached, PushMultipartParser  # type: ignore[import-untyped]

from service.core.errors import BadInputError, PayloadTooLargeError, UnsupportedMediaError, VisionServeError
from service.core.parameters import MAX_INT, MAX_TIMEOUT_MS
from service.core.tasks import TASKS, Field, Task, Want, fields
from service.core.tasks.options import Options, read
from service.frontend import request as path
from service.frontend.http.validation import integer_queries
from service.frontend.state import ServerState
from service.frontend.timing import Timing

QUERY = " (query parameter)"
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


def server_of(connection: ASGIConnection[Any, Any, Any, Any]) -> ServerState:
    server: ServerState = connection.app.state.server
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


def image_route(task: type[Task]) -> HTTPRouteHandler:
    """``POST /v1/models/{m}/{task}``: the image API of one task, its queries read from the task's options (and
    listed in the OpenAPI schema from the same declaration)."""

    async def route(
        request: Request[Any, Any, Any],
        model: FromPath[str],
        version: Annotated[str | None, PathParameter()] = None,
        priority: PriorityQuery = 0,
        timeout_ms: TimeoutQuery = None,
    ) -> Any:
        server = server_of(request)
        values = query_values(request.query_params, task.Options)
        try:
            where = path.target(server, model, version, request.headers, aliases=False)
        except VisionServeError:
            read(task.Options, values, None, text=True, said=QUERY)  # a bad option is refused first (see parse)
            raise
        names: list[str | None] = []

        async def parse(where: path.Target) -> path.Ask:
            served = where.slot.task
            if served.name != task.name:
                # Each option's range is the route's, refused before anything of the model (as litestar's checks
                # were when they were the handler's signature); the classes named are the model's.
                read(task.Options, values, None, text=True, said=QUERY)
                raise BadInputError(
                    f"model {where.slot.name!r} is a {served.name} model: /{task.name} does not fit it; "
                    f"POST /v1/models/{where.slot.name}/{served.name} instead"
                )
            options = served.options(values, text=True, said=QUERY)
            images, found, single = await read_images(request, server.settings.max_images_per_request)
            names.extend(found)
            # A raw body is the whole request: its image's failure is the request's (400, 500, 504, ...).
            return path.Ask(Want(options=options), images, priority=priority, timeout_ms=timeout_ms, each=not single)

        return await path.answer(where, timing_of(request), parse, lambda answer: image_answer(answer, names))

    route.__name__ = route.__qualname__ = task.name
    # A Stream is sent as it is, whatever the annotation (litestar); the schema keeps the task's response.
    route.__annotations__ = {**route.__annotations__, "return": task.response_type}
    return post(
        [f"/v1/models/{{model:str}}/{task.name}", f"/v1/models/{{model:str}}/versions/{{version:str}}/{task.name}"],
        summary=task.summary,
        description=f"{task.about} Raw image body (image/jpeg, image/png, image/webp, image/bmp) or "
        "multipart/form-data files. One result per image, in order; a bad file in a multipart request gets its "
        "own error.",
        status_code=200,
        tags=["image API"],
        responses=ERROR_RESPONSES,
        opt={"records_requests": True},  # a request refused by parameter validation still counts (validation.py)
        guards=[integer_queries],
        operation_class=_operation(task),
    )(route)


def query_values(query: MultiDict[Any], options: type[Options]) -> dict[str, Any]:
    """The query's text for each of ``options`` it holds (``classes`` repeated: a list): what the image API and the
    WebSocket stream read."""
    present = [f for f in fields(options) if f.name in query]
    return {f.name: query.getall(f.name) if f.kind == "classes" else query[f.name] for f in present}


def _operation(task: type[Task]) -> type[Operation]:
    """The route's OpenAPI operation, with a query parameter for each of the task's options."""
    kinds = {"number": OpenAPIType.NUMBER, "integer": OpenAPIType.INTEGER, "flag": OpenAPIType.BOOLEAN}

    def parameter(f: Field) -> OpenAPIParameter:
        if f.kind == "classes":
            schema = Schema(type=OpenAPIType.ARRAY, items=Schema(type=OpenAPIType.STRING))
        elif f.kind == "choice":
            schema = Schema(type=OpenAPIType.STRING, enum=list(f.choices), default=f.default)
        else:
            schema = Schema(type=kinds[f.kind], minimum=f.low, maximum=f.high, default=f.default)
        return OpenAPIParameter(f.name, ParamType.QUERY, schema=schema, description=f.described, required=False)

    @dataclass
    class TaskOperation(Operation):
        def __post_init__(self) -> None:  # the options as declared when the schema is drawn
            self.parameters = [*(self.parameters or []), *(parameter(f) for f in fields(task.Options))]

    return TaskOperation


def image_answer(answer: path.Answer, names: list[str | None]) -> Any:
    """The route's answer: the task's response, or past :data:`ENCODED_HERE` rows its JSON in pieces."""
    task = answer.slot.task
    transforms = answer.ask.transforms or [None] * len(names)
    results = []
    each = zip(names, answer.errors, answer.predictions, transforms, strict=True)
    for i, (name, error, rows, shown) in enumerate(each):
        if error is not None:
            results.append(task.result_type(filename=name, error=str(error)))
            continue
        results.append(task.result(name, rows or [], shown))
        answer.predictions[i] = None  # an image's rows let go as they are turned, not all at once at the end
    if sum(answer.detections or []) <= ENCODED_HERE:
        return task.response_type(model=answer.slot.name, version=answer.version, results=results)
    return Stream(_pieces(task.response_type, answer.slot.name, answer.version, results), media_type=MediaType.JSON)


def _pieces(response: type[msgspec.Struct], model: str, version: int, results: list[Any]) -> list[bytes]:
    """A response's JSON as pieces, one a result, each result let go once encoded: no call of this holds the
    interpreter for more than one image's worth (one encoding of half a million boxes held it 130 ms, and joining
    45 MB of pieces 60 ms, so every request on the event loop waited that long)."""
    head = msgspec.json.encode(response(model=model, version=version, results=[]))
    assert head.endswith(b"[]}"), head  # results is the last field
    pieces = [head[:-2]]
    while results:
        pieces.append((b"," if len(pieces) > 1 else b"") + msgspec.json.encode(results.pop(0)))
    pieces.append(head[-2:])
    return pieces


# Past this many boxes in one answer, the route encodes its JSON itself, in pieces, in the worker thread the request
# path gives a heavy answer (request.OFF_LOOP_VALUES), rather than leaving it to litestar on the event loop.
ENCODED_HERE = 10_000
IMAGE_ROUTES = [image_route(task) for task in TASKS.values()]
