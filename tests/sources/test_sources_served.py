"""Sources against a real server process (docs/sources.md): a file, an RTSP camera and an MJPEG endpoint pulled,
answered to subscribers over Server-Sent Events and WebSocket, managed while running, and admin-only."""

from __future__ import annotations

import itertools
import json
import math
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import ADMIN_TOKEN, RunningServer, start_server, stop_server
from tests.sources.video import write_mp4

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    write_mp4(root / "clip.mp4", frames=30, fps=15, width=160, height=120)
    return root


@pytest.fixture(scope="module")
def served(media: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("sources-repo")
    for name in ("digits", "digits-detect"):
        shutil.copytree(ROOT / "examples" / "model_repository" / name, repo / name)
    log = tmp_path_factory.mktemp("sources-log") / "server.log"
    running = start_server(repo, log, "--admin-token", ADMIN_TOKEN, "--source-root", str(media),
                           real_models=("digits", "digits-detect"))  # fmt: skip
    yield running
    stop_server(running)


def wait_for(url: str, id: str, states: tuple[str, ...], timeout_s: float = 60.0) -> dict[str, Any]:
    """The source's document once its state is one of ``states`` (states that last: ended, failed, running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = httpx.get(f"{url}/v1/sources/{id}", headers=AUTH, timeout=10).json()
        if doc["state"] in states or time.monotonic() > deadline:
            return dict(doc)
        time.sleep(0.1)


def events(url: str, id: str, limit: int = 1000) -> list[dict[str, Any]]:
    """Every Server-Sent Event of the source's results until its ``ended`` (bounded by ``limit``)."""
    out: list[dict[str, Any]] = []
    with httpx.stream("GET", f"{url}/v1/sources/{id}/results", headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data:"):
                out.append(json.loads(line[5:]))
                if out[-1]["status"] == "ended" or len(out) >= limit:
                    break
    return out


def test_a_file_is_answered_frame_by_frame_to_a_subscriber_and_every_frame_is_accounted_for(
    served: RunningServer, media: Path
) -> None:
    # max_age_ms: its limit, 60 s: the point is that every frame is answered, not how old one may grow on a slow
    # machine (the default 500 ms would let a frame that waited on a busy core expire).
    body = {"url": f"file://{media / 'clip.mp4'}", "model": "digits", "pace": "answered", "top_k": 2, "id": "clip",
            "max_age_ms": 60_000}  # fmt: skip
    created = httpx.post(f"{served.url}/v1/sources", json=body, headers=AUTH, timeout=10)
    assert created.status_code == 201, created.text
    doc = wait_for(served.url, "clip", ("ended", "failed"))
    assert doc["state"] == "ended", doc
    frames = doc["frames"]
    # As fast as answered: every frame decoded is computed, none skipped; each frame has exactly one fate.
    assert frames["decoded"] == 30 and frames["answered"] == 30, frames
    assert frames["skipped"] + frames["expired"] + frames["error"] == 0, frames
    assert doc["age_ms"]["p50"] is not None and doc["age_ms"]["p50"] <= doc["age_ms"]["p99"]
    # A subscriber that comes after the end hears that it ended, and why.
    (last,) = events(served.url, "clip")
    assert last["status"] == "ended" and last["state"] == "ended" and "file ended" in last["reason"]


def test_a_subscriber_gets_each_answer_with_its_frame_index_and_time_then_ended(
    served: RunningServer, media: Path
) -> None:
    body = {"url": f"file://{media / 'clip.mp4'}", "model": "digits-detect", "id": "boxes", "score_threshold": 0.1}
    with httpx.Client(timeout=60) as client:
        # Subscribed before it starts: realtime pace (15 fps for 2 s), so the subscription is in place first.
        created = client.post(f"{served.url}/v1/sources", json=body, headers=AUTH)
        assert created.status_code == 201, created.text
        got = events(served.url, "boxes")
    assert got[-1]["status"] == "ended"
    results = [m for m in got if m["status"] == "result"]
    assert results, got
    for message in results:
        assert message["source"] == "boxes" and isinstance(message["frame"], int)
        assert message["width"] == 160 and message["height"] == 120  # boxes in the frame's own pixels
        assert isinstance(message["detections"], list) and message["age_ms"] >= 0
    frames = [m["frame"] for m in results]
    assert frames == sorted(frames) and len(set(frames)) == len(frames)
    pts = [m["pts"] for m in results]
    assert all(b > a for a, b in itertools.pairwise(pts))


def test_every_sources_route_needs_the_admin_token(served: RunningServer) -> None:
    routes = [("GET", "/v1/sources"), ("POST", "/v1/sources"), ("GET", "/v1/sources/x"), ("PATCH", "/v1/sources/x"),
              ("DELETE", "/v1/sources/x"), ("GET", "/v1/sources/x/results")]  # fmt: skip
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            answer = httpx.request(method, served.url + path, headers=headers, json={}, timeout=10)
            assert answer.status_code == 403, (method, path, answer.text)
    wrong = httpx.get(f"{served.url}/v1/sources/x/results?token=wrong", timeout=10)
    assert wrong.status_code == 403
    right = httpx.get(f"{served.url}/v1/sources/nope/results?token={ADMIN_TOKEN}", timeout=10)
    assert right.status_code == 404  # the query's token is taken on the results route


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://127.0.0.1/x.mp4", "scheme"),
        ("file:///etc/hostname", "source root"),
        ("concat:/etc/hostname", "scheme"),
    ],
)
def test_a_url_outside_the_allowed_schemes_or_root_is_refused(served: RunningServer, url: str, words: str) -> None:
    answer = httpx.post(f"{served.url}/v1/sources", json={"url": url, "model": "digits"}, headers=AUTH, timeout=10)
    assert answer.status_code == 400 and words in answer.text.lower(), answer.text


