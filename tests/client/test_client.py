"""The Python client against a real server, and its retry policy against a scripted one."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
from PIL import Image

from service.client import AsyncClient, Client, ClientError, ImageResult, Prediction, RetryPolicy, discover, sniff
from service.client.retry import parse_retry_after
from service.inprocess import InProcessServer
from service.launcher import free_port
from tests.client.conftest import MAX_IMAGES, digit_pixels
from tests.conftest import encode_image

ROOT = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(backoff_s=0.01, max_backoff_s=0.05, max_attempts=4)


def four_kinds(tmp_path: Path) -> list[object]:
    """The same digit as a path, as bytes, as a PIL image and as a numpy array (the same pixels)."""
    big, _ = digit_pixels(3)
    path = tmp_path / "three.png"
    path.write_bytes(encode_image(big, "PNG"))
    return [path, encode_image(big, "PNG"), Image.fromarray(big), big]


def test_sync_client_takes_paths_bytes_pil_and_numpy(client_server: InProcessServer, tmp_path: Path) -> None:
    images = four_kinds(tmp_path)
    with Client(client_server.url, model="digits") as client:
        results = client.classify(images, top_k=3)
    assert [type(r) for r in results] == [ImageResult] * 4
    assert all(r.ok and r.model == "digits" and r.version == 1 for r in results), results
    assert all(len(r.predictions or []) == 3 for r in results)
    assert all(isinstance(p, Prediction) for r in results for p in r.predictions or [])
    assert len({msgspec.json.encode(r.predictions) for r in results}) == 1  # the same pixels, the same answer
    assert results[0].filename == "three.png" and results[2].filename == "image-2.png"
    scores = [p.score for p in results[0].predictions or []]
    assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + 1e-6


def test_one_image_alone_and_a_bad_image_in_a_list(client_server: InProcessServer, tmp_path: Path) -> None:
    images = four_kinds(tmp_path)
    with Client(client_server.url, model="digits") as client:
        alone = client.classify(images[3], top_k=1)  # not a list: one image
        mixed = client.classify([images[0], b"this is no image", images[1]])
        lone_bad = client.classify(b"\x89PNG\r\n\x1a\n broken")  # a request of one bad image: its own error
    assert len(alone) == 1 and alone[0].ok
    assert [r.ok for r in mixed] == [True, False, True]
    assert mixed[1].error and "not a recognised image" in mixed[1].error
    assert len(lone_bad) == 1 and not lone_bad[0].ok and lone_bad[0].error


def test_a_long_list_is_split_to_the_server_limit(client_server: InProcessServer) -> None:
    pngs = [encode_image(digit_pixels(i)[0], "PNG") for i in range(11)]
    with Client(client_server.url, model="digits", max_images_per_request=8) as client:
        results = client.classify(pngs, top_k=1)
        assert client.max_images_per_request == MAX_IMAGES  # learnt from the server's 413
    assert len(results) == 11 and all(r.ok for r in results)
    hits = sum(r.top1 is not None and r.top1.label == str(digit_pixels(i)[1]) for i, r in enumerate(results))
    assert hits >= 8  # a briefly trained model on real digits, in order: far above chance (1 in 10)


def test_async_client_answers_as_the_sync_one(client_server: InProcessServer, tmp_path: Path) -> None:
    images = four_kinds(tmp_path)

    async def go() -> list[ImageResult]:
        async with AsyncClient(client_server.url, model="digits", max_images_per_request=1) as client:
            return await client.classify(images * 2, top_k=2)

    results = asyncio.run(go())
    assert len(results) == 8 and all(r.ok for r in results)
    with Client(client_server.url, model="digits") as client:
        sync = client.classify(images, top_k=2)
    assert [r.predictions for r in results[:4]] == [r.predictions for r in sync]


def test_an_unknown_model_raises_with_its_status(client_server: InProcessServer) -> None:
    with Client(client_server.url, model="nope") as client, pytest.raises(ClientError) as info:
        client.classify(b"irrelevant")
    assert info.value.status == 404 and "nope" in str(info.value)


# ---- the retry policy, against a server that does as it is told ------------------------------------------------


class Scripted:
    """A scripted server, as an httpx transport: answers each POST with the next step of ``script``: (503 or 429,
    Retry-After), "drop" (the connection closes with no answer) or "ok" (200 with one result per file sent)."""

    def __init__(self, script: list[object]) -> None:
        self.script = list(script)
        self.seen: list[float] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(time.monotonic())
        step = self.script.pop(0) if self.script else "ok"
        if step == "drop":
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
        if isinstance(step, tuple):
            status, retry_after = step
            return httpx.Response(status, headers={"Retry-After": retry_after}, json={"error": "overloaded"})
        files = request.read().count(b'filename="')
        answer = {"model": "m", "version": 7, "results": [{"predictions": [{"label": "a", "index": 0, "score": 1.0}]}]}
        return httpx.Response(200, json={**answer, "results": answer["results"] * files})


def test_overload_and_dropped_connections_are_retried_honouring_retry_after() -> None:
    scripted = Scripted([(503, "1"), (429, "0"), "drop", "ok"])
    with Client("http://scripted", model="m", retry=FAST, transport=httpx.MockTransport(scripted)) as client:
        results = client.classify([b"\xff\xd8\xff one", b"\xff\xd8\xff two"])
        assert client.retries == 3 and client.requests_sent == 4
    assert [r.top1 for r in results] == [Prediction("a", 0, 1.0)] * 2 and results[0].version == 7
    gaps = np.diff(scripted.seen)
    assert gaps[0] >= 1.0  # the server's Retry-After: 1, though the backoff alone would wait 10 ms


def test_the_policy_gives_up_after_its_attempts() -> None:
    scripted = Scripted([(503, "0")] * 10)

    async def go() -> None:
        transport = httpx.MockTransport(scripted)
        async with AsyncClient("http://scripted", model="m", retry=FAST, transport=transport) as client:
            await client.classify(b"x")

    with pytest.raises(ClientError) as info:
        asyncio.run(go())
    assert info.value.status == 503 and info.value.retries == 3 and len(scripted.seen) == 4
    assert "overloaded" in str(info.value)


def test_a_server_that_is_not_there_fails_within_the_policy() -> None:
    with Client(f"http://127.0.0.1:{free_port()}", model="m", retry=FAST) as client, pytest.raises(ClientError) as info:
        client.classify(b"x")
    assert info.value.status is None and info.value.retries == 3 and "cannot reach" in str(info.value)


def test_retry_policy_waits() -> None:
    policy = RetryPolicy(backoff_s=0.5, max_backoff_s=3.0, max_retry_after_s=10.0)
    for retry, ceiling in ((1, 0.5), (2, 1.0), (3, 2.0), (4, 3.0), (9, 3.0)):
        waits = [policy.delay_s(retry) for _ in range(50)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits) and len(set(waits)) > 1  # jittered
    assert 2.0 <= policy.delay_s(1, "2") <= 2.5
    assert 10.0 <= policy.delay_s(1, "3600") <= 10.5  # capped
    later = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    assert 25 <= (parse_retry_after(later) or 0) <= 30
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None
    bounded = RetryPolicy(max_attempts=100, backoff_s=10.0, max_total_s=1.0).start()
    assert bounded.next_delay_s() is None  # a 5-10 s wait would pass the 1 s total


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF"])
def test_image_files_are_told_by_their_content(fmt: str, tmp_path: Path) -> None:
    data = encode_image(digit_pixels(0)[0], fmt)
    assert sniff(data[:16]) == f"image/{fmt.lower()}"
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "no-extension").write_bytes(data)
    (tmp_path / "a.png").write_bytes(b"text, whatever the name says")
    (tmp_path / "b.txt").write_bytes(b"RIFF....WAVEfmt ")  # a RIFF file that is not WebP
    assert discover([tmp_path]) == ([tmp_path / "sub" / "no-extension"], 2)


def test_the_readme_examples_run(client_server: InProcessServer) -> None:
    """The README's "Python client" examples, run as they are but against the test server."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Python client", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    outputs = []
    for code in blocks:
        code = code.replace("http://127.0.0.1:8000", client_server.url)
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    expected = re.search(r"```text\n(.*?)```", section, re.S)
    assert expected and outputs[0] == expected.group(1)
    assert outputs[1].count("Prediction(") == 2
