"""The Open Inference Protocol (KServe v2) over HTTP as Triton speaks it, so tritonclient and KServe tooling work
unchanged: what it takes and answers is the README's "Open Inference Protocol"; what gRPC shares is in
:mod:`service.frontend.protocol`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.params import FromPath, PathParameter

from service.core.errors import BadInputError
from service.core.parameters import flag, integer, json_number_error, request_options
from service.core.tasks import Want
from service.frontend import protocol
from service.frontend import request as path
from service.frontend.http.body import MIN_COMPRESS_BYTES, accepted_encoding, compress, read_body
from service.frontend.http.image_api import ERROR_RESPONSES, server_of, timing_of
from service.frontend.protocol import EXTENSIONS, SERVER_NAME, SERVER_VERSION, Tensor
from service.frontend.state import ServerState

HEADER = "inference-header-content-length"


class V2Input(msgspec.Struct):
    name: str
    shape: list[int]
    datatype: str
    parameters: dict[str, Any] | None = None
    data: Any = None


class V2Output(msgspec.Struct):
    name: str
    parameters: dict[str, Any] | None = None


class V2Request(msgspec.Struct):
    inputs: list[V2Input]
    id: str | None = None
    parameters: dict[str, Any] | None = None
    outputs: list[V2Output] | None = None


_decoder = msgspec.json.Decoder(V2Request)


class V2Response(msgspec.Struct, omit_defaults=True):
    """The JSON part of an inference answer (binary outputs follow it, per Inference-Header-Content-Length)."""

    model_name: str
    model_version: str
    outputs: list[dict[str, Any]]
    id: str | None = None


class Live(msgspec.Struct):
    live: bool


class Ready(msgspec.Struct):
    ready: bool


class ModelReady(msgspec.Struct):
    name: str
    ready: bool


HEALTH_RESPONSES = {
    **ERROR_RESPONSES,
    # Not one schema: false ({"ready": false}) or a bad request ({"error": ...}, e.g. a version that is no number).
    400: ResponseSpec(data_container=None, description='false ({"ready": false}), or a bad request ({"error": ...})'),
}


# The Open Inference Protocol: "a 200 status code indicates true and a 4xx status code indicates false", and the
# body says it too. Triton's clients read only the status; KServe's own Python client (0.21) parses the body and
# failed on an empty one.
def _status(ok: bool) -> int:
    return 200 if ok else 400


# Every v2 route's tag and error answers, declared once.
v2_get = partial(get, tags=["v2"], responses=ERROR_RESPONSES)
health_get = partial(get, tags=["v2"], responses=HEALTH_RESPONSES)


@health_get("/v2/health/live", summary="Liveness (200 true, 400 false)")
async def live() -> Response[Live]:
    return Response(Live(live=True))


@health_get(
    "/v2/health/ready",
    summary="Readiness (200 true, 400 false: while loading, until every front end is up, and while draining)",
)
async def ready(request: Request[Any, Any, Any]) -> Response[Ready]:
    ok = protocol.server_ready(server_of(request))
    return Response(Ready(ready=ok), status_code=_status(ok))


@v2_get("/v2", summary="Server metadata")
async def server_metadata() -> dict[str, Any]:
    return {"name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS}


MODEL = "/v2/models/{model:str}"
# Path parameters declared as such (litestar deprecates inferring them); a version, or a model for the statistics
# of all, is absent from some of a handler's paths.
Model = FromPath[str]
OptionalModel = Annotated[str | None, PathParameter()]
Version = Annotated[str | None, PathParameter()]
VERSION = "/v2/models/{model:str}/versions/{version:str}"


@v2_get([MODEL, VERSION], summary="Model metadata, with its device and fallback state")
async def model_metadata(request: Request[Any, Any, Any], model: Model, version: Version = None) -> dict[str, Any]:
    server = server_of(request)
    return protocol.metadata(server, protocol.resolve(server, model, version))


@health_get([MODEL + "/ready", VERSION + "/ready"], summary="Model readiness (200 true, 400 false, 404 unknown)")
async def model_ready(request: Request[Any, Any, Any], model: Model, version: Version = None) -> Response[ModelReady]:
    server = server_of(request)
    ok = protocol.is_ready(server, protocol.resolve(server, model, version).slot)
    return Response(ModelReady(name=model, ready=ok), status_code=_status(ok))


@v2_get([MODEL + "/config", VERSION + "/config"], summary="Model configuration")
async def model_config(request: Request[Any, Any, Any], model: Model, version: Version = None) -> dict[str, Any]:
    return protocol.model_config(protocol.resolve(server_of(request), model, version))


@v2_get(["/v2/models/stats", MODEL + "/stats", VERSION + "/stats"], summary="Statistics")
async def model_stats(
    request: Request[Any, Any, Any], model: OptionalModel = None, version: Version = None
) -> dict[str, Any]:
    return {"model_stats": await protocol.model_statistics(server_of(request), model, version)}


def parse_infer(
    body: bytes, header_length: str | None, raw: Callable[[bytes], Tensor] | None = None
) -> tuple[V2Request, list[Tensor]]:
    """An inference request's JSON and its inputs, from the (decompressed) body and the value of its
    ``Inference-Header-Content-Length`` header (None: JSON only). A header of 0 is Triton's raw binary request: no
    JSON, the body is the one input ``raw(body)`` builds, and the outputs are answered binary (as Triton answers
    them). Refuses with :class:`BadInputError`."""
    n = _header_length(header_length, len(body))
    if n == 0:
        if raw is None:
            raise BadInputError(
                "a raw binary request (Inference-Header-Content-Length: 0) needs a model to name its input"
            )
        return V2Request(inputs=[], parameters={"binary_data_output": True}), [raw(body)]
    req = _decode(body[:n] if n is not None else body)
    return req, _tensors(req, body[n:] if n is not None else b"")


def _header_length(header: str | None, size: int) -> int | None:
    if header is None:
        return None
    text = header.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > len(str(size)) or int(text) > size:
        raise BadInputError(
            f"Inference-Header-Content-Length must be an integer from 0 to {size} (the body's length), got {header!r}"
        )
    return int(text)


def _decode(json_part: bytes) -> V2Request:
    try:
        return _decoder.decode(json_part)
    except msgspec.ValidationError as exc:
        raise BadInputError(
            json_number_error(json_part) or f"inference request does not follow the v2 protocol: {exc}"
        ) from exc
    except msgspec.DecodeError as exc:
        raise BadInputError(json_number_error(json_part) or f"inference request is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:  # msgspec 0.22 raises this, not DecodeError, for a string that is not UTF-8
        raise BadInputError(f"inference request is not valid JSON: a string is not UTF-8 ({exc.reason})") from exc


def _tensors(req: V2Request, binary: bytes) -> list[Tensor]:
    """Each input with its data: a slice of the binary part (``binary_data_size``) or its JSON ``data``."""
    tensors, offset = [], 0
    for i, tensor in enumerate(req.inputs):
        params = tensor.parameters or {}
        size = params.get("binary_data_size")
        payload: bytes | list[Any]
        if size is None:
            if tensor.data is None:
                raise BadInputError(f"input {tensor.name} has neither data nor binary_data_size")
            payload = tensor.data if isinstance(tensor.data, list) else [tensor.data]
            if tensor.datatype == "BYTES" and payload and all(isinstance(x, list) for x in payload):
                payload = [x for row in payload for x in row]  # nested JSON ([N, 1]) flattened, row-major
        else:
            left = len(binary) - offset
            allowed = f"an integer from 0 to {left} (the bytes left in the body for input {tensor.name})"
            size = integer(f"inputs[{i}].parameters.binary_data_size", size, 0, allowed, left)
            payload, offset = binary[offset : offset + size], offset + size
        tensors.append(Tensor(tensor.name, tensor.datatype, list(tensor.shape), payload, params))
    return tensors


@post([MODEL + "/infer", VERSION + "/infer"], summary="Inference (JSON or binary tensor data)", status_code=200,
      tags=["v2"], responses=ERROR_RESPONSES)  # fmt: skip
async def infer(request: Request[Any, Any, Any], model: Model, version: Version = None) -> Response[V2Response]:
    server = server_of(request)
    where = path.target(server, model, version, request.headers)
    parse = partial(_parse, request, server)
    return await path.answer(where, timing_of(request), parse, partial(_encode, accepted_encoding(request)))


async def _parse(request: Request[Any, Any, Any], server: ServerState, where: path.Target) -> path.Ask:
    """Every parameter is checked before any work (the outputs' too): a refusal costs no inference."""
    body = await read_body(request, server.settings.max_body_bytes)
    req, inputs = parse_infer(body, request.headers.get(HEADER), protocol.raw_input(where))
    params = req.parameters or {}
    priority, timeout_ms = request_options(params)
    binary = flag("parameters.binary_data_output", params.get("binary_data_output"))
    outputs = [(o.name, o.parameters or {}) for o in req.outputs or []]
    task = where.slot.task
    want = Want(task.wanted(outputs, binary), task.options(params, where="parameters.", v2=True))
    return protocol.ask_of(server, where.slot, inputs, want, priority=priority, timeout_ms=timeout_ms, id=req.id)


def _encode(encoding: str | None, answer: path.Answer) -> Response[Any]:
    """The answer's JSON, then the binary part of the outputs asked for binary (Inference-Header-Content-Length)."""
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for out, tensor in zip(answer.ask.want.outputs, answer.tensors, strict=True):
        entry: dict[str, Any] = {"name": tensor.name, "datatype": tensor.datatype, "shape": tensor.shape}
        if out.binary:
            blob = tensor.raw()
            entry["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            entry["data"] = tensor.values()
        outputs.append(entry)
    body: dict[str, Any] = {"model_name": answer.slot.name, "model_version": str(answer.version), "outputs": outputs}
    if answer.ask.id is not None:
        body["id"] = answer.ask.id
    header = msgspec.json.encode(body)
    headers: dict[str, str] = {}
    if blobs:
        headers["Inference-Header-Content-Length"] = str(len(header))  # the uncompressed JSON's length
    content = header + b"".join(blobs)
    if encoding is not None and len(content) >= MIN_COMPRESS_BYTES:
        content = compress(content, encoding)
        headers["Content-Encoding"] = encoding
        headers["Vary"] = "Accept-Encoding"
    media_type = "application/octet-stream" if blobs else "application/json"
    return Response(content, media_type=media_type, headers=headers)


ROUTES = [live, ready, server_metadata, model_metadata, model_ready, model_config, model_stats, infer]
