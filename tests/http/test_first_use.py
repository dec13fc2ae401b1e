"""What a new user meets first, against a real server: /docs with no network, a refused query parameter named with
its range and counted, and /metrics' Content-Type."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from service.inprocess import InProcessServer
from tests.http.conftest import metric_value, wait_for_metric
from tests.http.test_image_api import digit_png

ATTRIBUTE_URLS = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.IGNORECASE)


def test_docs_loads_every_file_from_this_server(server: InProcessServer) -> None:
    with server.client(follow_redirects=True) as client:
        page = client.get("/docs")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "SwaggerUIBundle(" in page.text
        urls = ATTRIBUTE_URLS.findall(page.text)
        external = [u for u in urls if urlsplit(u).netloc or u.startswith("//")]
        assert not external, f"/docs loads files from elsewhere: {external}"
        assert "cdn" not in page.text.lower()
        wanted = {"swagger-ui-bundle.js": "javascript", "swagger-ui-standalone-preset.js": "javascript",
                  "swagger-ui.css": "text/css", "favicon-32x32.png": "image/png"}  # fmt: skip
        for name, kind in wanted.items():
            url = next((u for u in urls if u.endswith("/" + name)), None)
            assert url is not None, f"/docs does not reference {name}: {urls}"
            asset = client.get(url)
            assert asset.status_code == 200, (url, asset.status_code)
            assert kind in asset.headers["content-type"]
            assert asset.headers["content-type"].count("charset") <= 1
            assert len(asset.content) > 500
        folder = url.rsplit("/", 1)[0]
        assert client.get(folder + "/index.j2").status_code == 404  # only the files the page loads are served
        assert client.get("/docs/assets/swagger-ui-0.0.1/swagger-ui.css").status_code == 404


def test_an_out_of_range_top_k_is_named_with_its_range_and_counted(server: InProcessServer) -> None:
    png, _ = digit_png(0)
    labels = {"model": "digits", "protocol": "http", "outcome": "bad_input"}
    before = metric_value(server.url, "visionserve_requests_total", **labels)
    with server.client() as client:
        for sent in ("0", "1001", "three"):
            r = client.post(
                "/v1/models/digits/classify", params={"top_k": sent}, content=png,
                headers={"content-type": "image/png"},
            )  # fmt: skip
            assert r.status_code == 400, r.text
            message = r.json()["error"]
            assert message == f"top_k must be an integer from 1 to 1000, got {sent!r} (query parameter)", message
        r = client.post("/v1/models/digits/classify", params={"timeout_ms": "-1"}, content=png,
                        headers={"content-type": "image/png"})  # fmt: skip
        assert r.status_code == 400
        assert r.json()["error"].startswith("timeout_ms must be a number > 0 and <= 9223372036854776, got '-1'")
        # An unknown model is a 404 whatever its parameters, and counts under no model.
        r = client.post("/v1/models/nope/classify", params={"top_k": "0"}, content=png,
                        headers={"content-type": "image/png"})  # fmt: skip
        assert r.status_code in (400, 404)
        assert client.post("/v1/models/digits/classify", params={"top_k": "2"}, content=png,
                           headers={"content-type": "image/png"}).status_code == 200  # fmt: skip
    # Front ends report to the engine, which renders /metrics: wait (bounded) for the four refusals to arrive.
    after = wait_for_metric(server.url, "visionserve_requests_total", before + 4, **labels)
    assert after == before + 4


def test_metrics_names_its_charset_once(server: InProcessServer) -> None:
    with server.client() as client:
        r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
