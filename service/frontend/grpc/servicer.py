"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``), as Triton serves it, so
tritonclient.grpc, perf_analyzer and KServe's ``grpc-v2`` clients work unchanged.

Every RPC reads the same :class:`ServerState` as HTTP and goes through :mod:`service.frontend.protocol`, so both
protocols answer alike. Errors keep HTTP's messages, and each carries its gRPC code beside its HTTP status (the
table in :mod:`service.core.errors`); an overload's ``retry-after`` goes in the trailers.

``ModelStreamInfer`` is a stream of frames with latest-frame semantics (docs/streams.md, :class:`StreamCall`): the
same :class:`~service.frontend.stream.FrameStream` as the WebSocket route, one answer per frame.

The RPCs a server of images cannot honour (shared memory, tracing, logging settings) are not registered, so grpc
answers them UNIMPLEMENTED.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format

from service.core.errors import BadInputError, NotFoundError, OverloadedError, VisionServeError
from service.core.protocol import SERVICE, config_pb, pb
from service.frontend import protocol
from service.frontend.parameters import request_options
from service.frontend.protocol import Tensor
from service.frontend.state import ModelSlot, ServerState
from service.frontend.stream import Frame, FrameStream, stream_options
from service.frontend.timing import Timing

log = logging.getLogger("visionserve.grpc")

# Typed contents per datatype: the InferTensorContents field that carries it.
CONTENTS = {"UINT8": "uint_contents", "FP32": "fp32_contents", "BYTES": "bytes_contents"}

# grpcio ships no type stubs: its context is Any to the type checker.
Context = Any
Method = Callable[[Any, Context], Awaitable[Any]]

# ModelStreamInfer, as the WebSocket route (docs/streams.md): a client that leaves this many answers unsent, or does
# not take one within SEND_TIMEOUT_S, is cut off rather than holding answers (and frames) in server memory.
OUTBOX_LIMIT = 64
SEND_TIMEOUT_S = 10.0


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


def _metadata(context: Context) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


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


def _add_outputs(
    response: pb.ModelInferResponse, slot: ModelSlot, wanted: list[protocol.Wanted], logits: np.ndarray
) -> None:
    """Outputs always as ``raw_output_contents`` (what Triton answers, and what tritonclient reads first)."""
    for out in wanted:
        if out.k is not None:
            response.outputs.add(name=out.name, datatype="BYTES", shape=[logits.shape[0], out.k])
            response.raw_output_contents.append(protocol.bytes_tensor(protocol.classify(logits, slot, out.k)))
        else:
            response.outputs.add(name=out.name, datatype="FP32", shape=list(logits.shape))
            response.raw_output_contents.append(np.ascontiguousarray(logits, dtype="<f4").tobytes())


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
            route = server.route(slot.name, request.model_version, _metadata(context))
            logits = await protocol.infer(
                server, slot, _tensors(request), timing, priority=priority, timeout_ms=timeout_ms, route=route
            )
            started = time.perf_counter()
            version = timing.version or slot.version.version  # the one that answered (a canary's candidate)
            response = pb.ModelInferResponse(model_name=slot.name, model_version=str(version), id=request.id)
            _add_outputs(response, slot, wanted, logits)
            timing.postprocess_s += time.perf_counter() - started
        return response

    async def model_stream_infer(self, requests: AsyncIterator[pb.ModelInferRequest], context: Context) -> None:
        """Frames in, one answer per frame out, newest frame first: docs/streams.md. Answers are written with
        ``context.write``; the call ends once every frame read is answered."""
        server = self.server
        if server.draining:
            raise OverloadedError("the server is shutting down")
        call = StreamCall(server, context)
        server.streams.add(call)  # told to end when the server drains, from before its first frame
        try:
            await call.run(requests)
        finally:
            server.streams.discard(call)
            call.done.set()

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


# ---- ModelStreamInfer ---------------------------------------------------------------------------------------------


@dataclass
class StreamFrame(Frame):
    """A frame of ``ModelStreamInfer``: its request's ``client_ts`` is kept as the InferParameter it came as (echoed
    untouched), and the outputs that request asks for go with it to its answer."""

    wanted: list[protocol.Wanted] = field(default_factory=list)


