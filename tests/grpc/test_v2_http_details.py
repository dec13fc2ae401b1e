"""The HTTP v2 details existing clients rely on: compressed bodies (and compression bombs), compressed answers,
metadata a tool can fill on its own, max_batch_size, KServe health answers, and the rule for BYTES in JSON."""

from __future__ import annotations

import base64
import gzip
import json
import zlib
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as thttp

from tests.conftest import encode_image, random_image
from tests.grpc.conftest import GrpcServer
from tests.http.test_image_api import digit_png

PIXELS = np.random.default_rng(3).integers(0, 256, (2, 3, 32, 32), dtype=np.uint8)


def http(both: GrpcServer) -> httpx.Client:
    return both.http.client()


def _pixels_body(array: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": list(array.shape),
                        "data": array.ravel().tolist()}]}  # fmt: skip


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_tritonclient_compressed_requests_and_answers(both: GrpcServer, algorithm: str) -> None:
    client = thttp.InferenceServerClient(both.http.url.removeprefix("http://"))
    tensor = thttp.InferInput("INPUT", list(PIXELS.shape), "UINT8")
    tensor.set_data_from_numpy(PIXELS)
    plain = client.infer("digits", [tensor]).as_numpy("LOGITS")
    packed = client.infer(
        "digits", [tensor], request_compression_algorithm=algorithm, response_compression_algorithm=algorithm
    ).as_numpy("LOGITS")
    np.testing.assert_array_equal(plain, packed)


def test_a_raw_deflate_stream_is_taken_too(both: GrpcServer) -> None:
    packer = zlib.compressobj(6, zlib.DEFLATED, -zlib.MAX_WBITS)
    body = packer.compress(json.dumps(_pixels_body(PIXELS)).encode()) + packer.flush()
    with http(both) as c:
        r = c.post("/v2/models/digits/infer", content=body,
                   headers={"content-type": "application/json", "content-encoding": "deflate"})  # fmt: skip
    assert r.status_code == 200, r.text


def test_answers_are_compressed_only_when_asked_and_large_enough(both: GrpcServer) -> None:
    big = np.zeros((32, 3, 32, 32), np.uint8)
    with http(both) as c:
        asked = c.post("/v2/models/digits/infer", json=_pixels_body(big), headers={"accept-encoding": "gzip"})
        plain = c.post("/v2/models/digits/infer", json=_pixels_body(big), headers={"accept-encoding": "identity"})
        small = c.post("/v2/models/digits/infer", json=_pixels_body(big[:1]), headers={"accept-encoding": "gzip"})
    assert asked.headers["content-encoding"] == "gzip" and "content-encoding" not in plain.headers
    assert asked.json() == plain.json()  # httpx inflates it
    assert int(asked.headers["content-length"]) < int(plain.headers["content-length"])
    assert "content-encoding" not in small.headers  # a few logits are not worth compressing


def test_a_compression_bomb_is_413_and_the_server_lives_on(both: GrpcServer) -> None:
    # 64 MiB of zeros inflate from 64 KiB; the server's limit here is 1 MiB, after decompression.
    bomb = gzip.compress(b"0" * (64 * 1024 * 1024), compresslevel=9)
    assert len(bomb) < 1024 * 1024
    with http(both) as c:
        r = c.post("/v2/models/digits/infer", content=bomb,
                   headers={"content-type": "application/json", "content-encoding": "gzip"})  # fmt: skip
        assert r.status_code == 413 and "once decompressed" in r.json()["error"], r.text
        assert c.get("/v2/health/live").status_code == 200


@pytest.mark.parametrize(
    ("encoding", "body", "status", "message"),
    [
        ("br", b"x", 415, "Content-Encoding 'br' is not taken"),
        ("gzip", b"not gzip at all", 400, "not valid gzip"),
        ("gzip", gzip.compress(b'{"inputs": []}', mtime=0)[:-6], 400, "truncated"),
    ],
)
def test_bad_encodings(both: GrpcServer, encoding: str, body: bytes, status: int, message: str) -> None:
    with http(both) as c:
        r = c.post("/v2/models/digits/infer", content=body,
                   headers={"content-type": "application/json", "content-encoding": encoding})  # fmt: skip
    assert r.status_code == status and message in r.json()["error"], r.text


def _fill(meta: dict[str, Any]) -> dict[str, Any]:
    """What a generic tool does: random data for every input the metadata lists, batch 1."""
    rng = np.random.default_rng(0)
    inputs = []
    for tensor in meta["inputs"]:
        shape = [1 if d == -1 else d for d in tensor["shape"]]
        assert tensor["datatype"] == "UINT8", tensor  # the tensor name lists what random data can fill
        inputs.append({"name": tensor["name"], "datatype": "UINT8", "shape": shape,
                       "data": rng.integers(0, 256, int(np.prod(shape))).tolist()})  # fmt: skip
    return {"inputs": inputs}


