"""``ModelStreamInfer`` (docs/streams.md, "gRPC"): the WebSocket route's stream session, one answer per frame."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.core.errors import BadInputError, VisionServeError
from service.core.protocol import pb
from service.core.tasks import Want, fields
from service.frontend import protocol
from service.frontend import request as path
from service.frontend.grpc import wire
from service.frontend.outbox import StreamSession
from service.frontend.state import ServerState
from service.frontend.stream import Frame, FrameStream, stream_max_age


class StreamCall(StreamSession[pb.ModelStreamInferResponse]):
    """One ``ModelStreamInfer`` call: the first request opens its :class:`FrameStream` (the model, ``max_age_ms`` and
    the stream's options), and each frame's request says which outputs its answer holds; the statuses it ends with are
    docs/streams.md's."""

    what = "ModelStreamInfer"

    def __init__(self, server: ServerState, context: wire.Context) -> None:
        super().__init__(server)
        self.context = context
        self.refused: VisionServeError | None = None
        self._model = ("", "")
        self._outputs: list[tuple[str, dict[str, Any]]] = []  # a frame naming no output: the stream's (top_k's)
        self._open = contextlib.ExitStack()

    async def serve(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        with self._open:
            await self.run(self._read(requests))
        if self.refused is not None:
            raise self.refused
        if self.cut_off is not None:
            await self.context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.frames_read()}; {self.cut_off}")
        if self.draining:
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.frames_read()}; the server is draining")

    # ---- frames in ------------------------------------------------------------------------------------------
    async def _read(self, requests: AsyncIterator[pb.ModelInferRequest]) -> None:
        async for request in requests:
            self._take(request, time.perf_counter())
            if self.stop.is_set():
                return

    def _take(self, request: pb.ModelInferRequest, received: float) -> None:
        client_ts = request.parameters.get("client_ts")  # the InferParameter itself: echoed untouched
        stream = self.stream
        if stream is None:
            try:
                stream = self._start(request, wire.parameter_values(request.parameters))
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
            task, params = stream.slot.task, wire.parameter_values(request.parameters)
            named = wire.wanted(request)
            want = Want(task.wanted(named or self._outputs), task.options(params, where="parameters.", v2=True))
            image = _frame_image(request)
        except VisionServeError as exc:
            stream.reject(request.id, client_ts, str(exc))
            return
        stream.offer(Frame(request.id, client_ts, image, received, want))

    def _start(self, request: pb.ModelInferRequest, params: dict[str, Any]) -> FrameStream:
        where = path.target(self.server, request.model_name, request.model_version, wire.metadata(self.context))
        max_age_ms = stream_max_age(params.get("max_age_ms"))
        self.track(params.get("track"), where.slot)
        # Each frame says what its answer holds (its outputs, a detector's thresholds); the stream's options, checked
        # as the WebSocket checks them, say which outputs a frame naming none is answered with (a classifier's
        # top_k: the classification extension's k best; it was once checked here and then left unused).
        per_frame = {f.name for f in fields(where.slot.task.Options) if f.v2}  # each frame's own, its error alone
        stream_wide = {k: v for k, v in params.items() if k not in per_frame}
        options = where.slot.task.options(stream_wide, where="parameters.", text=True)
        self._outputs = where.slot.task.named_outputs(options, params)
        stream = FrameStream(
            where, self.emit, max_age_ms=max_age_ms, on_outcome=self.server.stream_outcome(where.slot.name)
        )
        self._open.enter_context(self.server.stream_open(where.slot.name, self))
        self._model = (request.model_name, request.model_version)
        self.stream = stream
        stream.start()
        return stream

    # ---- answers out ----------------------------------------------------------------------------------------
    def encode(self, answer: dict[str, Any]) -> pb.ModelStreamInferResponse:
        """One answer as tritonclient's callback takes it: an error as ``error_message``, any other fate as an
        ``infer_response`` whose parameters say which (docs/streams.md)."""
        status = answer["status"]
        if status == "error":
            return pb.ModelStreamInferResponse(error_message=f"frame {answer['id']}: {answer['error']}")
        assert self.stream is not None
        slot = self.stream.slot
        version = path.answered_version(slot, answer.get("version", 0))
        response = pb.ModelInferResponse(model_name=slot.name, model_version=str(version), id=answer["id"])
        if status == "result":
            wire.write_outputs(response, answer["outputs"])
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

    async def send(self, message: pb.ModelStreamInferResponse) -> None:
        await self.context.write(message)


def _named(model: str, version: str) -> str:
    return repr(model) + (f" version {version}" if version else "")


def _frame_image(request: pb.ModelInferRequest) -> bytes:
    """The encoded image of one frame: input IMAGE, BYTES, shape [1]."""
    tensors = wire.tensors(request)
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
