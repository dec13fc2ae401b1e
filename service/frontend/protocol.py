"""The Open Inference Protocol (KServe v2, as Triton speaks it) apart from its wire: what HTTP and gRPC share.

Both protocols turn a request into :class:`Tensor` records and call :func:`infer`; both describe a model with
:func:`metadata` and :func:`model_config` (Triton's ``ModelConfig`` in its JSON form, which gRPC parses into the
protobuf). So the two answer alike, with the same error messages, by construction.

**Two ways of sending images, two honest names.** A model ``m`` takes either ``INPUT`` (UINT8 or FP32
``[N, C, H, W]`` pixels, already preprocessed) or ``IMAGE`` (BYTES ``[N]``: encoded image files that the server
decodes). Metadata lists exactly one input per name, so a tool that fills every listed input (perf_analyzer, a
generic client) builds a valid request on its own:

- ``m`` lists ``INPUT``: the tensor form any tool can fill;
- ``m.image`` (:data:`IMAGE_SUFFIX`) lists ``IMAGE``: the same model version, engine and statistics.

Either name also accepts the other input, so clients written for either way keep working. A model folder that is
itself named ``m.image`` wins over the alias.

**BYTES in JSON**: an element is the string itself, as UTF-8 (what tritonclient sends with ``binary_data=False``);
with the input parameter ``"content_type": "base64"`` every element is base64 instead. For ``IMAGE`` an unmarked
element written wholly in the base64 alphabet is also read as base64, since no image file format can be (JPEG, PNG,
WebP and BMP headers all hold bytes outside it): earlier clients that sent base64 unmarked keep working.

**max_batch_size** means what Triton's does: a v2 request whose batch is larger is refused (400); only the image
API splits large requests across batches.
"""

from __future__ import annotations

import base64
import binascii
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from service.core.errors import BadInputError, PayloadTooLargeError, VisionServeError
from service.core.scores import classification_strings
from service.core.status import SERVING_STATES
from service.frontend.state import ModelSlot, ServerState, Timing

SERVER_NAME = "visionserve"
SERVER_VERSION = "0.1.0"
EXTENSIONS = ["classification", "binary_tensor_data", "model_repository", "statistics", "parameters"]
IMAGE_SUFFIX = ".image"
TENSOR, IMAGE = "INPUT", "IMAGE"
OUTPUT = "LOGITS"
BASE64_MARK = ("content_type", "base64")
_BASE64 = re.compile(rb"[A-Za-z0-9+/]*={0,2}")
_PLATFORMS = {"onnxruntime": "onnxruntime_onnx", "torchscript": "pytorch_libtorch", "aoti": "torch_aoti"}


@dataclass
class Tensor:
    """One input as a protocol carried it: raw bytes (binary extension, ``raw_input_contents``) or a list of
    elements (JSON ``data``, gRPC typed contents)."""

    name: str
    datatype: str
    shape: list[int]
    payload: bytes | list[Any]
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass
class Named:
    """A model version reached under one of its names; ``view`` is the input its metadata lists."""

    slot: ModelSlot
    name: str
    view: str


def resolve(server: ServerState, name: str, version: int | str | None = None) -> Named:
    """The slot behind ``name`` (``m`` or ``m.image``); NotFoundError / BadInputError as ``server.slot``."""
    if name.endswith(IMAGE_SUFFIX) and name not in server.slots and name[: -len(IMAGE_SUFFIX)] in server.slots:
        return Named(server.slot(name[: -len(IMAGE_SUFFIX)], version), name, IMAGE)
    return Named(server.slot(name, version), name, TENSOR)


def is_ready(server: ServerState, slot: ModelSlot) -> bool:
    """Ready while its engine serves (DEGRADED does, from the fallback) and the server is not draining."""
    return slot.engine.state().state in SERVING_STATES and not server.draining


def platform(slot: ModelSlot) -> str:
    return _PLATFORMS.get(slot.engine.backend, slot.engine.backend)


