"""``visionserve classify`` while the server goes away mid-run: killed and restarted on the same port, or its engine
killed (the supervisor restarts it). Every file must appear in the output exactly once, with an answer.

The model is slow by its config (``[faults] delay_ms``), so the run surely lasts past the kill; the kill comes once
the output file shows the run under way, and the restart once the port is free: observable states, not sleeps.
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.client.conftest import digit_pixels
from tests.conftest import encode_image
from tests.http.conftest import RunningServer, free_port, start_server, stop_server
from tests.http.test_processes import children, wait_for

IMAGES = 48
DELAY_MS = 60.0  # per batch of at most 4: the run takes a second or more whatever the machine


def rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def serve(repo: Path, log: Path, port: int) -> RunningServer:
    return start_server(repo, log, "--workers", "1", "--max-images", "4", port=port)


@pytest.mark.parametrize("what", ["server", "engine"])
def test_a_server_or_engine_killed_mid_run_loses_no_image(client_repo: Path, tmp_path: Path, what: str) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(client_repo, repo)
    (repo / "digits" / "config.toml").write_text(f"max_batch_size = 4\n[faults]\ndelay_ms = {DELAY_MS}\n")
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(IMAGES):
        (folder / f"d{i:03d}.png").write_bytes(encode_image(digit_pixels(i)[0], "PNG"))
    port = free_port()
    server = serve(repo, tmp_path / "server.log", port)
    out = tmp_path / "preds.csv"
    cmd = [sys.executable, "-m", "service.cli", "classify", "--url", server.url, "--model", "digits", str(folder),
           "--out", str(out), "--images-per-request", "2", "--concurrency", "2", "--no-progress",
           "--max-attempts", "1000", "--max-retry-s", "120"]  # fmt: skip
    run = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(rows(out)) >= 4 or run.poll() is not None, 60, "the run under way")
        assert run.poll() is None, "the run ended before the kill: make the model slower"
        if what == "server":
            os.killpg(server.process.pid, signal.SIGKILL)  # the whole tree, as a crash or an OOM kill would
            server.process.wait(30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # the port is free again once the killed front end is gone
                try:
                    server = serve(repo, tmp_path / "server2.log", port)
                    break
                except RuntimeError:
                    time.sleep(0.2)
        else:
            engine = children(server.process.pid)["engine"][0]
            os.kill(engine, signal.SIGKILL)
            wait_for(lambda: children(server.process.pid)["engine"] not in ([], [engine]), 60, "a new engine")
        _, stderr = run.communicate(timeout=180)
    finally:
        if run.poll() is None:
            run.kill()
        stop_server(server)
    assert run.returncode == 0, stderr
    got = rows(out)
    paths = [row["path"] for row in got]
    assert sorted(paths) == sorted(str(p) for p in folder.iterdir())  # every file, once
    assert all(row["error"] == "" and row["label_1"] != "" for row in got), got
    assert f"{IMAGES} ok, 0 failed" in stderr, stderr
