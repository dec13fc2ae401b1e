"""The Open Inference Protocol (KServe v2) as Triton speaks it, so tritonclient and KServe tooling work unchanged.

Inputs: ``IMAGE`` (BYTES ``[N]``: encoded image files, decoded by the server; in JSON, base64 strings) or
``INPUT`` (UINT8 or FP32 ``[N, C, H, W]`` pixel values, already preprocessed). Output ``LOGITS`` (FP32
``[N, classes]``), or with ``"classification": k`` the "score:index:label" strings of the k best. JSON data and the
binary tensor extension (``Inference-Header-Content-Length``) both work; request parameters ``timeout``
(microseconds) and ``priority`` are honoured.
"""

from __future__ import annotations

import base64
import binascii
import struct
import time
from typing import Any

import msgspec
import numpy as np
from litestar import Request, Response, get, post

from service.errors import BadInputError, NotFoundError, PayloadTooLargeError, VisionServeError
from service.http.image_api import ERROR_RESPONSES, server_of, timing_of
from service.http.results import classification_strings
from service.http.state import ModelSlot, ServerState, Timing

SERVER_VERSION = "0.1.0"
EXTENSIONS = ["classification", "binary_tensor_data", "model_repository", "statistics", "parameters"]
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


class Readiness(msgspec.Struct, omit_defaults=True):
    ready: bool
    name: str | None = None
    state: str | None = None


class V2Response(msgspec.Struct, omit_defaults=True):
    """The JSON part of an inference answer (binary outputs follow it, per Inference-Header-Content-Length)."""

    model_name: str
    model_version: str
    outputs: list[dict[str, Any]]
    id: str | None = None


# ---- health and metadata -------------------------------------------------------------------------------------


@get("/v2/health/live", summary="Liveness", tags=["v2"], responses=ERROR_RESPONSES)
async def live() -> dict[str, bool]:
    return {"live": True}


@get(
    "/v2/health/ready",
    summary="Readiness (false while loading and while draining)",
    tags=["v2"],
    responses=ERROR_RESPONSES,
)
async def ready(request: Request[Any, Any, Any]) -> Response[Readiness]:
    server = server_of(request)
    ok = server.ready and not server.draining
    return Response(Readiness(ready=ok), status_code=200 if ok else 503)


@get("/v2", summary="Server metadata", tags=["v2"], responses=ERROR_RESPONSES)
async def server_metadata() -> dict[str, Any]:
    return {"name": "visionserve", "version": SERVER_VERSION, "extensions": EXTENSIONS}


def _platform(slot: ModelSlot) -> str:
    return "onnxruntime_onnx" if slot.engine.backend == "onnxruntime" else "pytorch_libtorch"


def _metadata(server: ServerState, slot: ModelSlot) -> dict[str, Any]:
    spec = slot.spec
    shape = [-1, spec.input.channels, spec.input.height, spec.input.width]
    return {
        "name": slot.name,
        "versions": [str(v) for v in sorted(server.slots[slot.name])],
        "platform": _platform(slot),
        "inputs": [
            {"name": "IMAGE", "datatype": "BYTES", "shape": [-1]},
            {"name": "INPUT", "datatype": "UINT8", "shape": shape},
        ],
        "outputs": [{"name": "LOGITS", "datatype": "FP32", "shape": [-1, spec.num_classes]}],
        "parameters": {"state": msgspec.to_builtins(slot.engine.state()), "labels": len(spec.labels)},
    }


MODEL = "/v2/models/{model:str}"
VERSION = "/v2/models/{model:str}/versions/{version:str}"


@get(
    [MODEL, VERSION],
    summary="Model metadata, with its device and fallback state",
    tags=["v2"],
    responses=ERROR_RESPONSES,
)
async def model_metadata(request: Request[Any, Any, Any], model: str, version: str | None = None) -> dict[str, Any]:
    server = server_of(request)
    return _metadata(server, server.slot(model, version))


@get([MODEL + "/ready", VERSION + "/ready"], summary="Model readiness", tags=["v2"], responses=ERROR_RESPONSES)
async def model_ready(request: Request[Any, Any, Any], model: str, version: str | None = None) -> Response[Readiness]:
    server = server_of(request)
    slot = server.slot(model, version)
    state = slot.engine.state()
    ok = state.state != "FAILED" and not server.draining
    return Response(Readiness(ready=ok, name=slot.name, state=state.state), status_code=200 if ok else 503)


