"""The Open Inference Protocol over real HTTP: every route, JSON and binary data, and tritonclient unchanged."""

from __future__ import annotations

import base64
import concurrent.futures
import struct
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton

from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image
from tests.http.conftest import ADMIN_TOKEN, busy_model
from tests.http.test_image_api import digit_png

PIXELS = np.random.default_rng(0).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)


def test_health_and_server_metadata(server: InProcessServer) -> None:
    with server.client() as c:
        live = c.get("/v2/health/live")  # the status is the answer, and the body says it too (KServe's client)
        assert (live.status_code, live.json()) == (200, {"live": True})
        ready = c.get("/v2/health/ready")
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
        meta = c.get("/v2").json()
        assert meta["name"] == "visionserve"
        assert {"classification", "binary_tensor_data", "model_repository", "statistics"} <= set(meta["extensions"])


def test_model_metadata_ready_and_config(server: InProcessServer) -> None:
    with server.client() as c:
        for prefix in ("/v2/models/digits", "/v2/models/digits/versions/1"):
            meta = c.get(prefix).json()
            assert meta["name"] == "digits" and meta["versions"] == ["1"] and meta["platform"] == "onnxruntime_onnx"
            assert [i["name"] for i in meta["inputs"]] == ["INPUT"]  # IMAGE is listed under "digits.image"
            assert meta["outputs"] == [{"name": "LOGITS", "datatype": "FP32", "shape": [-1, 10]}]
            assert meta["parameters"]["devices"] == "cpu" and meta["parameters"]["state"] == "READY"
            ready = c.get(prefix + "/ready")
            assert (ready.status_code, ready.json()) == (200, {"name": "digits", "ready": True})
            config = c.get(prefix + "/config").json()
            assert config["max_batch_size"] == 32 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
        assert c.get("/v2/models/nope").status_code == 404
        assert c.get("/v2/models/digits/versions/7/ready").status_code == 404


def _bytes_tensor(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(x)) + x for x in items)


def test_infer_json_uint8_and_fp32_agree(server: InProcessServer) -> None:
    with server.client() as c:
        a = c.post(
            "/v2/models/digits/infer",
            json={
                "id": "r1",
                "inputs": [
                    {"name": "INPUT", "datatype": "UINT8", "shape": [2, 3, 32, 32], "data": PIXELS.ravel().tolist()}
                ],
            },
        )
        b = c.post(
            "/v2/models/digits/infer",
            json={
                "inputs": [
                    {
                        "name": "INPUT",
                        "datatype": "FP32",
                        "shape": [2, 3, 32, 32],
                        "data": PIXELS.astype(float).ravel().tolist(),
                    }
                ]
            },
        )
    assert a.status_code == 200 and b.status_code == 200, a.text + b.text
    out = a.json()
    assert out["id"] == "r1" and out["model_name"] == "digits" and out["model_version"] == "1"
    assert out["outputs"][0]["shape"] == [2, 10] and len(out["outputs"][0]["data"]) == 20
    np.testing.assert_allclose(out["outputs"][0]["data"], b.json()["outputs"][0]["data"], rtol=1e-6)


def test_infer_binary_images_with_classification(server: InProcessServer) -> None:
    images = [digit_png(i)[0] for i in range(3)]
    blob = _bytes_tensor(images)
    header = {
        "inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": len(blob)}}],
        "outputs": [{"name": "LOGITS", "parameters": {"classification": 2, "binary_data": False}}],
    }
    import json

    head = json.dumps(header).encode()
    with server.client() as c:
        r = c.post(
            "/v2/models/digits/infer",
            content=head + blob,
            headers={"Inference-Header-Content-Length": str(len(head)), "content-type": "application/octet-stream"},
        )
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == "BYTES" and out["shape"] == [3, 2]
    score, index, label = out["data"][0].split(":")
    assert float(score) and label == index


def test_infer_json_images_are_base64(server: InProcessServer) -> None:
    png, _ = digit_png(1)
    body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(png).decode()]}]}
    with server.client() as c:
        r = c.post("/v2/models/digits/infer", json=body)
    assert r.status_code == 200 and r.json()["outputs"][0]["shape"] == [1, 10]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": [1, 3, 8, 8], "data": [0] * 192}]},
            "shape [N, 3, 32, 32]",
        ),
        ({"inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": [1, 3, 32, 32], "data": [1, 2]}]}, "does not fit"),
        ({"inputs": [{"name": "PIXELS", "datatype": "UINT8", "shape": [1], "data": [1]}]}, "unknown input"),
        (
            {"inputs": [{"name": "INPUT", "datatype": "FP32", "shape": [1, 3, 32, 32], "data": [300.0] * 3072}]},
            "0..255",
        ),
        ({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": ["!!not base64!!"]}]}, "base64"),
        ({"inputs": []}, "exactly one input"),
        ({"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [0], "data": []}]}, "holds no images"),
        ({"inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": [0, 3, 32, 32], "data": []}]}, "no images"),
        ({"nonsense": 1}, "v2 protocol"),
    ],
)
def test_bad_tensors_are_400(server: InProcessServer, body: dict[str, Any], message: str) -> None:
    with server.client() as c:
        r = c.post("/v2/models/digits/infer", json=body)
    assert r.status_code == 400 and message in r.json()["error"], r.text


def test_a_corrupt_image_in_v2_names_its_index(server: InProcessServer) -> None:
    good, _ = digit_png(0)
    body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [2],
                        "data": [base64.b64encode(good).decode(), base64.b64encode(b"junk").decode()]}]}  # fmt: skip
    with server.client() as c:
        r = c.post("/v2/models/digits/infer", json=body)
    assert r.status_code == 400 and r.json()["error"].startswith("image 1:")


