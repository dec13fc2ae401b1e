"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), as Triton serves it, so
tritonclient.grpc, perf_analyzer and KServe's ``grpc-v2`` clients work unchanged.

Every RPC reads the same :class:`ServerState` as HTTP and goes through :mod:`service.frontend.protocol`, so both
protocols answer alike. Errors keep HTTP's messages, and each carries its gRPC code beside its HTTP status (the
table in :mod:`service.core.errors`); an overload's ``retry-after`` goes in the trailers.

The RPCs a server of images cannot honour (shared memory, tracing, logging settings, streaming) are not
registered, so grpc answers them UNIMPLEMENTED.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from service.core.errors import BadInputError, NotFoundError, VisionServeError
from service.core.protocol import SERVICE, config_pb, pb
from service.frontend import protocol
from service.frontend.parameters import request_options
from service.frontend.protocol import Tensor
from service.frontend.state import ModelSlot, ServerState
from service.frontend.timing import Timing

log = logging.getLogger("visionserve.grpc")

# Typed contents per datatype: the InferTensorContents field that carries it.
CONTENTS = {"UINT8": "uint_contents", "FP32": "fp32_contents", "BYTES": "bytes_contents"}

# grpcio ships no type stubs: its context is Any to the type checker.
Context = Any
Method = Callable[[Any, Context], Awaitable[Any]]


def code_of(exc: VisionServeError) -> grpc.StatusCode:
    """The gRPC status one of our errors carries."""
    return grpc.StatusCode[exc.grpc_code]