@get([MODEL + "/config", VERSION + "/config"], summary="Model configuration", tags=["v2"], responses=ERROR_RESPONSES)
async def model_config(request: Request[Any, Any, Any], model: str, version: str | None = None) -> dict[str, Any]:
    slot = server_of(request).slot(model, version)
    config = slot.config
    spec = slot.spec
    dims = [spec.input.channels, spec.input.height, spec.input.width]
    return {
        "name": slot.name,
        "platform": _platform(slot),
        "max_batch_size": config.max_batch_size,
        "input": [{"name": "INPUT", "data_type": "TYPE_UINT8", "dims": dims}],
        "output": [{"name": "LOGITS", "data_type": "TYPE_FP32", "dims": [spec.num_classes]}],
        "dynamic_batching": {
            "preferred_batch_size": list(config.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(config.max_queue_delay_ms * 1000),
            "default_queue_policy": {
                "max_queue_size": config.max_queue_size,
                "default_timeout_microseconds": int(config.default_timeout_ms * 1000),
            },
        },
        "instance_group": [
            {"count": config.instances, "kind": "KIND_GPU" if d.startswith("cuda") else "KIND_CPU", "device": d}
            for d in slot.engine.state().devices
        ],
        "visionserve": msgspec.to_builtins(config),
    }


def _stats(slot: ModelSlot) -> dict[str, Any]:
    s = slot.stats
    batcher = slot.engine.batcher
    return {
        "name": slot.name,
        "version": str(slot.version.version),
        "last_inference": s.last_inference_ms,
        "inference_count": s.images,
        "execution_count": batcher.batches,
        "inference_stats": {
            "success": {"count": s.success, "ns": s.queue_ns + s.compute_ns + s.preprocess_ns},
            "fail": {"count": s.failure, "ns": 0},
            "queue": {"count": s.success, "ns": s.queue_ns},
            "compute_input": {"count": s.success, "ns": s.preprocess_ns},
            "compute_infer": {"count": s.success, "ns": s.compute_ns},
            "compute_output": {"count": s.success, "ns": 0},
        },
        "batch_stats": [
            {"batch_size": size, "compute_infer": {"count": count, "ns": batcher.size_compute_ns.get(size, 0)}}
            for size, count in sorted(batcher.size_counts.items())
        ],
    }


@get(
    ["/v2/models/stats", MODEL + "/stats", VERSION + "/stats"],
    summary="Statistics",
    tags=["v2"],
    responses=ERROR_RESPONSES,
)
async def model_stats(
    request: Request[Any, Any, Any], model: str | None = None, version: str | None = None
) -> dict[str, Any]:
    server = server_of(request)
    if model is None:
        slots = [slot for versions in server.slots.values() for slot in versions.values()]
    else:
        slots = [server.slot(model, version)] if version else list(server.slots.get(model, {}).values())
        if not slots:
            raise NotFoundError(f"unknown model {model!r}")
    return {"model_stats": [_stats(slot) for slot in slots]}


# ---- inference --------------------------------------------------------------------------------------------------


def _split_body(request: Request[Any, Any, Any], body: bytes) -> tuple[V2Request, bytes]:
    header = request.headers.get(HEADER)
    json_part, binary = body, b""
    if header is not None:
        try:
            n = int(header)
        except ValueError:
            raise BadInputError(f"Inference-Header-Content-Length must be an integer, got {header!r}") from None
        if not 0 < n <= len(body):
            raise BadInputError(f"Inference-Header-Content-Length {n} does not fit a body of {len(body)} bytes")
        json_part, binary = body[:n], body[n:]
    try:
        return _decoder.decode(json_part), binary
    except msgspec.ValidationError as exc:
        raise BadInputError(f"inference request does not follow the v2 protocol: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadInputError(f"inference request is not valid JSON: {exc}") from exc


def _bytes_elements(raw: bytes, count: int) -> list[bytes]:
    """BYTES in the binary extension: each element is a 4-byte little-endian length, then the bytes."""
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise BadInputError("BYTES tensor data ends inside an element's length prefix")
        (n,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise BadInputError("BYTES tensor data ends inside an element")
        out.append(raw[pos : pos + n])
        pos += n
    if len(out) != count:
        raise BadInputError(f"BYTES tensor holds {len(out)} elements, but its shape says {count}")
    return out


def _input_data(tensor: V2Input, binary: bytes, offset: int) -> tuple[Any, int]:
    size = (tensor.parameters or {}).get("binary_data_size")
    if size is None:
        if tensor.data is None:
            raise BadInputError(f"input {tensor.name} has neither data nor binary_data_size")
        return tensor.data, offset
    if not isinstance(size, int) or size < 0 or offset + size > len(binary):
        raise BadInputError(f"input {tensor.name}: binary_data_size {size} runs past the body")
    return binary[offset : offset + size], offset + size


def _images_from(tensor: V2Input, payload: Any) -> list[bytes]:
    if tensor.datatype != "BYTES" or len(tensor.shape) != 1:
        raise BadInputError(f"input IMAGE must be BYTES with shape [N], got {tensor.datatype} {tensor.shape}")
    count = tensor.shape[0]
    if isinstance(payload, bytes):
        return _bytes_elements(payload, count)
    if not isinstance(payload, list) or len(payload) != count:
        raise BadInputError(f"input IMAGE data must be a list of {count} base64 strings")
    try:
        return [base64.b64decode(item, validate=True) for item in payload]
    except (binascii.Error, TypeError, ValueError) as exc:
        raise BadInputError(f"input IMAGE data in JSON must be base64 strings: {exc}") from exc


def _pixels_from(tensor: V2Input, payload: Any, slot: ModelSlot) -> np.ndarray:
    spec = slot.spec
    expected = [spec.input.channels, spec.input.height, spec.input.width]
    if tensor.datatype not in ("UINT8", "FP32") or len(tensor.shape) != 4 or tensor.shape[1:] != expected:
        raise BadInputError(
            f"input INPUT must be UINT8 or FP32 with shape [N, {', '.join(map(str, expected))}], "
            f"got {tensor.datatype} {tensor.shape}"
        )
    dtype = np.uint8 if tensor.datatype == "UINT8" else np.float32
    try:
        if isinstance(payload, bytes):
            array = np.frombuffer(payload, dtype=dtype).reshape(tensor.shape)
        else:
            array = np.asarray(payload, dtype=dtype).reshape(tensor.shape)
    except (ValueError, TypeError) as exc:
        raise BadInputError(f"input INPUT data does not fit shape {tensor.shape}: {exc}") from exc
    if dtype == np.float32:
        if not np.isfinite(array).all() or array.min() < 0 or array.max() > 255:
            raise BadInputError("FP32 INPUT holds pixel values, which must be finite and within 0..255")
        array = np.rint(array).astype(np.uint8)
    if array.shape[0] < 1:
        raise BadInputError("INPUT holds no images")
    return array


def _bytes_tensor(elements: list[str]) -> bytes:
    return b"".join(struct.pack("<I", len(e.encode())) + e.encode() for e in elements)


async def _infer(request: Request[Any, Any, Any], model: str, version: str | None) -> Response[Any]:
    server = server_of(request)
    slot = server.slot(model, version)
    timing = timing_of(request)
    with slot.observe(timing):
        return await _infer_on(request, server, slot, timing)


async def _infer_on(
    request: Request[Any, Any, Any], server: ServerState, slot: ModelSlot, timing: Timing
) -> Response[Any]:
    req, binary = _split_body(request, await request.body())
    if len(req.inputs) != 1:
        raise BadInputError(f"send exactly one input, IMAGE or INPUT; got {[i.name for i in req.inputs]}")
    tensor = req.inputs[0]
    payload, _ = _input_data(tensor, binary, 0)
    if tensor.name == "IMAGE":
        files = _images_from(tensor, payload)
        if not files:
            raise BadInputError("input IMAGE holds no images")
        if len(files) > server.settings.max_images_per_request:
            raise PayloadTooLargeError(
                f"{len(files)} images in one request, over the limit of {server.settings.max_images_per_request}"
            )
        decoded = await slot.decode(files, timing)
        for i, item in enumerate(decoded):
            if isinstance(item, VisionServeError):
                raise type(item)(f"image {i}: {item}")
        batch = np.stack(decoded)  # type: ignore[arg-type]
    elif tensor.name == "INPUT":
        batch = _pixels_from(tensor, payload, slot)
    else:
        raise BadInputError(f"unknown input {tensor.name!r}: this model takes IMAGE (BYTES) or INPUT (UINT8/FP32)")
    params = req.parameters or {}
    timeout_us = params.get("timeout")
    priority = params.get("priority", 0)
    if timeout_us is not None and (not isinstance(timeout_us, int | float) or timeout_us < 0):
        raise BadInputError(f"parameters.timeout must be microseconds >= 0, got {timeout_us!r}")
    if not isinstance(priority, int) or priority < 0:
        raise BadInputError(f"parameters.priority must be an integer >= 0, got {priority!r}")
    result = await slot.infer(
        batch, timing, priority=priority, timeout_ms=(timeout_us / 1000.0) if timeout_us else None
    )
    for i, error in enumerate(result.errors):
        if error is not None:
            raise type(error)(f"image {i}: {error}")
    started = time.perf_counter()
    response = _encode_outputs(req, slot, result.logits)
    timing.postprocess_s += time.perf_counter() - started
    return response


def _encode_outputs(req: V2Request, slot: ModelSlot, logits: np.ndarray) -> Response[Any]:
    wanted = req.outputs or [V2Output(name="LOGITS")]
    all_binary = bool((req.parameters or {}).get("binary_data_output", False))
    outputs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for out in wanted:
        if out.name != "LOGITS":
            raise BadInputError(f"unknown output {out.name!r}: this model has LOGITS")
        params = out.parameters or {}
        binary = bool(params.get("binary_data", all_binary))
        k = params.get("classification")
        if k is not None:
            if not isinstance(k, int) or k < 1:
                raise BadInputError(f"classification must be an integer >= 1, got {k!r}")
            k = min(k, slot.spec.num_classes)
            strings = classification_strings(logits, slot.spec.labels, k)
            entry: dict[str, Any] = {"name": "LOGITS", "datatype": "BYTES", "shape": [len(strings), k]}
            flat = [s for row in strings for s in row]
            if binary:
                blob = _bytes_tensor(flat)
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                entry["data"] = flat
        else:
            entry = {"name": "LOGITS", "datatype": "FP32", "shape": list(logits.shape)}
            if binary:
                blob = np.ascontiguousarray(logits, dtype="<f4").tobytes()
                entry["parameters"] = {"binary_data_size": len(blob)}
                blobs.append(blob)
            else:
                entry["data"] = logits.ravel().tolist()
        outputs.append(entry)
    body: dict[str, Any] = {"model_name": slot.name, "model_version": str(slot.version.version), "outputs": outputs}
    if req.id is not None:
        body["id"] = req.id
    header = msgspec.json.encode(body)
    if not blobs:
        return Response(header, media_type="application/json")
    return Response(
        header + b"".join(blobs),
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(len(header))},
    )


@post([MODEL + "/infer", VERSION + "/infer"], summary="Inference (JSON or binary tensor data)", status_code=200,
      tags=["v2"], responses=ERROR_RESPONSES)  # fmt: skip
async def infer(request: Request[Any, Any, Any], model: str, version: str | None = None) -> Response[V2Response]:
    return await _infer(request, model, version)


# ---- repository (admin) -----------------------------------------------------------------------------------------


def _require_admin(request: Request[Any, Any, Any]) -> ServerState:
    server = server_of(request)
    token = server.settings.admin_token
    if not token:
        raise _Forbidden("repository control is off: start the server with --admin-token to enable it")
    sent = request.headers.get("authorization", "")
    if sent != f"Bearer {token}":
        raise _Forbidden("repository control needs 'Authorization: Bearer <admin token>'")
    return server


class _Forbidden(VisionServeError):
    status = 403


@post(
    "/v2/repository/index",
    summary="Repository index (admin)",
    status_code=200,
    tags=["v2 repository"],
    responses=ERROR_RESPONSES,
)
async def repository_index(request: Request[Any, Any, Any]) -> list[dict[str, Any]]:
    server = _require_admin(request)
    rows: list[dict[str, Any]] = []
    for name, versions in sorted(server.slots.items()):
        rows += [{"name": name, "version": str(v), "state": "READY"} for v in sorted(versions)]
    for name, reason in sorted(server.errors.items()):
        model, _, number = name.partition("/")
        rows.append({"name": model, "version": number, "state": "UNAVAILABLE", "reason": reason})
    return rows


@post("/v2/repository/models/{model:str}/load", summary="Load or reload a model (admin)", status_code=200,
      tags=["v2 repository"], responses=ERROR_RESPONSES)  # fmt: skip
async def repository_load(request: Request[Any, Any, Any], model: str) -> dict[str, str]:
    server = _require_admin(request)
    await server.load_model(model)
    return {"name": model, "state": "READY"}


@post("/v2/repository/models/{model:str}/unload", summary="Unload a model (admin)", status_code=200,
      tags=["v2 repository"], responses=ERROR_RESPONSES)  # fmt: skip
async def repository_unload(request: Request[Any, Any, Any], model: str) -> dict[str, str]:
    server = _require_admin(request)
    await server.unload_model(model)
    return {"name": model, "state": "UNAVAILABLE"}


ROUTES = [
    live, ready, server_metadata, model_metadata, model_ready, model_config, model_stats, infer,
    repository_index, repository_load, repository_unload,
]  # fmt: skip