class StreamCall:
    """One ``ModelStreamInfer`` call: a reader offers each request to a :class:`FrameStream`, which the first request
    opens (its model, and the stream's ``max_age_ms`` and ``top_k``); a writer sends the answers in the order they
    are decided, through a bounded outbox.

    It ends with OK once the client has closed its side and every frame read is answered; with UNAVAILABLE when the
    server drains, after answering every frame it holds; with RESOURCE_EXHAUSTED when the client stops reading. Those
    two messages start with "N frames read", as the WebSocket's close reasons do: the frames sent after those N were
    never read. A first request that cannot open a stream (an unknown model, a bad ``max_age_ms``) ends the call
    with its error's status."""

    def __init__(self, server: ServerState, context: Context) -> None:
        self.server = server
        self.context = context
        self.stream: FrameStream | None = None
        self.outbox: deque[pb.ModelStreamInferResponse] = deque()
        self.ready = asyncio.Event()  # something to write, or the end
        self.stop = asyncio.Event()  # read no more frames: draining, cut off, refused
        self.done = asyncio.Event()  # the call has ended (what ServerState.drain waits for)
        self.draining = False
        self.cut_off: str | None = None
        self.refused: VisionServeError | None = None
        self.finished = False  # every frame read has its answer in the outbox
        self._model = ("", "")
        self._open = contextlib.ExitStack()

    def drain(self) -> None:
        """The server drains: read no more frames, answer those held, end with UNAVAILABLE."""
        self.draining = True
        self.stop.set()

    async def run(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        loop = asyncio.get_running_loop()
        writer = loop.create_task(self._write())
        reader = loop.create_task(self._read(requests))
        stopped = loop.create_task(self.stop.wait())
        try:
            with self._open:
                await asyncio.wait([reader, stopped], return_when=asyncio.FIRST_COMPLETED)
                reader.cancel()  # read no more: a frame read now would only be answered expired
                if self.stream is not None:
                    why = self.cut_off or ("the server is draining" if self.draining else "the client closed")
                    await self.stream.close(why, timeout_s=self.server.settings.drain_timeout_s)
        except asyncio.CancelledError:  # the client cancelled, or the server stopped: nobody to answer
            writer.cancel()
            if self.stream is not None:  # every frame is still counted: the one computing as expired
                await self.stream.close("the call was cancelled", timeout_s=0)
            raise
        finally:
            stopped.cancel()
            reader.cancel()
            self.finished = True
            self.ready.set()
        if self.cut_off is not None:  # its write is stuck, and nothing more will be written
            writer.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await writer
        await self._end(reader)

    async def _end(self, reader: asyncio.Task[None]) -> None:
        failed = reader.exception() if reader.done() and not reader.cancelled() else None
        if failed is not None:
            raise failed  # every frame read is answered; the call fails as any RPC that went wrong (_guarded)
        if self.refused is not None:
            raise self.refused
        read = f"{self.stream.counts.sent if self.stream is not None else 0} frames read"
        if self.cut_off is not None:
            await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{read}; {self.cut_off}")
        if self.draining:
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, f"{read}; the server is draining")

    # ---- frames in ------------------------------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        async for request in requests:
            self._take(request, time.perf_counter())
            if self.stop.is_set():
                return

    def _take(self, request: pb.ModelInferRequest, received: float) -> None:
        params = parameter_values(request.parameters)
        client_ts = request.parameters.get("client_ts")  # the InferParameter itself: echoed untouched
        stream = self.stream
        if stream is None:
            try:
                stream = self._start(request, params)
            except VisionServeError as exc:
                self.refused = exc
                self.stop.set()
                return
        try:
            if (request.model_name, request.model_version) != self._model:
                raise BadInputError(
                    f"this stream is to model {_named(*self._model)}: a frame for "
                    f"{_named(request.model_name, request.model_version)} needs a stream of its own"
                )
            outputs = [(o.name, parameter_values(o.parameters)) for o in request.outputs]
            wanted = protocol.wanted_outputs(outputs, stream.slot)
            image = _frame_image(request)
        except VisionServeError as exc:
            stream.reject(request.id, client_ts, str(exc))
            return
        stream.offer(StreamFrame(request.id, client_ts, image, received, wanted=wanted))

    def _start(self, request: pb.ModelInferRequest, params: dict[str, Any]) -> FrameStream:
        slot = protocol.resolve(self.server, request.model_name, request.model_version).slot
        max_age_ms, top_k = stream_options(params.get("max_age_ms"), params.get("top_k"))
        route = self.server.route(slot.name, request.model_version, _metadata(self.context))
        stream = FrameStream(
            slot, self._emit, max_age_ms=max_age_ms, top_k=top_k, route=route,
            on_outcome=self.server.stream_outcome(slot.name), keep_raw=True,
        )  # fmt: skip
        self._open.enter_context(self.server.stream_open(slot.name, self))
        self._model = (request.model_name, request.model_version)
        self.stream = stream
        stream.start()
        return stream

    # ---- answers out ----------------------------------------------------------------------------------------
    def _emit(self, answer: dict[str, Any]) -> None:
        if self.cut_off is not None:
            return
        if len(self.outbox) >= OUTBOX_LIMIT:
            self._cut(f"the client left {OUTBOX_LIMIT} answers unread")
            return
        self.outbox.append(self._message(answer))
        self.ready.set()

    def _message(self, answer: dict[str, Any]) -> pb.ModelStreamInferResponse:
        """One answer as tritonclient's callback takes it: an error as ``error_message``, any other fate as an
        ``infer_response`` whose parameters say which (docs/streams.md)."""
        status = answer["status"]
        if status == "error":
            return pb.ModelStreamInferResponse(error_message=f"frame {answer['id']}: {answer['error']}")
        assert self.stream is not None
        slot = self.stream.slot
        version = answer.get("version") or slot.version.version  # a result's: the version that answered
        response = pb.ModelInferResponse(model_name=slot.name, model_version=str(version), id=answer["id"])
        if status == "result":
            frame: StreamFrame = answer["frame"]
            _add_outputs(response, slot, frame.wanted, answer["logits"][np.newaxis])
        params = response.parameters
        params["status"].string_param = status
        params["age_ms"].double_param = answer["age_ms"]
        if answer["ts"] is not None:
            params["client_ts"].CopyFrom(answer["ts"])
        for key in ("stage", "by", "reason"):
            if key in answer:
                params[key].string_param = str(answer[key])
        for stage, ms in (answer.get("timings_ms") or {}).items():  # wait, decode, queue, compute
            params[f"{stage}_ms"].double_param = float(ms)
        return pb.ModelStreamInferResponse(infer_response=response)

    def _cut(self, why: str) -> None:
        if self.cut_off is None:
            self.cut_off = why
            log.warning("ModelStreamInfer to %s cut off: %s", self._model[0], why)
        self.stop.set()
        self.ready.set()

    async def _write(self) -> None:
        while True:
            await self.ready.wait()
            self.ready.clear()
            while self.outbox and self.cut_off is None:
                try:
                    await asyncio.wait_for(self.context.write(self.outbox.popleft()), SEND_TIMEOUT_S)
                except TimeoutError:
                    self._cut(f"an answer waited {SEND_TIMEOUT_S:g} s for the client to read it")
                    return
                except Exception:  # the call went away: nothing more to tell it
                    self.stop.set()
                    return
            if self.cut_off is not None or self.finished:
                return


def _named(model: str, version: str) -> str:
    return repr(model) + (f" version {version}" if version else "")


def _frame_image(request: pb.ModelInferRequest) -> bytes:
    """The encoded image of one frame: input IMAGE, BYTES, shape [1]."""
    tensors = _tensors(request)
    if len(tensors) != 1 or tensors[0].name != protocol.IMAGE:
        raise BadInputError(
            f"a frame is one input, IMAGE (BYTES, shape [1]) holding an encoded image; got {[t.name for t in tensors]}"
        )
    files = protocol.images_from(tensors[0])
    if len(files) != 1:
        raise BadInputError(f"a frame holds one image (input IMAGE, shape [1]), got {len(files)}")
    if not files[0]:
        raise BadInputError("the frame holds no image")
    return files[0]
