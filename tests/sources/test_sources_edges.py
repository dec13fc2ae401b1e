"""Sources' bodies at their edges, in one process (docs/testing.md): a number no option takes (``Infinity``, NaN,
``1e999``, past int64 or past what ``int`` reads) refused naming the field, on ``POST`` and on ``PATCH`` of a
running source; a ``file://`` name past NAME_MAX refused naming ``url``; and a URL's secrets (user information, every
query value) in no answer, log line or metric, the host still shown right.

Each was a 500, or (the URL) shown as ``http://***@b.com&token=SECRET``. The cameras are an MJPEG server in a
thread (tests/sources/video.py) and a closed port on 127.0.0.1: nothing needs the network or GStreamer.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.core.settings import ServerSettings
from service.inprocess import InProcessServer
from tests.sources.video import MjpegServer

pytest.importorskip("av", reason="sources need PyAV (the video extra)")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "edges-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HUGE = "1" * 4301
# Each a JSON literal some numeric field cannot take, and the fields it is tried on.
NUMBERS = ["Infinity", "-Infinity", "NaN", "1e999", "1e300", "100000000000000000000000000000", HUGE, "1" * 400]
FIELDS = ["top_k", "max_fps", "max_age_ms"]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("edges-media")
    (root / "clip.mp4").write_bytes(b"not read: every case here is refused before the file is opened")
    return root


@pytest.fixture(scope="module")
def server(media: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    repo = tmp_path_factory.mktemp("edges-repo")
    shutil.copytree(ROOT / "examples" / "model_repository" / "digits", repo / "digits")
    settings = ServerSettings(repository=str(repo), port=0, grpc_port=0, admin_token=TOKEN, source_root=str(media),
                              source_connect_timeout_s=5.0)  # fmt: skip
    with InProcessServer(settings) as running:
        yield running


@pytest.fixture(scope="module")
def camera() -> Iterator[MjpegServer]:
    with MjpegServer(fps=2, width=64, height=48) as running:
        yield running


def send(server: InProcessServer, method: str, path: str, body: str) -> httpx.Response:
    with server.client() as client:
        return client.request(method, path, content=body, headers={**AUTH, "content-type": "application/json"})


def wait_for(server: InProcessServer, id: str, states: tuple[str, ...], timeout_s: float = 30.0) -> dict[str, Any]:
    """The source's document once its state is one of ``states`` (states that last)."""
    deadline = time.monotonic() + timeout_s
    with server.client() as client:
        while True:
            doc: dict[str, Any] = client.get(f"/v1/sources/{id}", headers=AUTH).json()
            if doc["state"] in states or time.monotonic() > deadline:
                return doc
            time.sleep(0.05)


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("number", NUMBERS, ids=[n[:12] for n in NUMBERS])
def test_a_number_no_field_takes_is_400_naming_it_on_post(
    server: InProcessServer, media: Path, field: str, number: str
) -> None:
    body = f'{{"url": "file://{media / "clip.mp4"}", "model": "digits", "{field}": {number}}}'
    answer = send(server, "POST", "/v1/sources", body)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error.startswith(field) and len(error) < 300, error


def test_a_number_no_field_takes_is_400_naming_it_on_patch(server: InProcessServer, camera: MjpegServer) -> None:
    started = send(server, "POST", "/v1/sources", f'{{"id": "cam", "url": "{camera.url}", "model": "digits"}}')
    assert started.status_code == 201, started.text
    try:
        assert wait_for(server, "cam", ("running", "failed"))["state"] == "running"
        for field in FIELDS:
            for number in NUMBERS:
                answer = send(server, "PATCH", "/v1/sources/cam", f'{{"{field}": {number}}}')
                assert answer.status_code == 400 and answer.json()["error"].startswith(field), (number, answer.text)
        assert send(server, "PATCH", "/v1/sources/cam", '{"top_k": 2}').json()["options"] == {"top_k": 2}
    finally:
        send(server, "DELETE", "/v1/sources/cam", "")


