"""The Open Inference Protocol (KServe v2, as Triton speaks it) apart from its wire: what HTTP and gRPC share, so both
answer alike, with the same error messages, by construction. Both turn a request into :class:`Tensor` records and
those into one request (:func:`ask_of`) for the one path (:mod:`service.frontend.request`); both describe a model
with :func:`metadata` and :func:`model_config` (Triton's ``ModelConfig`` in its JSON form, which gRPC parses into
the protobuf). The rules tools rely on (one input per name: ``m`` lists ``INPUT``, ``m.image`` lists ``IMAGE``;
BYTES in JSON; ``max_batch_size``) are the README's "v2 rules existing tools rely on".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import logging
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
import numpy as np

from service.core.errors import BadInputError, ForbiddenError, NotFoundError, PayloadTooLargeError
from service.core.parameters import version_number
from service.core.status import SERVING_STATES
from service.core.tasks import Want, fields
from service.frontend.request import IMAGE, IMAGE_SUFFIX, TENSOR, Ask, Named
from service.frontend.request import resolve as resolve  # the path resolves; metadata and readiness too
from service.frontend.state import ModelSlot, ServerState

log = logging.getLogger("visionserve.protocol")

SERVER_NAME = "visionserve"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["classification", "binary_tensor_data", "model_repository", "statistics", "parameters"]
BASE64_MARK = ("content_type", "base64")
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "aoti": "torch_aoti"}
# The engine's state fields that model metadata lists as they are (its ``parameters``, in this order).
_STATE_PARAMETERS = ("precision", "ungated", "fallbacks", "replaced", "residency", "resident", "resident_bytes")


@dataclass
class Tensor:
    """One input as a protocol carried it: raw bytes (binary extension, ``raw_input_contents``) or a list of
    elements (JSON ``data``, gRPC typed contents)."""

    name: str
    datatype: str
    shape: list[int]
    payload: bytes | list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)


def server_ready(server: ServerState) -> bool:
    """The whole server can serve and is not draining: what every protocol's server readiness answers."""
    return server.ready and not server.draining


def is_ready(server: ServerState, slot: ModelSlot) -> bool:
    """Ready while its engine serves (DEGRADED does, from the fallback) and the server is not draining."""
    return slot.engine.state in SERVING_STATES and not server.draining


def platform(slot: ModelSlot) -> str:
    return _PLATFORMS.get(slot.engine.backend, slot.engine.backend)


def metadata(server: ServerState, named: Named) -> dict[str, Any]:
    """Model metadata (the v2 JSON form): exactly one input, the one this name stands for, and the engine's state
    as scalar ``parameters``, as the v2 spec has them."""
    slot, state = named.slot, named.slot.engine
    if named.view == IMAGE:
        inputs = [{"name": IMAGE, "datatype": "BYTES", "shape": [-1]}]
    else:
        inputs = [{"name": TENSOR, "datatype": "UINT8", "shape": [-1, *_dims(slot)]}]
    parameters: dict[str, Any] = {"state": state.state, "state_reason": state.note or "", "backend": state.backend}
    parameters["devices"] = ",".join(state.devices)
    parameters |= {k: getattr(state, k) for k in _STATE_PARAMETERS}
    parameters |= {"why_not_resident": state.why_not_resident or "", "labels": len(slot.spec.labels)}
    return {
        "name": named.name,
        "versions": [str(v) for v in sorted(server.slots[slot.name])],
        "platform": platform(slot),
        "inputs": inputs,
        "outputs": [{"name": o.name, "datatype": o.datatype, "shape": [-1, *o.dims]} for o in slot.task.outputs()],
        "parameters": parameters,
    }


def _dims(slot: ModelSlot) -> list[int]:
    spec = slot.spec
    return [spec.input.channels, spec.input.height, spec.input.width]


