"""``visionserve watch`` as a user runs it: a real server process pulling a real MP4 file, and the command as a
process of its own, reading the source's answers as Server-Sent Events.

A file source at realtime pace (a long file: 20 s, many times what starting ``watch`` takes on a slow machine) is
still running when ``watch`` subscribes; the test waits until the server counts the subscriber, then switches the
source to ``answered`` pace so the rest of the file goes as fast as it is computed. Frames answered before the
subscription are never sent to it, so the assertions hold whatever the timing: the answers seen are in order, each
frame once, the last one the file's last frame, and then the end. Tests that need no end watch a camera that sends
until the module ends instead.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.client.watch import answer_line, end_line, event_data
from tests.http.conftest import ADMIN_TOKEN, RunningServer, start_server, stop_server
from tests.sources.video import MjpegServer, write_mp4

ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
LONG_FRAMES = 300  # 20 s at 15 fps: time for `watch` to start and subscribe before the file ends
WATCH_TIMEOUT_S = 120.0
FINAL = ("ended", "failed", "stopped")  # a source's states that last


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("watch-media")
    write_mp4(root / "long.mp4", frames=LONG_FRAMES, fps=15, width=160, height=120)
    write_mp4(root / "short.mp4", frames=10, fps=15, width=160, height=120)
    return root


@pytest.fixture(scope="module")
def camera() -> Iterator[MjpegServer]:
    """An HTTP MJPEG camera that sends until the module ends: a source on it runs, and `watch` reads, for as long as
    a test takes (a realtime file can end first on a slow machine: watch then exits 0 before it is signalled)."""
    with MjpegServer(fps=15, width=160, height=120, max_frames=10**6) as server:
        yield server


@pytest.fixture(scope="module")
def served(media: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("watch-repo")
    for name in ("digits", "digits-detect"):
        shutil.copytree(ROOT / "examples" / "model_repository" / name, repo / name)
    log = tmp_path_factory.mktemp("watch-log") / "server.log"
    running = start_server(repo, log, "--admin-token", ADMIN_TOKEN, "--source-root", str(media),
                           real_models=("digits", "digits-detect"))  # fmt: skip
    yield running
    stop_server(running)


def create(url: str, body: dict[str, Any]) -> None:
    answer = httpx.post(f"{url}/v1/sources", json=body, headers=AUTH, timeout=10)
    assert answer.status_code == 201, answer.text


def source(url: str, id: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/v1/sources/{id}", headers=AUTH, timeout=10)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def wait_until(url: str, id: str, done: Any, what: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """The source's document once ``done(doc)`` holds (a state that lasts), polled; fails past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = source(url, id)
        if done(doc):
            return doc
        assert time.monotonic() < deadline, f"{what}: {doc}"
        time.sleep(0.05)


def command(url: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "service.cli", "watch", "--url", url, *flags]


def environment(token: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "VISIONSERVE_ADMIN_TOKEN"}
    if token is not None:
        env["VISIONSERVE_ADMIN_TOKEN"] = token
    return env


