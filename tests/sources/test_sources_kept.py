"""Sources kept across restarts (docs/sources.md, "Kept across restarts"): a real server process, with its state
directory (``--state-dir``), and HTTP MJPEG cameras. The owner of the readers (fe0) killed with SIGKILL and
restarted by the supervisor, and the whole server stopped and started again: every source comes back once (one
connection to its camera, listed once, running), none lost, none twice; DELETE is for good; ``--sources`` rows are
stored in place of the stored rows of their ids; the store is 0600 and no log line holds a URL's secret."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http.conftest import ADMIN_TOKEN, RunningServer, start_server, stop_server
from tests.sources.test_sources_live import connections_to
from tests.sources.video import MjpegServer

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
SECRET = "s3cret-cam-token"
WAIT_S = 90.0  # bounds, not timings: every wait below ends as soon as its state holds


@pytest.fixture
def cameras() -> Iterator[list[MjpegServer]]:
    """Two MJPEG cameras that run until the test ends (a connection lasts 10**6 frames: no reconnects of their own)."""
    with MjpegServer(fps=10, max_frames=10**6) as first, MjpegServer(fps=10, max_frames=10**6) as second:
        yield [first, second]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(ROOT / "examples" / "model_repository" / "digits", root / "digits")
    return root


def serve(repo: Path, state: Path, log: Path, *extra: str) -> RunningServer:
    return start_server(repo, log, "--admin-token", ADMIN_TOKEN, "--state-dir", str(state),
                        "--source-connect-timeout-s", "5", *extra, real_models=("digits",))  # fmt: skip


def body(id: str, camera: MjpegServer) -> dict[str, Any]:
    return {"id": id, "url": f"{camera.url}?token={SECRET}", "model": "digits", "max_fps": 2}


def create(url: str, doc: dict[str, Any]) -> None:
    answer = httpx.post(f"{url}/v1/sources", json=doc, headers=AUTH, timeout=30)
    assert answer.status_code == 201, answer.text


def listed(url: str) -> list[dict[str, Any]]:
    answer = httpx.get(f"{url}/v1/sources", headers=AUTH, timeout=90)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["sources"])


def wait(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def running_once(url: str, ids: set[str], cameras: list[MjpegServer]) -> list[dict[str, Any]]:
    """Waits until every id in ``ids`` is listed exactly once, running and answered, no other is listed, and each
    camera has exactly one connection from the server per source on it; the listing."""
    ports = [port(c) for c in cameras]
    seen: list[dict[str, Any]] = []

    def holds() -> bool:
        nonlocal seen
        seen = listed(url)
        if sorted(doc["id"] for doc in seen) != sorted(ids):
            return False
        if not all(doc["state"] == "running" and doc["frames"]["answered"] > 0 for doc in seen):
            return False
        return [connections_to(port) for port in ports] == [1] * len(ports)

    try:
        wait(holds, f"every source running once: {ids}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; listed: {seen}") from None
    return seen


def test_sources_come_back_once_when_their_front_end_is_killed(
    repo: Path, tmp_path: Path, cameras: list[MjpegServer]
) -> None:
    state = tmp_path / "state"
    running = serve(repo, state, tmp_path / "server.log", "--workers", "2")
    try:
        for id, camera in zip(("door", "yard"), cameras, strict=True):
            create(running.url, body(id, camera))
        before = running_once(running.url, {"door", "yard"}, cameras)
        owner = fe0(running)
        os.kill(owner, signal.SIGKILL)
        wait(lambda: len(running.roles()["frontend"]) == 2 and owner not in running.roles()["frontend"],
             "the supervisor starts fe0 again")  # fmt: skip
        after = running_once(running.url, {"door", "yard"}, cameras)
        assert fe0(running) != owner
        # Started again (the counts begin afresh), answering, and still one connection each, a while later too.
        assert {d["id"]: d["created"] for d in after} != {d["id"]: d["created"] for d in before}
        answered = {d["id"]: d["frames"]["answered"] for d in after}
        wait(lambda: all(d["frames"]["answered"] > answered[d["id"]] for d in listed(running.url)), "answers go on")
        assert [connections_to(port(c)) for c in cameras] == [1, 1]
        # Every front end answers alike, the results stream included.
        for _ in range(4):
            assert sorted(d["id"] for d in listed(running.url)) == ["door", "yard"]
        assert first_result(running.url, "door")["status"] == "result"
    finally:
        stop_server(running)
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert SECRET not in log
    assert stat.S_IMODE((state / "sources.db").stat().st_mode) == 0o600


def test_sources_come_back_once_after_a_restart_changed_and_deleted_for_good(
    repo: Path, tmp_path: Path, cameras: list[MjpegServer]
) -> None:
    state = tmp_path / "state"
    log = tmp_path / "server.log"
    running = serve(repo, state, log)
    try:
        create(running.url, body("door", cameras[0]))
        create(running.url, body("yard", cameras[1]))
        changed = httpx.patch(f"{running.url}/v1/sources/yard", json={"max_fps": 3}, headers=AUTH, timeout=30)
        assert changed.status_code == 200, changed.text
        running_once(running.url, {"door", "yard"}, cameras)
    finally:
        stop_server(running)

    running = serve(repo, state, log)
    try:
        docs = {d["id"]: d for d in running_once(running.url, {"door", "yard"}, cameras)}
        assert docs["yard"]["max_fps"] == 3 and docs["door"]["max_fps"] == 2  # the change was kept
        assert SECRET not in json.dumps(docs)
        gone = httpx.delete(f"{running.url}/v1/sources/door", headers=AUTH, timeout=30)
        assert gone.status_code == 200, gone.text
        running_once(running.url, {"yard"}, cameras[1:])
        wait(lambda: connections_to(port(cameras[0])) == 0, "the deleted source's connection closed")
    finally:
        stop_server(running)

    # --sources: its rows are stored in place of the stored rows of their ids; the other stored rows run too.
    listing = tmp_path / "sources.json"
    listing.write_text(json.dumps([{**body("yard", cameras[1]), "max_fps": 4}, body("gate", cameras[0])]))
    running = serve(repo, state, log, "--sources", str(listing))
    try:
        docs = {d["id"]: d for d in running_once(running.url, {"yard", "gate"}, cameras)}
        assert docs["yard"]["max_fps"] == 4
    finally:
        stop_server(running)
    listing.write_text("[]")
    running = serve(repo, state, log, "--sources", str(listing))
    try:
        running_once(running.url, {"yard", "gate"}, cameras)  # stored rows stay until DELETE
        for id in ("yard", "gate"):
            assert httpx.delete(f"{running.url}/v1/sources/{id}", headers=AUTH, timeout=30).status_code == 200
    finally:
        stop_server(running)

    running = serve(repo, state, log)
    try:
        assert listed(running.url) == []
    finally:
        stop_server(running)
    assert SECRET not in log.read_text(errors="replace")


def port(camera: MjpegServer) -> int:
    return int(camera.url.rsplit(":", 1)[1].split("/")[0])


def fe0(server: RunningServer) -> int:
    """The pid of the front end named fe0 (the owner of the readers), from the launch its supervisor handed it."""
    for pid in server.roles()["frontend"]:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if b'"name":"fe0"' in environ:
            return pid
    raise AssertionError("no front end fe0")


def first_result(url: str, id: str) -> dict[str, Any]:
    with httpx.stream("GET", f"{url}/v1/sources/{id}/results", headers=AUTH, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                message = dict(json.loads(line[5:]))
                if message["status"] in ("result", "ended"):
                    return message
    raise AssertionError("no answer")
