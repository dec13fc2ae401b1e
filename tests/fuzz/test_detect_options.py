"""Fuzzing a detector's options (``score_threshold``, ``iou_threshold``, ``max_detections``, ``classes``,
``class_agnostic``) and a classifier's ``top_k`` on every protocol that reads them (issue 53): the image API's
query, v2 ``parameters`` over HTTP and gRPC, the WebSocket stream's query, and a source's body.

Properties: an option is taken (the request answered, the stream opened, the source started) or refused naming it
(a 400, gRPC's INVALID_ARGUMENT, the stream's error answer and 1008); never a 500, INTERNAL or 1011. In one process,
one request each.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import queue
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlencode

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from service.core.protocol import method_path, pb
from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image
from tests.fuzz.conftest import AUTH, fewer

IMAGE = encode_image(random_image(40, 40))
DETECT = ("score_threshold", "iou_threshold", "max_detections", "classes", "class_agnostic")
HUGE = "1" * 4301
# A value of any JSON (or gRPC) type, at and past each option's edges.
numbers = (
    st.integers(-(2**70), 2**70)
    | st.sampled_from([0, 1, -1, 100, 10_000, 10_001, 2**63 - 1, 2**63, 2**64])
    | st.floats()
    | st.sampled_from([math.nan, math.inf, -math.inf, 0.5, 1.0, 1.0000001, -0.0, 1e300, 5e-324])
)
labels = st.sampled_from(["0", "9", "10", "-1", "zero", "", " ", HUGE, "1,2", "٣", "0x1"])
python_values = numbers | st.booleans() | st.none() | st.text(max_size=10) | labels
json_values = (
    python_values
    | st.lists(numbers | labels | st.booleans(), max_size=3)
    | st.dictionaries(st.text(max_size=3), numbers, max_size=2)
)
query_texts = (
    numbers.map(str)
    | labels
    | st.text(max_size=12)
    | st.sampled_from(["true", "false", "True", "1", "0", "yes", "nan", "inf", "-inf", "1e999", "1e-999", HUGE])
)


def _named(error: str, name: str, sent: str = "") -> None:
    # The image API's query echoes the text sent whole (tests/fuzz/test_parameters.py); the rest cut it.
    assert name in error and len(error) < 2000 + len(sent), (name, error[:500])


@fewer(4)
@given(st.sampled_from(DETECT), st.lists(query_texts, min_size=1, max_size=2))
def test_image_api_query(served: InProcessServer, name: str, texts: list[str]) -> None:
    with served.client() as client:
        answer = client.post(f"/v1/models/digits-detect/detect?{urlencode([(name, t) for t in texts])}",
                             content=IMAGE, headers={"content-type": "image/png"})  # fmt: skip
    assert answer.status_code in (200, 400), (texts, answer.status_code, answer.text[:500])
    if answer.status_code == 400:
        _named(answer.json()["error"], name, "".join(texts))


def _json(value: Any) -> str:
    return json.dumps(value)  # Python's json: NaN and Infinity as written, an integer of any size


@fewer(4)
@given(st.dictionaries(st.sampled_from(DETECT), json_values, min_size=1, max_size=2))
def test_v2_parameters_over_http(served: InProcessServer, params: dict[str, Any]) -> None:
    inputs = [{"name": "IMAGE", "shape": [1], "datatype": "BYTES", "data": [IMAGE.decode("latin-1")]}]
    body = '{"inputs": ' + json.dumps(inputs) + ', "parameters": {'
    body += ",".join(f'"{k}": {_json(v)}' for k, v in params.items()) + "}}"
    with served.client() as client:
        answer = client.post("/v2/models/digits-detect/infer", content=body.encode(),
                             headers={"content-type": "application/json"})  # fmt: skip
    # The image as a JSON string is not an image (400 naming the input) where every option is right.
    assert answer.status_code in (200, 400), (params, answer.status_code, answer.text[:500])
    error = answer.json().get("error", "")
    if answer.status_code == 400 and "parameters." in error:
        assert any(f"parameters.{k}" in error for k in params), (params, error)


@st.composite
def grpc_parameter(draw: st.DrawFn) -> pb.InferParameter:
    kind = draw(st.sampled_from(["int64_param", "uint64_param", "double_param", "bool_param", "string_param"]))
    value = draw({
        "int64_param": st.integers(-(2**63), 2**63 - 1),
        "uint64_param": st.integers(0, 2**64 - 1),
        "double_param": st.floats(),
        "bool_param": st.booleans(),
        "string_param": st.text(max_size=10) | labels,
    }[kind])  # fmt: skip
    return pb.InferParameter(**{kind: value})  # type: ignore[arg-type]


def _grpc_request(model: str, params: dict[str, pb.InferParameter], id: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, id=id)
    request.inputs.add(name="IMAGE", datatype="BYTES", shape=[1]).contents.bytes_contents.append(IMAGE)
    for key, param in params.items():
        request.parameters[key].CopyFrom(param)
    return request


@fewer(4)
@given(st.dictionaries(st.sampled_from(DETECT), grpc_parameter(), min_size=1, max_size=2))
def test_v2_parameters_over_grpc(served: InProcessServer, params: dict[str, pb.InferParameter]) -> None:
    with grpc.insecure_channel(served.grpc_target) as channel:
        infer = channel.unary_unary(
            method_path("ModelInfer"),
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        try:
            infer(_grpc_request("digits-detect", params), timeout=30)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (params, exc.code(), exc.details())
            assert any(f"parameters.{k}" in (exc.details() or "") for k in params), (params, exc.details())


def _ws(served: InProcessServer, model: str, query: list[tuple[str, str]]) -> tuple[dict[str, Any], int | None]:
    """A stream opened with ``query``, one frame sent: the first answer, and the close code where it closed."""
    url = f"{served.url.replace('http', 'ws', 1)}/v1/models/{model}/stream?{urlencode(query)}"
    with connect(url, open_timeout=30, max_size=None) as ws:
        with contextlib.suppress(ConnectionClosed):  # refused at once: the error answer is read below
            ws.send(json.dumps({"id": 1, "image_b64": base64.b64encode(IMAGE).decode()}))
        first = json.loads(ws.recv(timeout=30))
        if first["status"] != "error":
            return first, None
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=30)
        return first, ws.close_code


@fewer(4)
@given(st.sampled_from([("digits-detect", n) for n in (*DETECT, "max_age_ms")] + [("digits", "top_k"),
                                                                                  ("digits", "max_age_ms")]),
       st.lists(query_texts, min_size=1, max_size=2))  # fmt: skip
def test_websocket_query(served: InProcessServer, option: tuple[str, str], texts: list[str]) -> None:
    model, name = option
    first, code = _ws(served, model, [(name, t) for t in texts])
    if first["status"] == "error":
        assert code == 1008, (texts, code, first)
        _named(first["error"], name)
    else:
        assert first["status"] in ("result", "expired"), first  # expired: a max_age_ms of 1 is taken


@fewer(4)
@given(st.sampled_from([("digits-detect", n) for n in DETECT] + [("digits", "top_k")]), json_values)
def test_source_body(served: InProcessServer, option: tuple[str, str], value: Any) -> None:
    pytest.importorskip("av", reason="sources need PyAV (the video extra)")
    model, name = option
    body = f'{{"url": "http://127.0.0.1:9/x", "model": "{model}", "{name}": {_json(value)}}}'
    with served.client() as client:
        answer = client.post("/v1/sources", content=body, headers={**AUTH, "content-type": "application/json"})
        assert answer.status_code in (201, 400), (body, answer.status_code, answer.text[:500])
        if answer.status_code == 201:
            client.delete(f"/v1/sources/{answer.json()['id']}", headers=AUTH)
        else:
            _named(answer.json()["error"], name)


@fewer(4)
@given(st.sampled_from(["digits", "digits-detect"]), st.dictionaries(
    st.sampled_from(["max_age_ms", "top_k", *DETECT]), grpc_parameter(), max_size=2))  # fmt: skip
def test_grpc_stream_parameters(served: InProcessServer, model: str, params: dict[str, pb.InferParameter]) -> None:
    """The first request's parameters open the stream (``max_age_ms``; a classifier's ``top_k``) or end the call with
    INVALID_ARGUMENT naming one; a frame's own (a detector's options) are its error answer alone: the next frame, with
    none, is still answered."""
    with grpc.insecure_channel(served.grpc_target) as channel:
        stream = channel.stream_stream(method_path("ModelStreamInfer"),
                                       request_serializer=pb.ModelInferRequest.SerializeToString,
                                       response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip
        good = {k: v for k, v in params.items() if k in ("max_age_ms", "top_k")}
        answered: queue.Queue[None] = queue.Queue()

        def frames() -> Iterator[pb.ModelInferRequest]:
            # The good frame only once the first is answered (a frame still waiting when the client closes its side
            # is answered expired), and the client's side closed once it is.
            yield _grpc_request(model, params, "1")
            answered.get(timeout=30)
            yield _grpc_request(model, good, "2")
            answered.get(timeout=30)

        answers: list[pb.ModelStreamInferResponse] = []
        try:
            for answer in stream(frames(), timeout=60):
                answers.append(answer)
                answered.put(None)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (params, exc.code(), exc.details())
            assert any(k in (exc.details() or "") for k in good), (params, exc.details())
            return
    assert len(answers) == 2, (params, answers)
    last = answers[-1]
    assert not last.error_message and last.infer_response.id == "2", (params, answers)  # the good frame answered
    first = answers[0]
    if first.error_message:
        assert any(k in first.error_message for k in params), (params, first.error_message)