def watch(url: str, *flags: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    """``visionserve watch`` run to its end (bounded)."""
    return subprocess.run(command(url, *flags), capture_output=True, text=True, timeout=WATCH_TIMEOUT_S,
                          env=environment(token), cwd=ROOT)  # fmt: skip


def start_watching(url: str, id: str, *flags: str, token: str | None = None) -> subprocess.Popen[str]:
    """``visionserve watch`` on a running source, returned once the server counts it as a subscriber; the source
    must still be running then (a realtime file long enough for the command to start)."""
    # Ctrl-C reaches it as at a terminal: tests/conftest.py un-ignores SIGINT for the whole suite.
    process = subprocess.Popen(command(url, "--source", id, *flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=environment(token), cwd=ROOT)  # fmt: skip
    try:
        doc = wait_until(url, id, lambda d: d["subscribers"] >= 1 or d["state"] in FINAL or process.poll() is not None,
                         "watch did not subscribe")  # fmt: skip
        assert doc["subscribers"] >= 1, f"watch exited, or the source ended, before it subscribed: {doc}"
    except BaseException:
        process.kill()
        process.communicate()
        raise
    return process


def rush(url: str, id: str) -> None:
    """The rest of the file as fast as it is answered."""
    answer = httpx.patch(f"{url}/v1/sources/{id}", json={"pace": "answered"}, headers=AUTH, timeout=10)
    assert answer.status_code == 200, answer.text


def finish(process: subprocess.Popen[str]) -> tuple[int, str, str]:
    try:
        out, err = process.communicate(timeout=WATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"watch did not exit in {WATCH_TIMEOUT_S} s; stdout: {out[-2000:]}; stderr: {err[-2000:]}")
    return process.returncode, out, err


def assert_in_order_to_the_end(frames: list[int], doc: dict[str, Any]) -> None:
    """Each frame seen once, in order, and the last one the file's last: nothing after the subscription lost."""
    assert frames, "no answers"
    assert frames == sorted(set(frames)), frames
    assert frames[-1] == doc["frames"]["decoded"] - 1 == LONG_FRAMES - 1, (frames, doc["frames"])


def test_answers_are_saved_as_json_lines_until_the_source_ends(
    served: RunningServer, media: Path, tmp_path: Path
) -> None:
    body = {"url": f"file://{media / 'long.mp4'}", "model": "digits", "top_k": 2, "id": "saved"}
    create(served.url, body)
    out = tmp_path / "answers.jsonl"
    process = start_watching(served.url, "saved", "--token", ADMIN_TOKEN, "--out", str(out))
    rush(served.url, "saved")
    code, stdout, stderr = finish(process)
    assert code == 0, stderr
    doc = source(served.url, "saved")
    assert doc["state"] == "ended", doc
    lines = out.read_text().splitlines()
    answers = [json.loads(line) for line in lines]
    assert all(a["source"] == "saved" and a["status"] in ("result", "expired", "error") for a in answers), answers
    assert_in_order_to_the_end([a["frame"] for a in answers], doc)
    results = [a for a in answers if a["status"] == "result"]
    assert results, answers
    for result in results:
        assert len(result["predictions"]) == 2 and result["age_ms"] >= 0 and result["version"] >= 1
        assert {"label", "index", "score"} <= set(result["predictions"][0])
    # The end is said on stdout, the file keeps only the answers: one line each.
    said = re.fullmatch(r"source saved ended: (.+) \((\d+) answers, saved to (.+)\)", stdout.strip())
    assert said and "file ended" in said[1] and int(said[2]) == len(lines) and said[3] == str(out), stdout
    # Watching a source that has ended already: its end at once, and no answers.
    again = watch(served.url, "--source", "saved", "--out", str(tmp_path / "after.jsonl"), token=ADMIN_TOKEN)
    assert again.returncode == 0, again.stderr
    assert re.fullmatch(r"source saved ended: .*file ended \(0 answers, saved to .+\)", again.stdout.strip())
    assert (tmp_path / "after.jsonl").read_text() == ""


def test_text_prints_a_line_per_frame_with_its_boxes_then_the_end(served: RunningServer, media: Path) -> None:
    body = {"url": f"file://{media / 'long.mp4'}", "model": "digits-detect", "id": "text"}
    create(served.url, body)
    process = start_watching(served.url, "text", "--token", ADMIN_TOKEN)
    rush(served.url, "text")
    code, stdout, stderr = finish(process)
    assert code == 0, stderr
    *lines, last = stdout.strip().splitlines()
    assert re.fullmatch(rf"source text ended: .*file ended \({len(lines)} answers\)", last), stdout
    line = re.compile(r"frame (\d+)  pts \d+\.\d{3}  age \d+\.\d ms  (\d+ box(es)?(: .+)?|expired.*|error: .*)")
    matches = [line.fullmatch(text) for text in lines]
    assert all(matches), [text for text, m in zip(lines, matches, strict=True) if not m]
    assert_in_order_to_the_end([int(m.group(1)) for m in matches if m], source(served.url, "text"))
    # The digit detector finds boxes in these moving pictures: their labels and scores are shown.
    assert any(re.search(r"box(es)?: \S+ \d\.\d\d", text) for text in lines), lines


def test_count_stops_after_that_many_answers_with_the_token_from_the_environment(
    served: RunningServer, camera: MjpegServer
) -> None:
    create(served.url, {"url": camera.url, "model": "digits", "top_k": 3, "id": "counted"})
    try:
        # Run to its end, not watched subscribing: at 15 fps three answers take 0.2 s, which a poll of the source's
        # subscribers can miss (a fresh-clone run, 2026-11-28); the camera never ends, so only --count stops it.
        done = watch(served.url, "--source", "counted", "--count", "3", "--format", "jsonl", token=ADMIN_TOKEN)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
        assert code == 0, stderr
        answers = [json.loads(line) for line in stdout.splitlines()]
        assert len(answers) == 3 and all(a["source"] == "counted" for a in answers), stdout
        frames = [a["frame"] for a in answers]
        assert frames == sorted(set(frames)), frames
        # The end is said beside the JSON Lines, which a pipe reads as data.
        assert stderr.strip() == "took 3 answers from source counted", stderr
        # The source goes on without its watcher: watch left, it did not stop it.
        assert source(served.url, "counted")["state"] == "running"
    finally:
        httpx.delete(f"{served.url}/v1/sources/counted", headers=AUTH, timeout=30)


def test_option_flags_change_the_source_first_and_a_refused_one_stops_with_status_2(
    served: RunningServer, camera: MjpegServer
) -> None:
    create(served.url, {"url": camera.url, "model": "digits-detect", "id": "changed"})
    try:
        done = watch(served.url, "--source", "changed", "--count", "1", "--score-threshold", "0.9", token=ADMIN_TOKEN)
        assert done.returncode == 0, done.stderr
        assert source(served.url, "changed")["options"]["score_threshold"] == 0.9
        refused = watch(served.url, "--source", "changed", "--classes", "no-such-class", token=ADMIN_TOKEN)
        assert refused.returncode == 2 and "400" in refused.stderr and "classes" in refused.stderr, refused.stderr
        assert refused.stdout == ""
        assert source(served.url, "changed")["options"]["score_threshold"] == 0.9
    finally:
        httpx.delete(f"{served.url}/v1/sources/changed", headers=AUTH, timeout=30)


def test_ctrl_c_stops_watching_quietly_with_status_130(served: RunningServer, camera: MjpegServer) -> None:
    create(served.url, {"url": camera.url, "model": "digits", "id": "interrupted"})
    try:
        process = start_watching(served.url, "interrupted", "--token", ADMIN_TOKEN)
        assert process.stdout is not None
        first = process.stdout.readline()  # watch is in its reading loop, and stays there: the camera goes on
        assert first.startswith("frame "), first
        process.send_signal(signal.SIGINT)
        code, _, stderr = finish(process)
        assert code == 130 and stderr == "", stderr
        assert source(served.url, "interrupted")["state"] == "running"  # it was not the source that ended
    finally:
        httpx.delete(f"{served.url}/v1/sources/interrupted", headers=AUTH, timeout=30)


def test_a_reader_that_goes_away_ends_watching_quietly(served: RunningServer, camera: MjpegServer) -> None:
    create(served.url, {"url": camera.url, "model": "digits", "id": "piped"})
    try:
        process = start_watching(served.url, "piped", "--token", ADMIN_TOKEN)  # as `watch ... | head -1`
        assert process.stdout is not None
        assert process.stdout.readline().startswith("frame ")
        process.stdout.close()  # the next answer's line finds no reader
        code = process.wait(WATCH_TIMEOUT_S)
        assert process.stderr is not None
        assert code == 0 and process.stderr.read() == ""
    finally:
        httpx.delete(f"{served.url}/v1/sources/piped", headers=AUTH, timeout=30)


def test_a_wrong_or_missing_token_is_refused_with_status_2(served: RunningServer, media: Path) -> None:
    create(served.url, {"url": f"file://{media / 'short.mp4'}", "model": "digits", "id": "guarded"})
    wrong = watch(served.url, "--source", "guarded", "--token", "wrong")
    assert wrong.returncode == 2 and "403" in wrong.stderr and "admin token" in wrong.stderr, wrong.stderr
    assert wrong.stdout == ""
    none = watch(served.url, "--source", "guarded")
    assert none.returncode == 2 and "VISIONSERVE_ADMIN_TOKEN" in none.stderr, none.stderr


def test_an_unknown_source_is_refused_naming_it(served: RunningServer) -> None:
    done = watch(served.url, "--source", "nowhere", token=ADMIN_TOKEN)
    assert done.returncode == 2 and "404" in done.stderr and "nowhere" in done.stderr, done.stderr


def test_an_existing_out_file_is_refused_without_append(tmp_path: Path) -> None:
    out = tmp_path / "kept.jsonl"
    out.write_text('{"frame": 0}\n')
    # Refused before any connection: the URL is never asked.
    done = watch("http://127.0.0.1:9", "--source", "x", "--out", str(out), token="t")
    assert done.returncode == 2 and "--append" in done.stderr, done.stderr
    assert out.read_text() == '{"frame": 0}\n'


def test_event_data_follows_the_event_stream_format() -> None:
    lines = [": a comment", "data: {\"a\": 1}", "", "event: x", "id: 7", "data:{\"b\": 2}", "data: more", "",
             "retry: 10", "", "data", "", "data: last"]  # fmt: skip
    assert list(event_data(lines)) == ['{"a": 1}', '{"b": 2}\nmore', "", "last"]


def test_answer_lines_are_compact() -> None:
    base = {"source": "s", "frame": 4, "pts": 0.26666, "age_ms": 12.34}
    predictions = [{"label": "7", "index": 7, "score": 0.912}, {"label": "1", "index": 1, "score": 0.05}]
    assert answer_line(base | {"status": "result", "predictions": predictions}) == (
        "frame 4  pts 0.267  age 12.3 ms  7 0.91, 1 0.05"
    )
    boxes = [{"box": [0, 0, 1, 1], "label": "3", "index": 3, "score": 0.5}] * 7
    assert answer_line(base | {"status": "result", "detections": boxes}) == (
        "frame 4  pts 0.267  age 12.3 ms  7 boxes: " + ", ".join(["3 0.50"] * 5) + ", +2 more"
    )
    assert answer_line(base | {"status": "result", "detections": []}).endswith("  0 boxes")
    instances = [{"box": [0, 0, 1, 1], "label": "3", "index": 3, "score": 0.5, "area": 1, "mask": {}}]
    assert answer_line(base | {"status": "result", "instances": instances}).endswith("  1 box: 3 0.50")
    classes = [{"label": "road", "index": 0, "area": 900, "mask": {}}, {"label": "car", "index": 2, "area": 60}]
    assert answer_line(base | {"status": "result", "classes": classes}).endswith("  road 900 px, car 60 px")
    assert answer_line(base | {"pts": None, "status": "expired", "stage": "queue"}) == (
        "frame 4  pts -  age 12.3 ms  expired (queue)"
    )
    assert answer_line(base | {"status": "error", "error": "bad frame"}).endswith("  error: bad frame")
    assert end_line({"source": "s", "status": "ended", "state": "failed", "reason": "connect timed out"}) == (
        "source s failed: connect timed out"
    )
    assert end_line({"source": "s", "status": "cut_off", "reason": "left 64 answers unread"}) == (
        "cut off from source s by the server: left 64 answers unread"
    )