def parameter_values(params: Any) -> dict[str, Any]:
    """A protobuf map of InferParameter as plain Python values (an int64, uint64 or double as the number it holds,
    unchecked: :mod:`service.frontend.parameters` checks each against its range)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        which = value.WhichOneof("parameter_choice")
        if which is not None:
            out[key] = getattr(value, which)
    return out


def _authorization(context: Context) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return str(value)
    return ""


def _tensors(request: pb.ModelInferRequest) -> list[Tensor]:
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise BadInputError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs: send all inputs raw or none"
        )
    tensors = []
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
        tensors.append(
            Tensor(tensor.name, tensor.datatype, list(tensor.shape), payload, parameter_values(tensor.parameters))
        )
    return tensors


def _infer_response(
    request: pb.ModelInferRequest, slot: ModelSlot, wanted: list[protocol.Wanted], logits: np.ndarray
) -> pb.ModelInferResponse:
    """Outputs always as ``raw_output_contents`` (what Triton answers, and what tritonclient reads first)."""
    response = pb.ModelInferResponse(model_name=slot.name, model_version=str(slot.version.version), id=request.id)
    for out in wanted:
        if out.k is not None:
            response.outputs.add(name=out.name, datatype="BYTES", shape=[logits.shape[0], out.k])
            response.raw_output_contents.append(protocol.bytes_tensor(protocol.classify(logits, slot, out.k)))
        else:
            response.outputs.add(name=out.name, datatype="FP32", shape=list(logits.shape))
            response.raw_output_contents.append(np.ascontiguousarray(logits, dtype="<f4").tobytes())
    return response


class InferenceServicer:
    """``inference.GRPCInferenceService`` over one :class:`ServerState`; :meth:`handler` registers it."""

    def __init__(self, server: ServerState) -> None:
        self.server = server

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler for grpc's server: each RPC with its protobuf (de)serialisers and error mapping."""
        methods: dict[str, tuple[type[Any], type[Any], Method]] = {
            "ServerLive": (pb.ServerLiveRequest, pb.ServerLiveResponse, self.server_live),
            "ServerReady": (pb.ServerReadyRequest, pb.ServerReadyResponse, self.server_ready),
            "ModelReady": (pb.ModelReadyRequest, pb.ModelReadyResponse, self.model_ready),
            "ServerMetadata": (pb.ServerMetadataRequest, pb.ServerMetadataResponse, self.server_metadata),
            "ModelMetadata": (pb.ModelMetadataRequest, pb.ModelMetadataResponse, self.model_metadata),
            "ModelConfig": (pb.ModelConfigRequest, pb.ModelConfigResponse, self.model_config),
            "ModelStatistics": (pb.ModelStatisticsRequest, pb.ModelStatisticsResponse, self.model_statistics),
            "ModelInfer": (pb.ModelInferRequest, pb.ModelInferResponse, self.model_infer),
            "RepositoryIndex": (pb.RepositoryIndexRequest, pb.RepositoryIndexResponse, self.repository_index),
            "RepositoryModelLoad": (pb.RepositoryModelLoadRequest, pb.RepositoryModelLoadResponse, self.load),
            "RepositoryModelUnload": (pb.RepositoryModelUnloadRequest, pb.RepositoryModelUnloadResponse, self.unload),
        }
        handlers = {
            name: grpc.unary_unary_rpc_method_handler(
                _guarded(name, method), request_deserializer=req.FromString, response_serializer=resp.SerializeToString
            )
            for name, (req, resp, method) in methods.items()
        }
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # ---- health and metadata ------------------------------------------------------------------------------------

    async def server_live(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.server.ready and not self.server.draining)

    async def model_ready(self, request: pb.ModelReadyRequest, context: Context) -> pb.ModelReadyResponse:
        # An unknown model is simply not ready (as Triton answers), so the three tritonclients agree: False.
        try:
            slot = protocol.resolve(self.server, request.name, request.version).slot
        except (NotFoundError, BadInputError):
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=protocol.is_ready(self.server, slot))

    async def server_metadata(self, request: pb.ServerMetadataRequest, context: Context) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(
            name=protocol.SERVER_NAME, version=protocol.SERVER_VERSION, extensions=protocol.EXTENSIONS
        )

    async def model_metadata(self, request: pb.ModelMetadataRequest, context: Context) -> pb.ModelMetadataResponse:
        meta = protocol.metadata(self.server, protocol.resolve(self.server, request.name, request.version))
        return json_format.ParseDict(meta, pb.ModelMetadataResponse(), ignore_unknown_fields=True)

    async def model_config(self, request: pb.ModelConfigRequest, context: Context) -> pb.ModelConfigResponse:
        config = protocol.model_config(protocol.resolve(self.server, request.name, request.version))
        return pb.ModelConfigResponse(
            config=json_format.ParseDict(config, config_pb.ModelConfig(), ignore_unknown_fields=True)
        )

    async def model_statistics(
        self, request: pb.ModelStatisticsRequest, context: Context
    ) -> pb.ModelStatisticsResponse:
        # The same function, so the same numbers, as GET /v2/models[/{m}[/versions/{v}]]/stats; "m.image" is m.
        name = protocol.resolve(self.server, request.name).slot.name if request.name else None
        rows = await protocol.model_statistics(self.server, name, request.version or None)
        response = pb.ModelStatisticsResponse()
        for row in rows:
            json_format.ParseDict(row, response.model_stats.add(), ignore_unknown_fields=True)
        return response

    # ---- inference ------------------------------------------------------------------------------------------

    async def model_infer(self, request: pb.ModelInferRequest, context: Context) -> pb.ModelInferResponse:
        server = self.server
        slot = protocol.resolve(server, request.model_name, request.model_version).slot
        timing = Timing()
        with slot.observe(timing, protocol="grpc"):
            # Every parameter is checked before any work (the outputs' too): a refusal costs no inference.
            priority, timeout_ms = request_options(parameter_values(request.parameters))
            wanted = protocol.wanted_outputs([(o.name, parameter_values(o.parameters)) for o in request.outputs], slot)
            remaining_s = context.time_remaining()
            if remaining_s is not None:  # the client's own gRPC deadline bounds the wait in the queue too
                timeout_ms = min(timeout_ms or float("inf"), max(remaining_s, 0.0) * 1000)
            metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
            route = server.route(slot.name, request.model_version, metadata)
            logits = await protocol.infer(
                server, slot, _tensors(request), timing, priority=priority, timeout_ms=timeout_ms, route=route
            )
            started = time.perf_counter()
            response = _infer_response(request, slot, wanted, logits)
            timing.postprocess_s += time.perf_counter() - started
        return response

    # ---- repository (admin) -------------------------------------------------------------------------------

    async def repository_index(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        protocol.require_admin(self.server, _authorization(context))
        rows = await protocol.repository_index(self.server, request.ready)  # what POST /v2/repository/index answers
        fields = ("name", "version", "state", "reason")
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(**{k: str(row[k]) for k in fields if k in row}) for row in rows
            ]
        )

    async def load(self, request: pb.RepositoryModelLoadRequest, context: Context) -> pb.RepositoryModelLoadResponse:
        protocol.require_admin(self.server, _authorization(context))
        # As the HTTP route: "config" (a JSON string, as tritonclient sends it) is applied or refused, never ignored;
        # any other parameter (Triton's "file:..." overrides) is refused.
        unknown = sorted(set(request.parameters) - {"config"})
        if unknown:
            raise BadInputError(f"load parameters {unknown} are not supported; only 'config' is")
        config = None
        if "config" in request.parameters:
            param = request.parameters["config"]
            if param.WhichOneof("parameter_choice") != "string_param":
                raise BadInputError("the load parameter 'config' must be a string holding JSON")
            config = param.string_param
        await self.server.load_model(request.model_name, config)
        return pb.RepositoryModelLoadResponse()

    async def unload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        protocol.require_admin(self.server, _authorization(context))
        await protocol.unload(self.server, request.model_name)  # an unknown name is no error, as over HTTP
        return pb.RepositoryModelUnloadResponse()


def _guarded(name: str, method: Method) -> Method:
    """``method`` with our errors turned into gRPC statuses carrying HTTP's message; never a stack trace."""

    async def call(request: Any, context: Context) -> Any:
        try:
            return await method(request, context)
        except VisionServeError as exc:
            code = code_of(exc)
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(exc.retry_after_s)),))
            if code == grpc.StatusCode.INTERNAL:
                log.error("gRPC %s failed: %s", name, exc, exc_info=exc)
            await context.abort(code, str(exc))
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("gRPC %s failed unexpectedly", name, exc_info=exc)
            await context.abort(grpc.StatusCode.INTERNAL, "internal server error")

    return call