def test_a_file_name_past_name_max_is_400_naming_url(server: InProcessServer, media: Path) -> None:
    body = f'{{"url": "file://{media}/{"a" * 300}.mp4", "model": "digits"}}'
    answer = send(server, "POST", "/v1/sources", body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"].startswith("url: ") and "File name too long" in answer.json()["error"]


def test_a_urls_secrets_are_in_no_answer_log_or_metric(
    server: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    secrets = ("camuser7", "PASSWORD7", "a@b.com", "SECRET7")
    url = "http://camuser7:PASSWORD7@127.0.0.1:9/x?user=a@b.com&token=SECRET7"  # port 9: refused at once
    shown = "http://***@127.0.0.1:9/x?user=***&token=***"
    caplog.set_level(logging.DEBUG)
    answers = [send(server, "POST", "/v1/sources", f'{{"id": "secret", "url": "{url}", "model": "digits"}}')]
    assert answers[0].status_code == 201, answers[0].text
    try:
        doc = wait_for(server, "secret", ("failed",))
        assert doc["state"] == "failed" and doc["url"] == shown and shown in doc["reason"], doc
        with server.client() as client:
            answers += [client.get("/v1/sources", headers=AUTH), client.get("/metrics")]
            # A refused URL's message shows it masked too: the port is no number.
            refused = client.post("/v1/sources", json={"url": "http://u:PASSWORD7@cam:x/y", "model": "digits"},
                                  headers=AUTH)  # fmt: skip
        assert refused.status_code == 400 and "***@cam:x/y" in refused.text, refused.text
        answers.append(refused)
        assert 'source="secret"' in answers[2].text  # metrics name the source by its id
        logged = "\n".join(record.getMessage() for record in caplog.records)
        assert shown in logged  # the URL is logged, masked
        for text in [*(answer.text for answer in answers), str(doc), logged]:
            assert not any(secret in text for secret in secrets), text
    finally:
        send(server, "DELETE", "/v1/sources/secret", "")


def test_a_reader_stuck_in_a_call_it_cannot_leave_counts_against_max_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deleted source whose reader is still inside ``av.open`` (a DNS lookup FFmpeg cannot interrupt, held here by
    a gate) still holds its thread: it counts against ``--max-sources`` until the call returns and the thread ends."""
    import av

    gate = threading.Event()
    opened = threading.Event()

    def stuck_open(*args: Any, **kwargs: Any) -> Any:
        opened.set()
        gate.wait(60)
        raise OSError("the lookup ended")

    monkeypatch.setattr(av, "open", stuck_open)
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples" / "model_repository" / "digits", repo / "digits")
    settings = ServerSettings(repository=str(repo), port=0, grpc_port=0, admin_token=TOKEN, max_sources=1,
                              drain_timeout_s=0.5, state_dir=str(tmp_path / "state"))  # fmt: skip
    body = {"url": "http://camera.invalid/x", "model": "digits"}
    with InProcessServer(settings) as server:
        url = f"{server.url}/v1/sources"
        assert httpx.post(url, json={**body, "id": "stuck"}, headers=AUTH, timeout=30).status_code == 201
        assert opened.wait(30)  # its reader is in the call, and stays there until the gate opens
        deleted = httpx.delete(f"{url}/stuck", headers=AUTH, timeout=30)
        assert deleted.status_code == 200 and deleted.json()["reader_alive"] is True, deleted.text
        refused = httpx.post(url, json={**body, "id": "next"}, headers=AUTH, timeout=30)
        assert refused.status_code == 503 and "readers still ending" in refused.json()["error"], refused.text
        gate.set()  # the lookup returns: the thread ends, and its place is free
        deadline = time.monotonic() + 30
        while (answer := httpx.post(url, json={**body, "id": "next"}, headers=AUTH, timeout=30)).status_code == 503:
            assert time.monotonic() < deadline, answer.text
            time.sleep(0.05)
        assert answer.status_code == 201, answer.text
        httpx.delete(f"{url}/next", headers=AUTH, timeout=30)
