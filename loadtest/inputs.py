"""What the load tester sends (README, "Load testing", inputs): the images turned, before any clock starts, into
ready request bodies for the image API, v2 infer or gRPC ModelInfer. For several models each gets the same bodies on
its own path (the bytes shared: a mix of many models costs the corpus once); each payload names its images, so that a
detector's answers can be checked against a reference (:mod:`loadtest.answers`)."""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from service.core.samples import IMAGE_SUFFIXES
from service.core.tasks import TASKS, fields, task_named

MEDIA = {b"\xff\xd8": "image/jpeg", b"\x89P": "image/png", b"RI": "image/webp", b"BM": "image/bmp"}
PROTOCOLS = ("image", "v2", "grpc")
# The options each request sends, where its task takes them: the lightest answer (one class) unless the command line
# says otherwise, since the load, not the answer's size, is what a load test measures.
Options = Mapping[str, Any]
LIGHTEST: Options = {"top_k": 1}
_GRPC_PARAM = {float: "double_param", int: "int64_param", bool: "bool_param", str: "string_param"}


def media_type(data: bytes) -> str:
    return MEDIA.get(data[:2], "application/octet-stream")


@dataclass(frozen=True)
class Payload:
    """One ready request: path, headers and body, how many images it carries and, where known, their names."""

    path: str
    headers: dict[str, str]
    body: bytes
    images: int
    names: tuple[str, ...] = ()


def named_images(folder: str | Path, suffixes: tuple[str, ...] = IMAGE_SUFFIXES) -> tuple[list[str], list[bytes]]:
    """The image files below ``folder``, in path order: their names relative to it (a reference's keys) and their
    bytes; ValueError if there are none."""
    root = Path(folder)
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in suffixes)
    if not files:
        raise ValueError(f"{folder} holds no images (looked for {', '.join(suffixes)})")
    return [p.relative_to(root).as_posix() for p in files], [p.read_bytes() for p in files]


def _multipart(images: list[bytes]) -> tuple[str, bytes]:
    boundary = uuid.uuid4().hex
    head = '--{}\r\nContent-Disposition: form-data; name="file"; filename="image{}"\r\nContent-Type: {}\r\n\r\n'
    parts = [head.format(boundary, i, media_type(data)).encode() + data + b"\r\n" for i, data in enumerate(images)]
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()


def model_path(protocol: str, model: str, task: str = "classify", options: Options = LIGHTEST) -> str:
    """The HTTP path a request for ``model`` goes to (``image`` or ``v2``; gRPC names its model in the body)."""
    if protocol == "image":
        query = urlencode(_given(task, options), doseq=True)
        return f"/v1/models/{model}/{task}" + (f"?{query}" if query else "")
    if protocol == "v2":
        return f"/v2/models/{model}/infer"
    raise ValueError(f"only the image and v2 protocols name the model in the path, not {protocol!r}")


