"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), as Triton serves it (the README's
"gRPC"). Every RPC reads the same :class:`ServerState` as HTTP through :mod:`service.frontend.protocol`, so both
answer alike; an error keeps HTTP's message, with its gRPC code (:mod:`service.core.errors`). The RPCs a server of
images cannot honour (shared memory, tracing, logging settings) are not registered: grpc answers them UNIMPLEMENTED.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
from google.protobuf import json_format

from service.core.errors import BadInputError, ConfigError, NotFoundError, OverloadedError, VisionServeError
from service.core.parameters import load_config, request_options
from service.core.protocol import SERVICE, config_pb, pb
from service.core.tasks import Want
from service.frontend import protocol
from service.frontend import request as path
from service.frontend.grpc import wire
from service.frontend.grpc.stream_call import StreamCall
from service.frontend.grpc.wire import Context
from service.frontend.grpc.wire import parameter_values as parameter_values  # the tests' and tools' name for it
from service.frontend.state import ServerState
from service.frontend.timing import Timing

log = logging.getLogger("visionserve.grpc")

Method = Callable[[Any, Context], Awaitable[Any]]
# The RPCs that change the server: admin, guarded once where the handlers are registered (as HTTP's router).
ADMIN = frozenset({"RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload"})


def code_of(exc: VisionServeError) -> grpc.StatusCode:
    """The gRPC status one of our errors carries."""
    return grpc.StatusCode[exc.grpc_code]


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
                _guarded(name, method, admin=self.server if name in ADMIN else None),
                request_deserializer=req.FromString,
                response_serializer=resp.SerializeToString,
            )
            for name, (req, resp, method) in methods.items()
        }
        handlers["ModelStreamInfer"] = grpc.stream_stream_rpc_method_handler(
            _guarded("ModelStreamInfer", self.model_stream_infer),
            request_deserializer=pb.ModelInferRequest.FromString,
            response_serializer=pb.ModelStreamInferResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # ---- health and metadata ------------------------------------------------------------------------------------

    async def server_live(self, request: pb.ServerLiveRequest, context: Context) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(self, request: pb.ServerReadyRequest, context: Context) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=protocol.server_ready(self.server))

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
        where = path.target(server, request.model_name, request.model_version, wire.metadata(context))

        async def parse(where: path.Target) -> path.Ask:
            # Every parameter is checked before any work (the outputs' too): a refusal costs no inference.
            params = wire.parameter_values(request.parameters)
            priority, timeout_ms = request_options(params)
            task = where.slot.task
            want = Want(task.wanted(wire.wanted(request)), task.options(params, where="parameters.", v2=True))
            remaining_s = context.time_remaining()
            if remaining_s is not None:  # the client's own gRPC deadline bounds the wait in the queue too
                timeout_ms = min(timeout_ms or float("inf"), max(remaining_s, 0.0) * 1000)
            inputs = wire.tensors(request)
            return protocol.ask_of(server, where.slot, inputs, want, priority=priority, timeout_ms=timeout_ms)

        return await path.answer(where, Timing(), parse, partial(_response, request.id), protocol="grpc")

    async def model_stream_infer(self, requests: AsyncIterator[pb.ModelInferRequest], context: Context) -> None:
        """Frames in, one answer per frame out, newest frame first: docs/streams.md."""
        if self.server.draining:
            raise OverloadedError("the server is shutting down")
        call = StreamCall(self.server, context)
        self.server.streams.add(call)  # told to end when the server drains, from before its first frame
        try:
            await call.serve(requests)
        finally:
            self.server.streams.discard(call)
            call.done.set()

    # ---- repository (admin) -------------------------------------------------------------------------------

    async def repository_index(
        self, request: pb.RepositoryIndexRequest, context: Context
    ) -> pb.RepositoryIndexResponse:
        rows = await protocol.repository_index(self.server, request.ready)  # what POST /v2/repository/index answers
        fields = ("name", "version", "state", "reason")
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(**{k: str(row[k]) for k in fields if k in row}) for row in rows
            ]
        )

    async def load(self, request: pb.RepositoryModelLoadRequest, context: Context) -> pb.RepositoryModelLoadResponse:
        # "config" is a JSON string here, as tritonclient sends it.
        param = load_config(request.parameters)
        if param is not None and param.WhichOneof("parameter_choice") != "string_param":
            raise BadInputError("the load parameter 'config' must be a string holding JSON")
        await self.server.load_model(request.model_name, None if param is None else param.string_param)
        return pb.RepositoryModelLoadResponse()

    async def unload(
        self, request: pb.RepositoryModelUnloadRequest, context: Context
    ) -> pb.RepositoryModelUnloadResponse:
        await protocol.unload(self.server, request.model_name)  # an unknown name is no error, as over HTTP
        return pb.RepositoryModelUnloadResponse()


def _guarded(name: str, method: Method, admin: ServerState | None = None) -> Method:
    """``method`` with our errors turned into gRPC statuses carrying HTTP's message; never a stack trace. With
    ``admin``, the call needs that server's admin token first (:func:`protocol.require_admin`)."""

    async def call(request: Any, context: Context) -> Any:
        try:
            if admin is not None:
                protocol.require_admin(admin, wire.metadata(context).get("authorization", ""))
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


def _response(request_id: str, answer: path.Answer) -> pb.ModelInferResponse:
    response = pb.ModelInferResponse(model_name=answer.slot.name, model_version=str(answer.version), id=request_id)
    wire.write_outputs(response, answer.tensors)
    return response


async def start_grpc(server: ServerState) -> grpc.aio.Server | None:
    """Serve ``inference.GRPCInferenceService`` on ``settings.host:settings.grpc_port`` (None with port 0: off).
    Its ``stop(grace_s)`` refuses new calls at once and lets those in flight finish within ``grace_s``."""
    settings = server.settings
    if settings.grpc_port == 0:
        return None
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.grpc_port}"
    options = [
        # Several front-end processes bind the same port and the kernel spreads connections among them.
        ("grpc.so_reuseport", 1),
        # The same limit as an HTTP body; grpc refuses a larger message with RESOURCE_EXHAUSTED.
        ("grpc.max_receive_message_length", settings.max_body_bytes),
        ("grpc.max_send_message_length", -1),
    ]
    grpc_server = grpc.aio.server(options=options)
    grpc_server.add_generic_rpc_handlers((InferenceServicer(server).handler(),))
    try:
        port = grpc_server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"gRPC could not bind {address}: {exc}") from exc
    if port == 0:
        raise ConfigError(f"gRPC could not bind {address} (in use by a process without SO_REUSEPORT?)")
    await grpc_server.start()
    log.info("gRPC (Open Inference Protocol) on %s", address)
    return grpc_server