def metadata(server: ServerState, named: Named) -> dict[str, Any]:
    """Model metadata (the v2 JSON form): exactly one input, the one this name stands for."""
    slot, spec = named.slot, named.slot.spec
    if named.view == IMAGE:
        inputs = [{"name": IMAGE, "datatype": "BYTES", "shape": [-1]}]
    else:
        inputs = [{"name": TENSOR, "datatype": "UINT8", "shape": [-1, *_dims(slot)]}]
    return {
        "name": named.name,
        "versions": [str(v) for v in sorted(server.slots[slot.name])],
        "platform": platform(slot),
        "inputs": inputs,
        "outputs": [{"name": OUTPUT, "datatype": "FP32", "shape": [-1, spec.num_classes]}],
        "parameters": {"state": msgspec.to_builtins(slot.engine.state()), "labels": len(spec.labels)},
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
        "output": [{"name": OUTPUT, "data_type": "TYPE_FP32", "dims": [slot.spec.num_classes]}],
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
            for d in slot.engine.state().devices
        ],
        "visionserve": msgspec.to_builtins(config),
    }  # fmt: skip


# ---- requests ---------------------------------------------------------------------------------------------------


def request_options(params: dict[str, Any]) -> tuple[int, float | None]:
    """(priority, timeout_ms) from the request parameters ``priority`` and ``timeout`` (microseconds)."""
    timeout_us = params.get("timeout")
    priority = params.get("priority", 0)
    if timeout_us is not None and (isinstance(timeout_us, bool) or not isinstance(timeout_us, int | float)
                                   or timeout_us < 0):  # fmt: skip
        raise BadInputError(f"parameters.timeout must be microseconds >= 0, got {timeout_us!r}")
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise BadInputError(f"parameters.priority must be an integer >= 0, got {priority!r}")
    return priority, (timeout_us / 1000.0) if timeout_us else None


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


def bytes_tensor(elements: list[str]) -> bytes:
    """The binary form of a BYTES tensor of strings (see :func:`bytes_elements`)."""
    encoded = [e.encode() for e in elements]
    return b"".join(struct.pack("<I", len(e)) + e for e in encoded)


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
    """Why a JSON string did not decode: it was taken as the string itself (the rule in this module's docstring)."""
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


async def infer(
    server: ServerState,
    slot: ModelSlot,
    inputs: list[Tensor],
    timing: Timing,
    *,
    priority: int = 0,
    timeout_ms: float | None = None,
) -> np.ndarray:
    """Logits (float32 ``[N, classes]``) for exactly one input, IMAGE or INPUT; any image's error fails the request
    with that image's message."""
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
        decoded = await slot.decode(files, timing)
        for i, item in enumerate(decoded):
            if isinstance(item, VisionServeError):
                raise type(item)(f"image {i}: {item}{_json_hint(tensor)}")
        batch = np.stack(decoded)  # type: ignore[arg-type]
    elif tensor.name == TENSOR:
        batch = pixels_from(tensor, _dims(slot))
        _check_batch(slot, batch.shape[0])
    else:
        raise BadInputError(f"unknown input {tensor.name!r}: this model takes IMAGE (BYTES) or INPUT (UINT8/FP32)")
    result = await slot.infer(batch, timing, priority=priority, timeout_ms=timeout_ms)
    for i, error in enumerate(result.errors):
        if error is not None:
            raise type(error)(f"image {i}: {error}")
    return result.logits


def classification_k(value: Any, slot: ModelSlot) -> int:
    """The classification extension's k, checked and capped at the number of classes."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadInputError(f"classification must be an integer >= 1, got {value!r}")
    return min(value, slot.spec.num_classes)


def classify(logits: np.ndarray, slot: ModelSlot, k: int) -> list[str]:
    """The k best "score:index:label" strings per image, flattened row by row (shape ``[N, k]``)."""
    return [s for row in classification_strings(logits, slot.spec.labels, k) for s in row]


def check_output(name: str) -> None:
    if name != OUTPUT:
        raise BadInputError(f"unknown output {name!r}: this model has LOGITS")


# ---- repository -------------------------------------------------------------------------------------------------


class Forbidden(VisionServeError):
    """Repository control without the admin token (HTTP 403, gRPC PERMISSION_DENIED)."""

    status = 403


def require_admin(server: ServerState, authorization: str) -> None:
    """Repository control is off unless an admin token is configured, and then needs ``Bearer <token>``."""
    token = server.settings.admin_token
    if not token:
        raise Forbidden("repository control is off: start the server with --admin-token to enable it")
    if authorization != f"Bearer {token}":
        raise Forbidden("repository control needs 'Authorization: Bearer <admin token>'")
