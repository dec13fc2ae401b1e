"""Every numeric request parameter at its extremes, against one real server, in every API: the image API's query
strings, the v2 JSON ``parameters`` (Python's ``json`` NaN and Infinity too), gRPC's ``InferParameter`` of each kind
and model versions in paths. Each is refused 400 (gRPC INVALID_ARGUMENT) with a message that names the parameter and
its range, never a 500, and counted as ``bad_input``; the largest values in range are served."""

from __future__ import annotations

import json
import math
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc

from service.core.protocol import method_path, pb
from tests.grpc.conftest import GrpcServer
from tests.http.conftest import metric_value, wait_for_metric
from tests.http.test_image_api import digit_png

MAX = 2**63 - 1
PIXELS = np.random.default_rng(7).integers(0, 256, (1, 3, 32, 32), dtype=np.uint8)
TIMEOUT = f"a number of microseconds from 0 to {MAX}"
PRIORITY = f"an integer from 0 to {MAX}"
CLASSIFICATION = f"an integer from 1 to {MAX}"

# ---- the image API's query strings ---------------------------------------------------------------------------

QUERY = [
    *[("top_k", v, "an integer from 1 to 1000") for v in
      ["-1", "0", "1001", "18446744073709551616", "99999999999999999999999", "1.5", "1.0", "1e-400", "NaN",
       "Infinity", "-Infinity", "inf", ""]],
    *[("priority", v, f"an integer from 0 to {MAX}") for v in
      ["-1", "9223372036854775808", "18446744073709551616", "1.5", "1e-400", "NaN", "inf"]],
    *[("timeout_ms", v, "a number > 0 and <= 9223372036854776") for v in
      ["0", "-1", "NaN", "nan", "inf", "Infinity", "-Infinity", "1e400", "1e-400", "9223372036854775808000"]],
]  # fmt: skip


def classify(both: GrpcServer, params: dict[str, str], path: str = "/v1/models/digits/classify") -> httpx.Response:
    png = digit_png(0)[0]
    return httpx.post(both.http.url + path, params=params, content=png, headers={"content-type": "image/png"},
                      timeout=30)  # fmt: skip


@pytest.mark.parametrize(("name", "sent", "allowed"), QUERY, ids=[f"{n}={v}" for n, v, _ in QUERY])
def test_image_api_query_numbers_at_their_extremes_are_400(
    both: GrpcServer, name: str, sent: str, allowed: str
) -> None:
    r = classify(both, {name: sent})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == f"{name} must be {allowed}, got {sent!r} (query parameter)"


def test_image_api_takes_the_largest_values_in_range(both: GrpcServer) -> None:
    r = classify(both, {"top_k": "1000", "priority": str(MAX), "timeout_ms": "9223372036854775"})
    assert r.status_code == 200, r.text
    assert len(r.json()["results"][0]["predictions"]) == 10  # top_k past the classes gives them all


# ---- v2 JSON parameters ---------------------------------------------------------------------------------------


def v2_body(where: str, value: Any) -> tuple[bytes, dict[str, str]]:
    """A valid one-image v2 request with ``value`` at ``where``, written by Python's json (NaN and Infinity as it
    writes them); binary_data_size with the pixels in the binary part."""
    tensor: dict[str, Any] = {"name": "INPUT", "datatype": "UINT8", "shape": list(PIXELS.shape)}
    doc: dict[str, Any] = {"inputs": [tensor]}
    if where == "binary_data_size":
        tensor["parameters"] = {"binary_data_size": value}
        head = json.dumps(doc).encode()
        return head + PIXELS.tobytes(), {"Inference-Header-Content-Length": str(len(head))}
    tensor["data"] = PIXELS.ravel().tolist()
    if where in ("classification", "binary_data"):
        doc["outputs"] = [{"name": "LOGITS", "parameters": {where: value}}]
    else:
        doc["parameters"] = {where: value}
    return json.dumps(doc).encode(), {"content-type": "application/json"}


