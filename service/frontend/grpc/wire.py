"""What the gRPC wire carries, in and out: request parameters and tensors as the protocol-free records, and the
task's output tensors as ``raw_output_contents``; shared by the unary RPC and ``ModelStreamInfer``."""

from __future__ import annotations

from typing import Any

from service.core.errors import BadInputError
from service.core.protocol import pb
from service.core.tasks import OutputTensor
from service.frontend.protocol import Tensor

# Typed contents per datatype: the InferTensorContents field that carries it.
CONTENTS = {"UINT8": "uint_contents", "FP32": "fp32_contents", "BYTES": "bytes_contents"}

# grpcio ships no type stubs: its context is Any to the type checker.
Context = Any


def parameter_values(params: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter as plain Python values (an int64, uint64 or double as the number it holds,
    unchecked: :mod:`service.core.parameters` checks each against its range)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(value, which)
    return out


def metadata(context: Context) -> dict[str, str]:
    """The call's metadata as headers (what a sticky canary routes by)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


def tensors(request: pb.ModelInferRequest) -> list[Tensor]:
    """A request's inputs: each ``raw_input_contents`` entry, or its typed contents."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadInputError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs: send all inputs raw or none"
        )
    found = []
    for i, tensor in enumerate(request.inputs):
        payload: bytes | list[Any]
        if raw:
            payload = raw[i]
        else:
            field = CONTENTS.get(tensor.datatype)
            if field is None:
                raise BadInputError(
                    f"input {tensor.name}: datatype {tensor.datatype} is not taken (UINT8, FP32 or BYTES)"
                )
            payload = list(getattr(tensor.contents, field))
        found.append(
            Tensor(tensor.name, tensor.datatype, list(tensor.shape), payload, parameter_values(tensor.parameters))
        )
    return found


def wanted(request: pb.ModelInferRequest) -> list[tuple[str, dict[str, Any]]]:
    """The outputs a request names, with their parameters (the task checks them)."""
    return [(o.name, parameter_values(o.parameters)) for o in request.outputs]


def write_outputs(response: pb.ModelInferResponse, outputs: list[OutputTensor]) -> None:
    """Outputs always as ``raw_output_contents`` (what Triton answers, and what tritonclient reads first)."""
    for tensor in outputs:
        response.outputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        response.raw_output_contents.append(tensor.raw())