def model_config(named: Named) -> dict[str, Any]:
    """Triton's ModelConfig in its JSON form (gRPC parses the same dict into the protobuf), plus ``visionserve``:
    our own settings, which Triton's schema has no place for."""
    slot, config = named.slot, named.slot.config
    if named.view == IMAGE:
        # Triton's way to say "one BYTES element per batch item": dims [1] reshaped to [], so the shape is [N].
        tensor = {"name": IMAGE, "data_type": "TYPE_STRING", "dims": [1], "reshape": {"shape": []}}
    else:
        tensor = {"name": TENSOR, "data_type": "TYPE_UINT8", "dims": _dims(slot)}
    return {
        "name": named.name,
        "platform": platform(slot),
        "backend": slot.engine.backend,
        "max_batch_size": config.max_batch_size,
        "input": [tensor],
        "output": [{"name": o.name, "data_type": f"TYPE_{o.datatype}", "dims": o.dims} for o in slot.task.outputs()],
        # The request parameters the model's task takes, each described (Triton's config has a place for them).
        "parameters": {f.name: {"string_value": f.described} for f in fields(slot.task.Options) if f.v2},
        "dynamic_batching": {
            "preferred_batch_size": list(config.preferred_batch_sizes),
            "max_queue_delay_microseconds": int(config.max_queue_delay_ms * 1000),
            "default_queue_policy": {
                "max_queue_size": config.max_queue_size,
                "default_timeout_microseconds": int(config.default_timeout_ms * 1000),
            },
        },
        "instance_group": [
            {"name": d, "count": config.instances, "kind": "KIND_GPU" if d.startswith("cuda") else "KIND_CPU",
             **({"gpus": [int(d.partition(":")[2] or 0)]} if d.startswith("cuda") else {})}
            for d in slot.engine.devices
        ],
        "visionserve": msgspec.to_builtins(config),
    }  # fmt: skip


def raw_tensor(view: str, dims: list[int], body: bytes) -> Tensor:
    """Triton's raw binary request (``Inference-Header-Content-Length: 0``): the whole body is the data of the
    model's one input, batch 1: an encoded image file for ``IMAGE``; for ``INPUT`` (fixed dims ``[C, H, W]``) one
    image's UINT8 pixels, exactly C*H*W bytes, as Triton deduces no other shape for them."""
    if view == IMAGE:
        return Tensor(IMAGE, "BYTES", [1], [body])
    size = math.prod(dims)
    if len(body) != size:
        shape = ", ".join(map(str, [1, *dims]))
        raise BadInputError(
            f"a raw binary request (Inference-Header-Content-Length: 0) holds one image's UINT8 pixels, shape "
            f"[{shape}]: {size} bytes, got {len(body)}; send an encoded image file to the model's "
            f"{IMAGE_SUFFIX!r} name, or a JSON header for anything else"
        )
    return Tensor(TENSOR, "UINT8", [1, *dims], body)


def raw_input(named: Named) -> Callable[[bytes], Tensor]:
    """:func:`raw_tensor` for the input that ``named``'s metadata lists."""
    return partial(raw_tensor, named.view, _dims(named.slot))


def bytes_elements(raw: bytes, count: int) -> list[bytes]:
    """BYTES in binary form: each element is a 4-byte little-endian length, then the bytes."""
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


def _element(item: Any, marked: bool) -> bytes:
    if isinstance(item, bytes):  # gRPC bytes_contents: the bytes themselves
        return item
    if not isinstance(item, str):
        raise BadInputError(f"BYTES elements must be strings, got {type(item).__name__}")
    data = item.encode()
    if marked or _BASE64.fullmatch(data):
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as exc:
            if marked:
                raise BadInputError(f"input IMAGE is marked base64, but an element is not: {exc}") from exc
    return data


def images_from(tensor: Tensor) -> list[bytes]:
    """The encoded image files of an ``IMAGE`` input (BYTES ``[N]`` or ``[N, 1]``)."""
    shape = tensor.shape
    if tensor.datatype != "BYTES" or not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)):
        raise BadInputError(f"input IMAGE must be BYTES with shape [N], got {tensor.datatype} {shape}")
    count = shape[0]
    if isinstance(tensor.payload, bytes):
        return bytes_elements(tensor.payload, count)
    if len(tensor.payload) != count:
        raise BadInputError(f"input IMAGE holds {len(tensor.payload)} elements, but its shape says {count}")
    marked = str(tensor.parameters.get(BASE64_MARK[0], "")).lower() == BASE64_MARK[1]
    return [_element(item, marked) for item in tensor.payload]