def shown(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return repr(value)


NAMES = {
    "timeout": ("parameters.timeout", TIMEOUT),
    "priority": ("parameters.priority", PRIORITY),
    "classification": ("outputs[0].parameters.classification", CLASSIFICATION),
    "binary_data_output": ("parameters.binary_data_output", "true or false"),
    "binary_data": ("outputs[0].parameters.binary_data", "true or false"),
    "binary_data_size": ("inputs[0].parameters.binary_data_size", "an integer from 0 to 3072"),
}
V2 = [
    *[("timeout", v) for v in [-1, MAX + 1, 2**64, 10**30, 1e300, -0.5, True, "NaN", "Infinity", "5"]],
    *[("priority", v) for v in [-1, MAX + 1, 2**64, 10**30, 1.5, 2.0, True, "1"]],
    *[("classification", v) for v in [0, -1, 2.5, 2.0, MAX + 1, 10**30, True, "2"]],
    ("binary_data_output", 1), ("binary_data_output", "true"), ("binary_data", 0),
    *[("binary_data_size", v) for v in [-1, 2.5, 3073, 10**30, True]],
    # Python's json writes these, which JSON has not (RFC 8259): refused by name all the same.
    *[("timeout", v) for v in [math.nan, math.inf, -math.inf]],
    ("priority", math.nan), ("classification", math.inf), ("binary_data_size", math.nan),
]  # fmt: skip


@pytest.mark.parametrize(("where", "value"), V2, ids=[f"{w}={shown(v)}" for w, v in V2])
def test_v2_parameters_at_their_extremes_are_400_naming_them(both: GrpcServer, where: str, value: Any) -> None:
    body, headers = v2_body(where, value)
    r = httpx.post(both.http.url + "/v2/models/digits/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 400, r.text
    name, allowed = NAMES[where]
    if where == "binary_data_size" and isinstance(value, float) and math.isnan(value):
        allowed = "an integer >= 0"  # not JSON, so no header to read how many bytes follow it
    assert r.json()["error"].startswith(f"{name} must be {allowed}"), r.json()["error"]
    assert f", got {shown(value)}" in r.json()["error"]


def test_v2_a_number_past_float64_is_refused_by_name(both: GrpcServer) -> None:
    body, headers = v2_body("timeout", 0)
    body = body.replace(b'"timeout": 0', b'"timeout": 1e400')
    r = httpx.post(both.http.url + "/v2/models/digits/infer", content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"].startswith(f"parameters.timeout must be {TIMEOUT}")
    assert ", got 1e400 (JSON has no NaN or Infinity" in r.json()["error"]


def test_v2_takes_the_largest_values_in_range(both: GrpcServer) -> None:
    body, _ = v2_body("classification", MAX)
    doc = json.loads(body)
    doc["parameters"] = {"timeout": MAX, "priority": MAX}
    r = httpx.post(both.http.url + "/v2/models/digits/infer", json=doc, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0]["shape"] == [1, 10]  # k capped at the classes, as Triton caps it


# ---- gRPC InferParameter ----------------------------------------------------------------------------------------

GRPC = [
    *[("timeout", kind, v) for kind, v in [("int64_param", -1), ("uint64_param", 2**64 - 1), ("uint64_param", MAX + 1),
      ("double_param", math.nan), ("double_param", math.inf), ("double_param", -math.inf), ("double_param", 1e300),
      ("bool_param", True), ("string_param", "5")]],
    *[("priority", kind, v) for kind, v in [("int64_param", -1), ("uint64_param", MAX + 1), ("uint64_param", 2**64 - 1),
      ("double_param", 1.5), ("double_param", math.nan), ("bool_param", True), ("string_param", "1")]],
    *[("classification", kind, v) for kind, v in [("int64_param", 0), ("int64_param", -1), ("double_param", 2.5),
      ("uint64_param", 2**64 - 1), ("double_param", math.inf), ("bool_param", True)]],
]  # fmt: skip


def infer_request(where: str, kind: str, value: Any) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name="digits", raw_input_contents=[PIXELS.tobytes()])
    request.inputs.add(name="INPUT", datatype="UINT8", shape=list(PIXELS.shape))
    output = request.outputs.add(name="LOGITS")
    params = output.parameters if where == "classification" else request.parameters
    setattr(params[where], kind, value)
    return request


def grpc_infer(both: GrpcServer, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    with both.channel() as channel:
        call = channel.unary_unary(
            method_path("ModelInfer"),
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        return call(request, timeout=30)


@pytest.mark.parametrize(("where", "kind", "value"), GRPC, ids=[f"{w}:{k}={shown(v)}" for w, k, v in GRPC])
def test_grpc_parameters_at_their_extremes_are_invalid_argument(
    both: GrpcServer, where: str, kind: str, value: Any
) -> None:
    with pytest.raises(grpc.RpcError) as info:
        grpc_infer(both, infer_request(where, kind, value))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    name, allowed = NAMES[where]
    details = info.value.details()  # type: ignore[attr-defined]
    assert details.startswith(f"{name} must be {allowed}") and f", got {shown(value)}" in details, details


def test_grpc_takes_the_largest_values_in_range(both: GrpcServer) -> None:
    client = tgrpc.InferenceServerClient(both.target)
    tensor = tgrpc.InferInput("INPUT", list(PIXELS.shape), "UINT8")
    tensor.set_data_from_numpy(PIXELS)
    out = tgrpc.InferRequestedOutput("LOGITS", class_count=MAX)  # tritonclient sends uint64 priority, int64 timeout
    result = client.infer("digits", [tensor], outputs=[out], priority=MAX, timeout=MAX)
    assert result.as_numpy("LOGITS").shape == (1, 10)


# ---- model versions ---------------------------------------------------------------------------------------------

VERSIONS = ["-1", "0", "1.0", "%201", "1_0", "%D9%A1", "9223372036854775808", "99999999999999999999999"]


@pytest.mark.parametrize("version", VERSIONS)
def test_a_version_that_is_not_one_is_400_in_every_route(both: GrpcServer, version: str) -> None:
    message = f"model version must be a positive integer, from 1 to {MAX}"
    with httpx.Client(base_url=both.http.url, timeout=30) as c:
        for method, path in [("GET", ""), ("GET", "/ready"), ("GET", "/config"), ("GET", "/stats"), ("POST", "/infer")]:
            r = c.request(method, f"/v2/models/digits/versions/{version}{path}", json={"inputs": []})
            assert r.status_code == 400, (path, r.status_code, r.text)
            if path != "/ready":  # readiness answers in the status alone
                assert r.json()["error"].startswith(message), r.text
    r = classify(both, {}, f"/v1/models/digits/versions/{version}/classify")
    assert r.status_code == 400 and r.json()["error"].startswith(message), r.text
    with both.channel() as channel:
        call = channel.unary_unary(
            method_path("ModelMetadata"),
            request_serializer=pb.ModelMetadataRequest.SerializeToString,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            call(pb.ModelMetadataRequest(name="digits", version=httpx.URL("/" + version).path[1:]), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]


# ---- counted -----------------------------------------------------------------------------------------------------


def test_every_refusal_is_counted_as_bad_input(both: GrpcServer) -> None:
    """A refused parameter is a request for the model all the same: ``bad_input`` in visionserve_requests_total."""
    labels = {"model": "digits", "outcome": "bad_input"}
    before_http = metric_value(both.http.url, "visionserve_requests_total", protocol="http", **labels)
    before_grpc = metric_value(both.http.url, "visionserve_requests_total", protocol="grpc", **labels)
    for params in ({"top_k": "NaN"}, {"priority": "-1"}, {"timeout_ms": "inf"}, {"top_k": "1e-400"}):
        assert classify(both, params).status_code == 400
    for where, value in [("timeout", math.nan), ("priority", 2**64), ("classification", 0.5), ("binary_data", 1)]:
        body, headers = v2_body(where, value)
        assert httpx.post(both.http.url + "/v2/models/digits/infer", content=body, headers=headers,
                          timeout=30).status_code == 400  # fmt: skip
    for where, kind, value in [("timeout", "double_param", math.inf), ("priority", "int64_param", -1),
                               ("classification", "uint64_param", 2**64 - 1)]:  # fmt: skip
        with pytest.raises(grpc.RpcError):
            grpc_infer(both, infer_request(where, kind, value))
    after_http = wait_for_metric(
        both.http.url, "visionserve_requests_total", before_http + 8, protocol="http", **labels
    )
    after_grpc = wait_for_metric(
        both.http.url, "visionserve_requests_total", before_grpc + 3, protocol="grpc", **labels
    )
    assert (after_http, after_grpc) == (before_http + 8, before_grpc + 3)