def _given(task: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``options`` that ``task`` takes."""
    names = {f.name for f in fields(task_named(task).Options)}
    return {k: v for k, v in options.items() if k in names}


def _parameters(task: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Those of ``options`` that ``task`` takes as v2 request parameters (a list of classes as one string)."""
    taken = {f.name for f in fields(task_named(task).Options) if f.v2}
    return {k: ",".join(map(str, v)) if isinstance(v, list | tuple) else v for k, v in options.items() if k in taken}


def _outputs(task: str, options: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The v2 outputs ``options`` ask of ``task`` (a classifier's top_k: the classification extension's k best)."""
    kind, given = task_named(task), _given(task, options)
    return kind.named_outputs(kind.Options(**given), given)


def image_payload(model: str, images: list[bytes], task: str = "classify", options: Options = LIGHTEST) -> Payload:
    path = model_path("image", model, task, options)
    if len(images) == 1:
        return Payload(path, {"content-type": media_type(images[0])}, images[0], 1)
    ctype, body = _multipart(images)
    return Payload(path, {"content-type": ctype}, body, len(images))


def v2_payload(model: str, images: list[bytes], task: str = "classify", options: Options = LIGHTEST) -> Payload:
    """v2 infer: the ``IMAGE`` BYTES input in the binary extension, the options as request parameters; the outputs
    they ask for in JSON (a classifier's classification extension), or the task's default outputs in the binary
    extension."""
    blob = b"".join(struct.pack("<I", len(d)) + d for d in images)
    request: dict[str, object] = {
        "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [len(images)],
                    "parameters": {"binary_data_size": len(blob)}}],
    }  # fmt: skip
    named = _outputs(task, options)
    if named:
        request["outputs"] = [{"name": name, "parameters": {**params, "binary_data": False}} for name, params in named]
        request["parameters"] = _parameters(task, options)
    else:
        request["outputs"], request["parameters"] = [], {**_parameters(task, options), "binary_data_output": True}
    header = json.dumps(request).encode()
    headers = {"content-type": "application/octet-stream", "inference-header-content-length": str(len(header))}
    return Payload(model_path("v2", model), headers, header + blob, len(images))


def grpc_payload(model: str, images: list[bytes], task: str = "classify", options: Options = LIGHTEST) -> Payload:
    """gRPC ModelInfer: the ``IMAGE`` BYTES input in ``raw_input_contents``, the options as request parameters, the
    outputs they ask for (a classifier's classification extension; else the task's default outputs); the body is
    the serialised request and the path the RPC's."""
    from service.core.protocol import method_path, pb

    request = pb.ModelInferRequest(model_name=model)
    request.inputs.add(name="IMAGE", datatype="BYTES", shape=[len(images)])
    for key, value in _parameters(task, options).items():
        setattr(request.parameters[key], _GRPC_PARAM[type(value)], value)
    for name, params in _outputs(task, options):
        output = request.outputs.add(name=name)
        for key, value in params.items():
            output.parameters[key].int64_param = value
    request.raw_input_contents.append(b"".join(struct.pack("<I", len(d)) + d for d in images))
    return Payload(method_path("ModelInfer"), {}, request.SerializeToString(), len(images))


def payloads(
    model: str,
    images: list[bytes],
    *,
    protocol: str = "image",
    per_request: int = 1,
    task: str = "classify",
    names: Sequence[str] | None = None,
    options: Options = LIGHTEST,
) -> list[Payload]:
    """One payload per group of ``per_request`` images, cycling through the corpus so each image is used; each
    names its images where ``names`` (one per image) are given."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if per_request < 1:
        raise ValueError(f"images per request must be >= 1, got {per_request}")
    if names is not None and len(names) != len(images):
        raise ValueError(f"{len(names)} names for {len(images)} images")
    build = {"image": image_payload, "v2": v2_payload, "grpc": grpc_payload}[protocol]
    count = max(1, len(images) // per_request)
    out = []
    for j in range(count):
        picked = [(j * per_request + i) % len(images) for i in range(per_request)]
        payload = build(model, [images[k] for k in picked], task=task, options=options)
        out.append(replace(payload, names=tuple(names[k] for k in picked)) if names is not None else payload)
    return out


def model_payloads(
    models: Sequence[str],
    images: list[bytes],
    *,
    protocol: str = "image",
    per_request: int = 1,
    task: str = "classify",
    names: Sequence[str] | None = None,
    options: Options = LIGHTEST,
) -> list[list[Payload]]:
    """:func:`payloads` for each of ``models``, in order; over HTTP the bodies are the first model's, shared."""

    def build(model: str) -> list[Payload]:
        return payloads(model, images, protocol=protocol, per_request=per_request, task=task, names=names,
                        options=options)  # fmt: skip

    first = build(models[0])
    if protocol == "grpc":
        rest = [build(m) for m in models[1:]]
    else:
        rest = [[replace(p, path=model_path(protocol, m, task, options)) for p in first] for m in models[1:]]
    return [first, *rest]
