"""The Open Inference Protocol over gRPC, against a real server process, through tritonclient.grpc unchanged and
through a bare channel (typed contents, which tritonclient never sends)."""

from __future__ import annotations

import concurrent.futures
import re
import time
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException, deserialize_bytes_tensor

from service.core.protocol import method_path, pb
from tests.conftest import encode_image, random_image
from tests.grpc.conftest import ADMIN_TOKEN, GrpcServer
from tests.http.conftest import busy_model
from tests.http.test_image_api import digit_png

PIXELS = np.random.default_rng(1).integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


def client(both: GrpcServer) -> tgrpc.InferenceServerClient:
    return tgrpc.InferenceServerClient(both.target)


def pixels_input(array: np.ndarray) -> tgrpc.InferInput:
    tensor = tgrpc.InferInput("INPUT", list(array.shape), "UINT8")
    tensor.set_data_from_numpy(array)
    return tensor


def images_input(files: list[bytes]) -> tgrpc.InferInput:
    tensor = tgrpc.InferInput("IMAGE", [len(files)], "BYTES")
    tensor.set_data_from_numpy(np.array(files, dtype=np.object_))
    return tensor


def eventually(check: Callable[[], bool], timeout_s: float = 30) -> bool:
    """True once ``check()`` is: a model's load or unload reaches every front end shortly after the call."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


def status_of(call: Any) -> tuple[str, str]:
    """(gRPC status name, message) of a tritonclient call that must fail."""
    with pytest.raises(InferenceServerException) as info:
        call()
    status = str(info.value.status())
    return status.removeprefix("StatusCode."), str(info.value.message())


def test_health_and_server_metadata(both: GrpcServer) -> None:
    c = client(both)
    assert c.is_server_live() and c.is_server_ready()
    assert c.is_model_ready("digits") and c.is_model_ready("digits", "1") and c.is_model_ready("digits.image")
    assert not c.is_model_ready("nope") and not c.is_model_ready("digits", "7")
    meta = c.get_server_metadata(as_json=True)
    assert meta["name"] == "visionserve" and meta["version"]
    assert {"classification", "binary_tensor_data", "model_repository", "statistics"} <= set(meta["extensions"])


def test_model_metadata_lists_one_input_per_name_and_config_agrees(both: GrpcServer) -> None:
    c = client(both)
    tensor = c.get_model_metadata("digits", as_json=True)
    assert [(i["name"], i["datatype"], [int(d) for d in i["shape"]]) for i in tensor["inputs"]] == [
        ("INPUT", "UINT8", [-1, 3, 32, 32])
    ]
    assert tensor["versions"] == ["1"] and tensor["platform"] == "onnxruntime_onnx"
    image = c.get_model_metadata("digits.image", "1", as_json=True)
    assert image["name"] == "digits.image" and [i["name"] for i in image["inputs"]] == ["IMAGE"]
    assert [(o["name"], o["datatype"]) for o in image["outputs"]] == [("LOGITS", "FP32")]
    config = c.get_model_config("digits").config
    assert config.name == "digits" and config.max_batch_size == 32
    assert [(i.name, list(i.dims)) for i in config.input] == [("INPUT", [3, 32, 32])]
    assert config.dynamic_batching.max_queue_delay_microseconds == 2000
    assert [i.name for i in c.get_model_config("digits.image").config.input] == ["IMAGE"]
    assert status_of(lambda: c.get_model_metadata("nope")) == ("NOT_FOUND", "unknown model 'nope'")
    assert status_of(lambda: c.get_model_config("digits", "7"))[0] == "NOT_FOUND"


def test_infer_raw_pixels_agrees_with_http_and_keeps_the_request_id(both: GrpcServer) -> None:
    result = client(both).infer("digits", [pixels_input(PIXELS)], request_id="req-7", priority=1, timeout=5_000_000)
    logits = result.as_numpy("LOGITS")
    assert logits.shape == (3, 10) and logits.dtype == np.float32
    response = result.get_response()
    assert response.id == "req-7" and response.model_name == "digits" and response.model_version == "1"
    body = {"inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": list(PIXELS.shape),
                        "data": PIXELS.ravel().tolist()}]}  # fmt: skip
    http = httpx.post(both.http.url + "/v2/models/digits/infer", json=body, timeout=60).json()
    np.testing.assert_allclose(logits.ravel(), http["outputs"][0]["data"], rtol=1e-6)


def _raw_infer(both: GrpcServer, request: pb.ModelInferRequest) -> pb.ModelInferResponse:
    with both.channel() as channel:
        call = channel.unary_unary(
            method_path("ModelInfer"),
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        response: pb.ModelInferResponse = call(request, timeout=60)
        return response


def test_typed_contents_answer_like_raw_contents(both: GrpcServer) -> None:
    typed = pb.ModelInferRequest(model_name="digits")
    tensor = typed.inputs.add(name="INPUT", datatype="UINT8", shape=list(PIXELS.shape))
    tensor.contents.uint_contents.extend(int(v) for v in PIXELS.ravel())
    fp32 = pb.ModelInferRequest(model_name="digits")
    tensor = fp32.inputs.add(name="INPUT", datatype="FP32", shape=list(PIXELS.shape))
    tensor.contents.fp32_contents.extend(float(v) for v in PIXELS.ravel())
    files = [digit_png(i)[0] for i in range(2)]
    image = pb.ModelInferRequest(model_name="digits.image")
    image.inputs.add(name="IMAGE", datatype="BYTES", shape=[2]).contents.bytes_contents.extend(files)
    image.outputs.add(name="LOGITS").parameters["classification"].int64_param = 2

    expected = client(both).infer("digits", [pixels_input(PIXELS)]).as_numpy("LOGITS")
    for request in (typed, fp32):
        response = _raw_infer(both, request)
        assert [(o.name, o.datatype, list(o.shape)) for o in response.outputs] == [("LOGITS", "FP32", [3, 10])]
        got = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(3, 10)
        np.testing.assert_allclose(got, expected, rtol=1e-6)
    response = _raw_infer(both, image)
    assert [(o.datatype, list(o.shape)) for o in response.outputs] == [("BYTES", [2, 2])]
    strings = [s.decode() for s in deserialize_bytes_tensor(response.raw_output_contents[0])]
    assert len(strings) == 4 and all(re.fullmatch(r"[0-9.]+:(\d):\1", s) for s in strings), strings


def test_images_with_the_classification_extension(both: GrpcServer) -> None:
    images = [digit_png(i) for i in range(4)]
    result = client(both).infer(
        "digits.image",
        [images_input([png for png, _ in images])],
        outputs=[tgrpc.InferRequestedOutput("LOGITS", class_count=3)],
    )
    top = result.as_numpy("LOGITS")
    assert top.shape == (4, 3)
    for row in top:
        score, index, label = row[0].decode().split(":")
        assert float(score) and index == label
    hits = sum(int(row[0].decode().split(":")[1]) == label for row, (_, label) in zip(top, images, strict=True))
    assert hits >= 3  # the trained digits model reads real digits


@pytest.mark.parametrize(
    ("inputs", "status", "message"),
    [
        ([pixels_input(np.zeros((33, 3, 32, 32), np.uint8))], "INVALID_ARGUMENT", "max_batch_size of 32"),
        ([pixels_input(np.zeros((1, 3, 8, 8), np.uint8))], "INVALID_ARGUMENT", "shape [N, 3, 32, 32]"),
        ([images_input([b"junk"])], "INVALID_ARGUMENT", "image 0:"),
        ([images_input([b"x"] * 5)], "RESOURCE_EXHAUSTED", "over the limit of 4"),
        ([], "INVALID_ARGUMENT", "exactly one input"),
    ],
)
def test_bad_requests_carry_the_http_message(
    both: GrpcServer, inputs: list[tgrpc.InferInput], status: str, message: str
) -> None:
    got, text = status_of(lambda: client(both).infer("digits", inputs))
    assert got == status and message in text, text


def test_unknown_output_and_model(both: GrpcServer) -> None:
    c = client(both)
    got = status_of(lambda: c.infer("digits", [pixels_input(PIXELS)], outputs=[tgrpc.InferRequestedOutput("X")]))
    assert got == ("INVALID_ARGUMENT", "unknown output 'X': this model has LOGITS")
    assert status_of(lambda: c.infer("nope", [pixels_input(PIXELS)]))[0] == "NOT_FOUND"


def _flood(both: GrpcServer, model: str, n: int = 8) -> list[str]:
    """n concurrent single-image requests on a slow model with a queue of 2: the status of each."""
    image = encode_image(random_image(224, 224), "JPEG")

    def one(_: int = 0) -> str:
        try:
            client(both).infer(model, [images_input([image])])
            return "OK"
        except InferenceServerException as exc:
            return str(exc.status()).removeprefix("StatusCode.")

    with busy_model(both.http.url, model, one) as first, concurrent.futures.ThreadPoolExecutor(n) as pool:
        rest = list(pool.map(one, range(n)))  # n at once while the model's only instance computes the first
        return [first.result(), *rest]


@pytest.mark.parametrize(("model", "refused"), [("slow", "UNAVAILABLE"), ("slow429", "RESOURCE_EXHAUSTED")])
def test_a_full_queue_is_refused_with_the_configured_code(both: GrpcServer, model: str, refused: str) -> None:
    seen = _flood(both, model)
    assert seen[0] == "OK" and refused in seen, seen
    assert set(seen) <= {"OK", refused}, seen


def test_a_deadline_passed_in_the_queue_is_deadline_exceeded(both: GrpcServer) -> None:
    image = encode_image(random_image(224, 224), "JPEG")
    c = client(both)

    def late(_: int) -> str:
        try:
            c.infer("slow", [images_input([image])], timeout=1)  # parameters.timeout: 1 microsecond
            return "OK"
        except InferenceServerException as exc:
            return str(exc.status()).removeprefix("StatusCode.")

    def busy() -> None:
        c.infer("slow", [images_input([image])])

    with busy_model(both.http.url, "slow", busy) as first:  # the instance busy: the late one waits in the queue
        seen = late(0)
        first.result()
    assert seen == "DEADLINE_EXCEEDED", seen


def test_statistics_and_metrics_count_grpc_requests(both: GrpcServer) -> None:
    c = client(both)
    before = c.get_inference_statistics("digits2", as_json=True)["model_stats"][0]
    for _ in range(3):
        c.infer("digits2", [pixels_input(PIXELS)])
    after = c.get_inference_statistics("digits2", "1", as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 9
    http = httpx.get(both.http.url + "/v2/models/digits2/stats", timeout=30).json()["model_stats"][0]
    assert http["inference_count"] == int(after["inference_count"])
    everything = c.get_inference_statistics(as_json=True)["model_stats"]
    assert {"digits", "digits2"} <= {s["name"] for s in everything}
    metrics = httpx.get(both.http.url + "/metrics", timeout=30).text
    line = re.search(r'visionserve_requests_total\{[^}]*model="digits2"[^}]*outcome="success",protocol="grpc"[^}]*\} '
                     r"([0-9.]+)", metrics)  # fmt: skip
    assert line and float(line.group(1)) >= 3, metrics[:2000]


def test_repository_rpcs_need_the_admin_token(both: GrpcServer) -> None:
    c = client(both)
    status, message = status_of(lambda: c.get_model_repository_index())
    assert status == "PERMISSION_DENIED" and "Authorization: Bearer" in message
    assert status_of(lambda: c.unload_model("digits2", headers={"authorization": "Bearer wrong"}))[0] == (
        "PERMISSION_DENIED"
    )
    index = c.get_model_repository_index(headers=ADMIN, as_json=True)["models"]
    assert {"name": "digits", "version": "1", "state": "READY"} in index


def test_unload_and_load_over_grpc(both: GrpcServer) -> None:
    c = client(both)
    c.unload_model("digits2", headers=ADMIN)
    try:
        assert eventually(lambda: not c.is_model_ready("digits2"))
        assert status_of(lambda: c.infer("digits2", [pixels_input(PIXELS)]))[0] == "NOT_FOUND"
        status, message = status_of(lambda: c.load_model("digits2", headers=ADMIN, files={"file:1/x": b"1"}))
        assert status == "INVALID_ARGUMENT" and "only 'config'" in message
    finally:
        c.load_model("digits2", headers=ADMIN)
    assert eventually(lambda: c.is_model_ready("digits2"))
    assert c.infer("digits2", [pixels_input(PIXELS)]).as_numpy("LOGITS").shape == (3, 10)


def test_what_a_server_of_images_does_not_do_is_unimplemented(both: GrpcServer) -> None:
    assert status_of(lambda: client(both).get_system_shared_memory_status())[0] == "UNIMPLEMENTED"


def test_a_bare_channel_gets_grpc_codes_not_http_statuses(both: GrpcServer) -> None:
    with both.channel() as channel:
        call = channel.unary_unary(
            method_path("ModelMetadata"),
            request_serializer=pb.ModelMetadataRequest.SerializeToString,
            response_deserializer=pb.ModelMetadataResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as info:
            call(pb.ModelMetadataRequest(name="digits", version="x"), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "positive integer" in info.value.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_grpc_compressed_messages(both: GrpcServer, algorithm: str) -> None:
    c = client(both)
    plain = c.infer("digits", [pixels_input(PIXELS)]).as_numpy("LOGITS")
    packed = c.infer("digits", [pixels_input(PIXELS)], compression_algorithm=algorithm).as_numpy("LOGITS")
    np.testing.assert_array_equal(plain, packed)