def test_metadata_is_honest_a_tool_can_fill_it(both: GrpcServer) -> None:
    with http(both) as c:
        meta = c.get("/v2/models/digits").json()
        assert [i["name"] for i in meta["inputs"]] == ["INPUT"]
        r = c.post("/v2/models/digits/infer", json=_fill(meta))
        assert r.status_code == 200, r.text
        image_meta = c.get("/v2/models/digits.image/versions/1").json()
        assert image_meta["inputs"] == [{"name": "IMAGE", "datatype": "BYTES", "shape": [-1]}]
        config = c.get("/v2/models/digits.image/config").json()
        assert [i["name"] for i in config["input"]] == ["IMAGE"] and config["max_batch_size"] == 32
        png = base64.b64encode(digit_png(0)[0]).decode()
        body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [1], "data": [png]}]}
        assert c.post("/v2/models/digits.image/infer", json=body).status_code == 200
        # Either name still takes the other input: clients written for either way keep working.
        assert c.post("/v2/models/digits/infer", json=body).status_code == 200
        assert c.post("/v2/models/digits.image/infer", json=_fill(meta)).status_code == 200
        assert c.get("/v2/models/digits.image/ready").status_code == 200
        assert c.get("/v2/models/nope.image").status_code == 404


def test_max_batch_size_refuses_larger_v2_batches_while_the_image_api_splits(both: GrpcServer) -> None:
    image = encode_image(random_image(64, 64), "JPEG")
    blob = base64.b64encode(image).decode()
    with http(both) as c:
        body = {"inputs": [{"name": "IMAGE", "datatype": "BYTES", "shape": [2], "data": [blob, blob]}]}
        v2 = c.post("/v2/models/slow/infer", json=body)
        assert v2.status_code == 400, v2.text
        assert v2.json()["error"].startswith("a batch of 2 is over the max_batch_size of 1 of model 'slow'")
        files = [("file", (f"{i}.jpg", image, "image/jpeg")) for i in range(2)]
        split = c.post("/v1/models/slow/classify", files=files)
    assert split.status_code == 200 and len(split.json()["results"]) == 2, split.text


def test_health_answers_in_the_status_and_says_it_in_the_body(both: GrpcServer) -> None:
    """Triton's clients read the status; KServe's client parses the body (the Open Inference Protocol's)."""
    with http(both) as c:
        for path, body in (
            ("/v2/health/live", {"live": True}),
            ("/v2/health/ready", {"ready": True}),
            ("/v2/models/digits/ready", {"name": "digits", "ready": True}),
            ("/v2/models/digits/versions/1/ready", {"name": "digits", "ready": True}),
        ):
            r = c.get(path)
            assert (r.status_code, r.json()) == (200, body), path
        assert c.get("/v2/models/nope/ready").status_code == 404  # a 4xx: false, as the KServe spec says


@pytest.mark.parametrize(
    ("data", "parameters", "status", "message"),
    [
        # tritonclient's JSON form: the string itself; a PNG is not text, so this is what a client writes for text.
        (["hello"], None, 400, "is the string itself"),
        # marked base64, as a client that knows it sends binary in JSON says so
        ([base64.b64encode(digit_png(1)[0]).decode()], {"content_type": "base64"}, 200, ""),
        (["!!!"], {"content_type": "base64"}, 400, "marked base64"),
        # unmarked, but wholly base64 (no image file can be): what earlier clients sent
        ([base64.b64encode(digit_png(2)[0]).decode()], None, 200, ""),
    ],
)
def test_bytes_in_json(
    both: GrpcServer, data: list[str], parameters: dict[str, str] | None, status: int, message: str
) -> None:
    tensor: dict[str, Any] = {"name": "IMAGE", "datatype": "BYTES", "shape": [len(data)], "data": data}
    if parameters:
        tensor["parameters"] = parameters
    with http(both) as c:
        r = c.post("/v2/models/digits/infer", json={"inputs": [tensor]})
    assert r.status_code == status, r.text
    if message:
        assert message in r.json()["error"], r.text


def test_tritonclient_json_bytes_of_base64_text_work(both: GrpcServer) -> None:
    """tritonclient with binary_data=False sends each BYTES element as its UTF-8 string: base64 text passes."""
    client = thttp.InferenceServerClient(both.http.url.removeprefix("http://"))
    tensor = thttp.InferInput("IMAGE", [2], "BYTES")
    files = np.array([base64.b64encode(digit_png(i)[0]) for i in range(2)], dtype=np.object_)
    tensor.set_data_from_numpy(files, binary_data=False)
    top = client.infer("digits.image", [tensor], outputs=[thttp.InferRequestedOutput("LOGITS", class_count=1)])
    assert top.as_numpy("LOGITS").shape == (2, 1)