def _json_hint(tensor: Tensor) -> str:
    """Why a JSON string did not decode: it was taken as the string itself (BYTES in JSON, the README's rule)."""
    if isinstance(tensor.payload, bytes) or not any(isinstance(x, str) for x in tensor.payload):
        return ""
    return (
        " (a BYTES element in JSON is the string itself, or base64 when the input's parameters say "
        '"content_type": "base64")'
    )


def pixels_from(tensor: Tensor, dims: list[int]) -> np.ndarray:
    """The uint8 ``[N, C, H, W]`` pixels of an ``INPUT`` tensor whose ``[C, H, W]`` must be ``dims``."""
    expected = dims
    if tensor.datatype not in ("UINT8", "FP32") or len(tensor.shape) != 4 or tensor.shape[1:] != expected:
        raise BadInputError(
            f"input INPUT must be UINT8 or FP32 with shape [N, {', '.join(map(str, expected))}], "
            f"got {tensor.datatype} {tensor.shape}"
        )
    if tensor.shape[0] < 1:  # checked first: numpy would read a -1 as "whatever fits the data"
        raise BadInputError(f"INPUT holds no images: its shape {tensor.shape} says N = {tensor.shape[0]}, not >= 1")
    try:
        if isinstance(tensor.payload, bytes):
            dtype = np.dtype(np.uint8 if tensor.datatype == "UINT8" else "<f4")
            array = np.frombuffer(tensor.payload, dtype=dtype).reshape(tensor.shape)
        else:
            # float64 holds every JSON number without wrapping it (numpy refuses 300 as uint8 with an
            # OverflowError, and casts 300.0 to 44); the range checks below refuse what is not a pixel value.
            array = np.asarray(tensor.payload, dtype=np.float64).reshape(tensor.shape)
    except (ValueError, TypeError, OverflowError) as exc:
        raise BadInputError(f"input INPUT data does not fit shape {tensor.shape}: {exc}") from exc
    if array.dtype == np.uint8:
        return array
    if not np.isfinite(array).all() or array.min() < 0 or array.max() > 255:
        raise BadInputError(f"{tensor.datatype} INPUT holds pixel values, which must be finite and within 0..255")
    if tensor.datatype == "UINT8":
        if (array != np.rint(array)).any():
            raise BadInputError("UINT8 INPUT holds pixel values, which must be integers within 0..255")
        return array.astype(np.uint8)
    return np.rint(array.astype(np.float32)).astype(np.uint8)


def _check_batch(slot: ModelSlot, count: int) -> None:
    limit = slot.config.max_batch_size
    if count > limit:
        raise BadInputError(
            f"a batch of {count} is over the max_batch_size of {limit} of model {slot.name!r}: send at most {limit} "
            "per v2 request (the image API splits larger requests)"
        )


def ask_of(server: ServerState, slot: ModelSlot, inputs: list[Tensor], want: Want, **options: Any) -> Ask:
    """The one request a v2 request's inputs make: exactly one input, IMAGE or INPUT, checked against the limits
    before any work; any image's error fails the request with that image's message. ``options``: the rest of the
    :class:`~service.frontend.request.Ask` (priority, timeout_ms, id)."""
    if len(inputs) != 1:
        raise BadInputError(f"send exactly one input, IMAGE or INPUT; got {[i.name for i in inputs]}")
    tensor = inputs[0]
    if tensor.name == IMAGE:
        files = images_from(tensor)
        if not files:
            raise BadInputError("input IMAGE holds no images")
        limit = server.settings.max_images_per_request
        if len(files) > limit:
            raise PayloadTooLargeError(f"{len(files)} images in one request, over the limit of {limit}")
        _check_batch(slot, len(files))
        return Ask(want, images=files, named=True, hint=_json_hint(tensor), **options)
    if tensor.name == TENSOR:
        pixels = pixels_from(tensor, _dims(slot))
        _check_batch(slot, pixels.shape[0])
        return Ask(want, pixels=pixels, named=True, **options)
    raise BadInputError(f"unknown input {tensor.name!r}: this model takes IMAGE (BYTES) or INPUT (UINT8/FP32)")


def _duration(count: int, ns: int = 0) -> dict[str, int]:
    return {"count": count, "ns": ns}