def test_tritonclient_works_unchanged(server: InProcessServer) -> None:
    client = triton.InferenceServerClient(url=server.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("digits")
    assert client.get_model_metadata("digits")["name"] == "digits"
    images = [digit_png(i) for i in range(4)]
    image_input = triton.InferInput("IMAGE", [4], "BYTES")
    image_input.set_data_from_numpy(np.array([png for png, _ in images], dtype=np.object_), binary_data=True)
    classes = client.infer(
        "digits", [image_input], outputs=[triton.InferRequestedOutput("LOGITS", binary_data=True, class_count=3)]
    )
    top = classes.as_numpy("LOGITS")
    assert top.shape == (4, 3)
    labels = [int(row[0].decode().split(":")[1]) for row in top]

    pixel_input = triton.InferInput("INPUT", list(PIXELS.shape), "UINT8")
    pixel_input.set_data_from_numpy(PIXELS, binary_data=True)
    logits = client.infer("digits", [pixel_input], outputs=[triton.InferRequestedOutput("LOGITS", binary_data=True)],
                          timeout=5_000_000, priority=1).as_numpy("LOGITS")  # fmt: skip
    assert logits.shape == (2, 10) and logits.dtype == np.float32

    plain = client.infer("digits", [image_input], outputs=[triton.InferRequestedOutput("LOGITS", binary_data=False)])
    assert list(plain.as_numpy("LOGITS").argmax(1)) == labels
    stats = client.get_inference_statistics("digits")["model_stats"][0]
    assert stats["inference_count"] >= 10 and stats["inference_stats"]["success"]["count"] >= 3


def test_statistics_count_what_was_sent(server: InProcessServer) -> None:
    with server.client() as c:
        before = c.get("/v2/models/digits2/stats").json()["model_stats"][0]
        for _ in range(3):
            c.post(
                "/v2/models/digits2/infer",
                json={
                    "inputs": [
                        {"name": "INPUT", "datatype": "UINT8", "shape": [2, 3, 32, 32], "data": PIXELS.ravel().tolist()}
                    ]
                },
            )
        after = c.get("/v2/models/digits2/stats").json()["model_stats"][0]
        everything = c.get("/v2/models/stats").json()["model_stats"]
    assert after["inference_count"] - before["inference_count"] == 6
    assert after["inference_stats"]["success"]["count"] - before["inference_stats"]["success"]["count"] == 3
    assert {s["name"] for s in everything} >= {"digits", "digits2", "slow"}


def test_repository_routes_need_the_admin_token(server: InProcessServer) -> None:
    with server.client() as c:
        assert c.post("/v2/repository/index").status_code == 403
        assert c.post("/v2/repository/index", headers={"Authorization": "Bearer wrong"}).status_code == 403
        auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        index = c.post("/v2/repository/index", headers=auth).json()
        assert {"name": "digits", "version": "1", "state": "READY"} in index
        assert c.post("/v2/repository/models/digits2/unload", headers=auth).status_code == 200
        assert c.get("/v2/models/digits2").status_code == 404
        assert c.post("/v2/repository/models/digits2/load", headers=auth).status_code == 200
        assert c.get("/v2/models/digits2/ready").status_code == 200
        assert c.post("/v2/repository/models/nope/load", headers=auth).status_code == 404


def _flood(server: InProcessServer, model: str, n: int = 12) -> list[httpx.Response]:
    """``n`` concurrent requests while the slow model's only instance computes another: a queue of 2 overflows."""
    image = encode_image(random_image(224, 224), "JPEG")

    def one(_: int = 0) -> httpx.Response:
        with server.client() as c:
            return c.post(f"/v1/models/{model}/classify", content=image, headers={"content-type": "image/jpeg"})

    with busy_model(server.url, model, one) as first, concurrent.futures.ThreadPoolExecutor(n) as pool:
        flood = list(pool.map(one, range(n)))
        return [first.result(), *flood]


@pytest.mark.parametrize(("model", "status"), [("slow", 503), ("slow429", 429)])
def test_overload_is_refused_at_once_with_retry_after(server: InProcessServer, model: str, status: int) -> None:
    responses = _flood(server, model)
    refused = [r for r in responses if r.status_code == status]
    assert refused, [r.status_code for r in responses]
    assert responses[0].status_code == 200  # what kept the instance busy was computed
    assert all(r.headers["retry-after"] == "1" and "queue full" in r.json()["error"] for r in refused)
    assert {r.status_code for r in responses} <= {200, status}  # nothing else: no 500, no hang


def test_a_request_whose_deadline_passes_in_the_queue_is_504(server: InProcessServer) -> None:
    image = encode_image(random_image(224, 224), "JPEG")

    def busy() -> httpx.Response:
        with server.client() as c:  # keeps the slow model's only instance busy
            return c.post("/v1/models/slow/classify", content=image, headers={"content-type": "image/jpeg"})

    with busy_model(server.url, "slow", busy) as first:
        with server.client() as c:
            body = {"parameters": {"timeout": 1},  # one microsecond
                    "inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": [1, 3, 224, 224],
                                "parameters": {"binary_data_size": 3 * 224 * 224}}]}  # fmt: skip
            import json

            head = json.dumps(body).encode()
            r = c.post("/v2/models/slow/infer", content=head + bytes(3 * 224 * 224),
                       headers={"Inference-Header-Content-Length": str(len(head))})  # fmt: skip
        first.result()
    assert r.status_code == 504 and "deadline" in r.json()["error"]
