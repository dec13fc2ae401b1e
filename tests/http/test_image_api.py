"""The image API over real HTTP against a real server process."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image
from sklearn.datasets import load_digits

from service.inprocess import InProcessServer
from tests.conftest import encode_image, random_image
from tests.service.test_preprocess import _png_with_size


def digit_png(index: int) -> tuple[bytes, int]:
    raw = load_digits()
    pixels = np.rint(raw.images[index] * (255.0 / 16.0)).astype(np.uint8)
    return encode_image(pixels, "PNG"), int(raw.target[index])


def test_raw_image_is_classified_with_top_k_and_server_timing(server: InProcessServer) -> None:
    with server.client() as client:
        hits = 0
        for index in range(20):
            png, label = digit_png(index)
            r = client.post("/v1/models/digits/classify?top_k=3", content=png, headers={"content-type": "image/png"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "digits" and body["version"] == 1 and len(body["results"]) == 1
            predictions = body["results"][0]["predictions"]
            assert len(predictions) == 3
            assert predictions[0]["score"] >= predictions[1]["score"] >= predictions[2]["score"]
            assert 0 < sum(p["score"] for p in predictions) <= 1.0 + 1e-6
            assert predictions[0]["label"] == str(predictions[0]["index"])
            hits += predictions[0]["index"] == label
            timing = r.headers["server-timing"]
            assert all(f"{stage};dur=" in timing for stage in ("queue", "preprocess", "compute"))
        assert hits >= 14  # a briefly trained model, on real digits: far above chance (2 of 20)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP"])
def test_every_accepted_media_type(server: InProcessServer, fmt: str) -> None:
    data = encode_image(random_image(60, 80), fmt)
    with server.client() as client:
        r = client.post("/v1/models/digits/classify", content=data, headers={"content-type": f"image/{fmt.lower()}"})
    assert r.status_code == 200 and "predictions" in r.json()["results"][0]


@pytest.mark.parametrize(
    ("content", "ctype", "status", "message"),
    [
        (b"this is no image", "image/png", 400, "not a recognised image"),
        (b"", "image/png", 400, "empty image"),
        (_png_with_size(50_000, 50_000), "image/png", 413, "over the limit"),
        (b"GIF89a", "image/gif", 415, "Content-Type image/gif is not taken"),
        (b"{}", "application/json", 415, "is not taken"),
    ],
    ids=["corrupt", "empty", "huge-dimensions", "gif", "json"],
)
def test_a_bad_raw_body_fails_the_request_clearly(
    server: InProcessServer, content: bytes, ctype: str, status: int, message: str
) -> None:
    with server.client() as client:
        r = client.post("/v1/models/digits/classify", content=content, headers={"content-type": ctype})
    assert r.status_code == status
    assert message in r.json()["error"] and "Traceback" not in r.text
    assert "server-timing" in r.headers


def test_multipart_answers_each_image_in_order_and_bad_ones_alone(server: InProcessServer) -> None:
    good, _ = digit_png(0)
    truncated = encode_image(random_image(100, 100), "JPEG")[:300]
    files = [
        ("files", ("good.png", good, "image/png")),
        ("files", ("bad.jpg", truncated, "image/jpeg")),
        ("files", ("empty.png", b"", "image/png")),
        ("files", ("good2.png", good, "image/png")),
    ]
    with server.client() as client:
        r = client.post("/v1/models/digits/classify?top_k=2", files=files)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x.get("filename") for x in results] == ["good.png", "bad.jpg", "empty.png", "good2.png"]
    assert "predictions" in results[0] and "predictions" in results[3]
    assert results[0]["predictions"] == results[3]["predictions"]
    assert "truncated" in results[1]["error"] and "empty" in results[2]["error"]


def test_too_many_images_is_413(server: InProcessServer) -> None:
    good, _ = digit_png(0)
    files = [("files", (f"{i}.png", good, "image/png")) for i in range(5)]  # the server allows 4
    with server.client() as client:
        r = client.post("/v1/models/digits/classify", files=files)
    assert r.status_code == 413 and "over the limit of 4" in r.json()["error"]


def test_a_body_over_the_limit_is_413(server: InProcessServer) -> None:
    with server.client() as client:
        r = client.post(
            "/v1/models/digits/classify", content=b"\xff\xd8\xff" + b"0" * (2 * 1024 * 1024),
            headers={"content-type": "image/jpeg"},
        )  # fmt: skip
    assert r.status_code == 413 and "error" in r.json()


def test_unknown_model_and_version_are_404(server: InProcessServer) -> None:
    png, _ = digit_png(0)
    with server.client() as client:
        r = client.post("/v1/models/nope/classify", content=png, headers={"content-type": "image/png"})
        assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
        r = client.post("/v1/models/digits/versions/9/classify", content=png, headers={"content-type": "image/png"})
        assert r.status_code == 404 and "no version 9" in r.json()["error"]
        r = client.post("/v1/models/digits/versions/1/classify", content=png, headers={"content-type": "image/png"})
        assert r.status_code == 200


def test_bad_query_values_are_400(server: InProcessServer) -> None:
    png, _ = digit_png(0)
    with server.client() as client:
        r = client.post("/v1/models/digits/classify?top_k=0", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 400 and "error" in r.json()


def test_the_models_list_and_the_demo_page(server: InProcessServer) -> None:
    with server.client() as client:
        models = {m["name"]: m for m in client.get("/v1/models").json()}
        assert models["digits"]["device"] == "cpu" and models["digits"]["state"] == "READY"
        assert "no usable GPU" in models["digits"]["note"]
        page = client.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "/v1/models/" in page.text and "Server-Timing" in page.text
        schema = client.get("/schema/openapi.json").json()
        assert "/v1/models/{model}/classify" in schema["paths"] and "/v2/models/{model}/infer" in schema["paths"]
        assert client.get("/docs", follow_redirects=True).status_code == 200


def test_image_decodes_like_pil(server: InProcessServer) -> None:
    """The served result equals classifying the pixels sent through v2 INPUT after our own preprocessing."""
    png, _ = digit_png(3)
    from models import get_architecture
    from service.core.preprocess import preprocess_image

    pixels = preprocess_image(png, get_architecture("smallcnn").spec)
    body = {
        "inputs": [{"name": "INPUT", "datatype": "UINT8", "shape": [1, 3, 32, 32], "data": pixels.ravel().tolist()}]
    }
    with server.client() as client:
        v2 = client.post("/v2/models/digits/infer", json=body).json()["outputs"][0]["data"]
        img = client.post("/v1/models/digits/classify?top_k=10", content=png, headers={"content-type": "image/png"})
    best = max(range(10), key=lambda i: v2[i])
    assert img.json()["results"][0]["predictions"][0]["index"] == best
    assert Image.open(io.BytesIO(png)).size == (8, 8)
