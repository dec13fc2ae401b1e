"""The image API for detectors: ``POST /v1/models/{m}/detect`` with a raw image body or multipart files, as
classify takes them.

One result per image, in order: its ``width`` and ``height`` as a viewer shows it (EXIF orientation applied) and
its ``detections`` (``{"box", "label", "index", "score"}``, best first, boxes in the image's own pixels), or its own
``error``. A classify call on a detector, or a detect call on a classifier, is refused (400) naming the route that
fits.
"""

from __future__ import annotations

from typing import Annotated, Any, cast

import msgspec
from litestar import Request, post
from litestar.enums import MediaType
from litestar.params import FromPath, Parameter, PathParameter
from litestar.response import Stream

from service.core.answers import Detection, DetectResponse, DetectResult
from service.core.boxes import BoxFormat
from service.frontend import request as path
from service.frontend.detect_options import MAX_DETECTIONS, detect_options
from service.frontend.http.image_api import (
    ERROR_RESPONSES,
    PriorityQuery,
    TimeoutQuery,
    read_images,
    require_task,
    server_of,
    timing_of,
)
from service.frontend.http.validation import integer_queries
from service.frontend.tasks import Detect, Want


@post(
    ["/v1/models/{model:str}/detect", "/v1/models/{model:str}/versions/{version:str}/detect"],
    summary="Detect objects in images",
    description="Raw image body (image/jpeg, image/png, image/webp, image/bmp) or multipart/form-data files. "
    "One result per image, in order, with its boxes in the image's own pixels; a bad file in a multipart request "
    "gets its own error.",
    status_code=200,
    tags=["image API"],
    responses=ERROR_RESPONSES,
    opt={"records_requests": True},
    guards=[integer_queries],
)
async def detect(
    request: Request[Any, Any, Any],
    model: FromPath[str],
    version: Annotated[str | None, PathParameter()] = None,
    score_threshold: Annotated[float, Parameter(ge=0, le=1, description="boxes scoring less are dropped")] = 0.25,
    iou_threshold: Annotated[
        float | None,
        Parameter(ge=0, le=1, description="of two boxes overlapping more, the lower scored is dropped (default 0.45)"),
    ] = None,
    max_detections: Annotated[
        int, Parameter(ge=1, le=MAX_DETECTIONS, description="at most this many boxes an image")
    ] = 100,
    classes: Annotated[
        list[str] | None, Parameter(description="keep only these classes (repeated; labels or indices)")
    ] = None,
    class_agnostic: Annotated[bool | None, Parameter(description="suppress across classes (default false)")] = None,
    box_format: Annotated[BoxFormat, Parameter(description="xyxy, xywh (corner, size) or cxcywh")] = "xyxy",
    normalized: Annotated[bool, Parameter(description="boxes as fractions of the image's width and height")] = False,
    priority: PriorityQuery = 0,
    timeout_ms: TimeoutQuery = None,
) -> DetectResponse:
    server = server_of(request)
    where = path.target(server, model, version, request.headers, aliases=False)
    names: list[str | None] = []

    async def parse(where: path.Target) -> path.Ask:
        require_task(where.slot, "detect", "/detect")
        given = {"iou_threshold": iou_threshold, "class_agnostic": class_agnostic}
        if isinstance(where.slot.task, Detect):  # require_task saw to that
            where.slot.task.refuse_suppression([name for name, value in given.items() if value is not None])
        options = detect_options(
            where.slot.spec.labels, score_threshold=score_threshold,
            iou_threshold=0.45 if iou_threshold is None else iou_threshold, max_detections=max_detections,
            classes=classes, class_agnostic=bool(class_agnostic), box_format_=box_format, normalized=normalized,
        )  # fmt: skip
        images, found, single = await read_images(request, server.settings.max_images_per_request)
        names.extend(found)
        want = Want(detect=options)
        return path.Ask(want, images, priority=priority, timeout_ms=timeout_ms, each=not single)

    # A Stream is sent as it is, whatever the annotation (litestar); the schema keeps DetectResponse, its content.
    answer = await path.answer(where, timing_of(request), parse, lambda answer: detect_answer(answer, names))
    return cast(DetectResponse, answer)


def detect_answer(answer: path.Answer, names: list[str | None]) -> DetectResponse | Stream:
    """The route's answer: a :class:`DetectResponse`, or past :data:`ENCODED_HERE` boxes its JSON in pieces."""
    transforms = answer.ask.transforms or [None] * len(names)
    results = []
    for i, (name, error, found, where) in enumerate(
        zip(names, answer.errors, answer.predictions, transforms, strict=True)
    ):
        if error is not None or where is None:
            results.append(DetectResult(filename=name, error=str(error)))
            continue
        detections = [Detection(**d) for d in found or []]  # type: ignore[arg-type]
        results.append(DetectResult(filename=name, width=where.width, height=where.height, detections=detections))
        answer.predictions[i] = None  # an image's boxes let go as they are turned, not all at once at the end
    if sum(answer.detections or []) <= ENCODED_HERE:
        return DetectResponse(model=answer.slot.name, version=answer.version, results=results)
    return Stream(_pieces(answer.slot.name, answer.version, results), media_type=MediaType.JSON)


def _pieces(model: str, version: int, results: list[DetectResult]) -> list[bytes]:
    """A :class:`DetectResponse`'s JSON as pieces, one a result, each result let go once encoded: no call of this
    holds the interpreter for more than one image's worth (one encoding of half a million boxes held it 130 ms, and
    joining 45 MB of pieces 60 ms, so every request on the event loop waited that long)."""
    head = msgspec.json.encode(DetectResponse(model=model, version=version, results=[]))
    assert head.endswith(b"[]}"), head  # results is the last field
    pieces = [head[:-2]]
    first = True
    while results:
        pieces.append((b"" if first else b",") + msgspec.json.encode(results.pop(0)))
        first = False
    pieces.append(head[-2:])
    return pieces


# Past this many boxes in one answer, the route encodes its JSON itself, in pieces, in the worker thread the request
# path gives a heavy answer (request.OFF_LOOP_VALUES), rather than leaving it to litestar on the event loop.
ENCODED_HERE = 10_000