def _stats(slot: ModelSlot, row: dict[str, Any]) -> dict[str, Any]:
    """Triton's statistics JSON for one model version from the whole server's counts (``ServerState.model_stats``),
    with every key Triton's has (2.51): what this server does not do (a response cache, per-response statistics of
    decoupled models, memory reports) is there as zero or empty, so a tool that reads the key finds it."""
    success = row.get("success", 0)
    queue_ns, compute_ns, preprocess_ns = row.get("queue_ns", 0), row.get("compute_ns", 0), row.get("preprocess_ns", 0)
    sizes: dict[int, tuple[int, int]] = row.get("batch_sizes", {})
    return {
        "name": slot.name,
        "version": str(slot.version.version),
        "last_inference": row.get("last_inference_ms", 0),
        "inference_count": row.get("images", 0),
        "execution_count": row.get("batches", 0),
        "inference_stats": {
            "success": _duration(success, queue_ns + compute_ns + preprocess_ns),
            "fail": _duration(row.get("failure", 0)),
            "queue": _duration(success, queue_ns),
            "compute_input": _duration(success, preprocess_ns),
            "compute_infer": _duration(success, compute_ns),
            "compute_output": _duration(success),
            "cache_hit": _duration(0),
            "cache_miss": _duration(0),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(count),
                "compute_infer": _duration(count, ns),
                "compute_output": _duration(count),
            }
            for size, (count, ns) in sorted(sizes.items())
        ],
        "memory_usage": [],
        "response_stats": {},
    }


async def model_statistics(
    server: ServerState, model: str | None = None, version: str | None = None
) -> list[dict[str, Any]]:
    """The statistics of every model version (or of ``model``, or of one version), for HTTP and gRPC alike."""
    number = version_number(version)
    if model is None:
        slots = [slot for versions in server.slots.values() for slot in versions.values()]
    else:
        slots = [server.slot(model, number)] if number else list(server.slots.get(model, {}).values())
        if not slots:
            raise NotFoundError(f"unknown model {model!r}")
    merged = await server.model_stats()
    return [_stats(slot, merged.get((slot.name, slot.version.version), {})) for slot in slots]


async def repository_index(server: ServerState, ready: bool = False) -> list[dict[str, Any]]:
    """Every model in the repository with its state; with ``ready``, only the ones ready (Triton's ``ready`` flag
    on the index request, HTTP and gRPC alike)."""
    rows = await server.repository_index()
    return [row for row in rows if row.get("state") == "READY"] if ready else rows


async def unload(server: ServerState, name: str) -> None:
    """Unload ``name``. A name the repository does not hold is no error, as in Triton (a script that unloads what
    it may never have loaded stays idempotent); nothing was loaded, so nothing changes."""
    try:
        await server.unload_model(name)
    except NotFoundError:
        log.info("unload of %r, which the repository does not hold: nothing to do", name)


def require_admin(server: ServerState, authorization: str, *, what: str = "repository control", hint: str = "") -> None:
    """The one admin check of every protocol (HTTP's guards, gRPC's admin RPCs): off unless an admin token is
    configured, then ``Bearer <token>``, compared in constant time (:func:`hmac.compare_digest`), so the answer's
    timing does not spell the token out byte by byte. ``what`` names what was refused, ``hint`` where else the token
    may be given."""
    token = server.settings.admin_token
    if not token:
        raise ForbiddenError(f"{what} needs the admin token, and this server has none: start it with --admin-token")
    if not hmac.compare_digest(authorization.encode(), f"Bearer {token}".encode()):
        raise ForbiddenError(f"{what} needs 'Authorization: Bearer <admin token>'{hint}")


async def rollout(server: ServerState, name: str, *, action: str | None = None, **args: Any) -> dict[str, Any]:
    """A model's rollout document (docs/rollouts.md), after ``action`` (start, promote, abort) where one is given.
    Every engine serving the model is asked; this front end sees a change before it answers."""
    if name not in server.slots:
        server.slot(name)  # a 404 (or 503) worded as for any request
    answers = await server.each_engine(lambda link: link.rollout(name, action=action, **args))
    docs = [doc for doc in answers if doc is not None]
    if action is not None:
        await asyncio.gather(*(link.refresh() for link in server.links))
    if not docs:
        raise NotFoundError(f"unknown model {name!r}")
    return dict(docs[0])