def test_bad_options_are_refused_naming_them(served: RunningServer, media: Path) -> None:
    url = f"file://{media / 'clip.mp4'}"
    cases = [
        ({"url": url, "model": "digits", "max_fps": -1}, "max_fps"),
        ({"url": url, "model": "digits", "score_threshold": 0.5}, "score_threshold"),
        ({"url": url, "model": "digits", "colour": "red"}, "colour"),
        ({"url": url, "model": "nope"}, "nope"),
        ({"url": url}, "model"),
    ]
    for body, words in cases:
        answer = httpx.post(f"{served.url}/v1/sources", json=body, headers=AUTH, timeout=10)
        assert answer.status_code in (400, 404) and words in answer.text, (body, answer.text)


def test_a_subscriber_that_shows_frames_gets_each_answered_frame_as_a_jpeg(served: RunningServer, media: Path) -> None:
    import base64
    import io

    from PIL import Image

    body = {"url": f"file://{media / 'clip.mp4'}", "model": "digits-detect", "id": "shown"}
    assert httpx.post(f"{served.url}/v1/sources", json=body, headers=AUTH, timeout=10).status_code == 201
    got = []
    with httpx.stream("GET", f"{served.url}/v1/sources/shown/results?frames=1", headers=AUTH, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data:"):
                got.append(json.loads(line[5:]))
                if got[-1]["status"] == "ended":
                    break
    results = [m for m in got if m["status"] == "result"]
    # A frame already converted when the subscription came has no picture kept: the first answer at most.
    shown = [m for m in results if "image" in m]
    assert shown and len(shown) >= len(results) - 1, got
    for message in shown:
        picture = Image.open(io.BytesIO(base64.b64decode(message["image"])))
        assert picture.format == "JPEG" and picture.size == (message["width"], message["height"]) == (160, 120)


def test_the_sources_listed_at_start_run_with_the_server(media: Path, tmp_path: Path) -> None:
    """A row that cannot start is logged with its reason and the others start: a wrong scheme, and options whose
    values no check expected (``"classes": 0``, ``"top_k": Infinity``: each was a TypeError or an OverflowError that
    stopped the front end starting, exit 3, again every 30 s)."""
    repo = tmp_path / "repo"
    for name in ("digits", "digits-detect"):
        shutil.copytree(ROOT / "examples" / "model_repository" / name, repo / name)
    clip = f"file://{media / 'clip.mp4'}"
    listed = tmp_path / "sources.json"
    rows = [
        {"id": "bad", "url": "ftp://x/y", "model": "digits"},  # logged; the rest start
        {"id": "nolist", "url": clip, "model": "digits-detect", "classes": 0},
        {"id": "endless", "url": clip, "model": "digits", "top_k": math.inf},  # json writes Infinity
        {"id": "door", "url": clip, "model": "digits", "pace": "answered", "top_k": 1, "max_age_ms": 60_000},
    ]
    listed.write_text(json.dumps(rows))
    running = start_server(repo, tmp_path / "server.log", "--admin-token", ADMIN_TOKEN, "--source-root", str(media),
                           "--sources", str(listed), real_models=("digits", "digits-detect"))  # fmt: skip
    try:
        doc = wait_for(running.url, "door", ("ended", "failed"))
        assert doc["state"] == "ended" and doc["frames"]["answered"] == 30, doc
        assert doc["options"] == {"top_k": 1}
        every = httpx.get(f"{running.url}/v1/sources", headers=AUTH, timeout=10).json()["sources"]
        assert [s["id"] for s in every] == ["door"]
    finally:
        stop_server(running)
    log = (tmp_path / "server.log").read_text()
    assert f"--sources {listed}, source 1 not started: classes must be a list of class labels or indices, got 0" in log
    assert f"--sources {listed}, source 2 not started: top_k must be an integer from 1 to 1000, got Infinity" in log


def test_a_source_whose_frames_are_over_the_pixel_cap_fails_saying_so(media: Path, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "examples" / "model_repository" / "digits", repo / "digits")
    running = start_server(repo, tmp_path / "server.log", "--admin-token", ADMIN_TOKEN, "--source-root", str(media),
                           "--source-max-pixels", "10000")  # fmt: skip
    try:
        body = {"id": "big", "url": f"file://{media / 'clip.mp4'}", "model": "digits"}
        assert httpx.post(f"{running.url}/v1/sources", json=body, headers=AUTH, timeout=10).status_code == 201
        doc = wait_for(running.url, "big", ("ended", "failed"))
        assert doc["state"] == "failed" and "160x120" in doc["reason"] and "10000" in doc["reason"], doc
        assert doc["frames"]["answered"] == 0 and doc["reader_alive"] is False
    finally:
        stop_server(running)


def test_a_file_with_a_corrupt_frame_plays_to_its_end_past_it(served: RunningServer, media: Path) -> None:
    from tests.sources.video import jpeg, moving_picture

    pictures = [jpeg(moving_picture(i, 160, 120)) for i in range(10)]
    pictures[4] = b"\xff\xd8\xff\xdb" + bytes(range(256)) * 8 + b"\xff\xd9"  # a JPEG's markers around garbage
    (media / "broken.mjpeg").write_bytes(b"".join(pictures))
    # Every frame answered however slow the machine: no frame old enough to expire (max_age_ms at its limit).
    body = {"url": f"file://{media / 'broken.mjpeg'}", "model": "digits", "pace": "answered", "id": "broken",
            "max_age_ms": 60_000}  # fmt: skip
    assert httpx.post(f"{served.url}/v1/sources", json=body, headers=AUTH, timeout=10).status_code == 201
    doc = wait_for(served.url, "broken", ("ended", "failed"))
    # Read once through, never again from the start: the bad frame passed over, the nine others answered.
    assert doc["state"] == "ended" and doc["reconnects"] == 0 and doc["decode_errors"] == 1, (doc["reason"], doc)
    assert doc["frames"]["decoded"] == doc["frames"]["answered"] == 9, doc


def test_an_rtsp_camera_may_be_read_over_udp_by_choice_and_nothing_else(served: RunningServer) -> None:
    port = 9  # nothing listens: the source fails, but what it was asked to use shows
    body = {"url": f"rtsp://127.0.0.1:{port}/cam", "model": "digits", "id": "udp", "rtsp_transport": "udp"}
    created = httpx.post(f"{served.url}/v1/sources", json=body, headers=AUTH, timeout=10)
    assert created.status_code == 201 and created.json()["rtsp_transport"] == "udp", created.text
    wait_for(served.url, "udp", ("failed",))
    assert httpx.delete(f"{served.url}/v1/sources/udp", headers=AUTH, timeout=30).status_code == 200
    body |= {"id": "pigeon", "rtsp_transport": "pigeon"}
    refused = httpx.post(f"{served.url}/v1/sources", json=body, headers=AUTH, timeout=10)
    assert refused.status_code == 400 and "rtsp_transport" in refused.text, refused.text
