"""``visionserve loadtest --streams`` against a real server: every frame sent is accounted for (one answer each, the
server's own counts agreeing), the report's files are written, and a server slower than the frames supersedes them.

The repository is the shipped digits model and ``paced``, its copy slow by its config (a batch of one held 100 ms:
``[faults] delay_ms``), so a stream at 40 frames/s outruns it on any machine."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.stream_report import accounting
from loadtest.streams import FrameRecord, StreamLog, StreamPlan, StreamRun
from tests.http.conftest import RunningServer, slow_config, start_server, stop_server

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "model_repository" / "digits"
SHORT = ["--duration", "2", "--warmup", "0.5", "--drain", "10", "--no-progress"]
FATES = ("answered", "superseded", "expired", "errors", "lost")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("streams-repo")
    shutil.copytree(DIGITS, repo / "digits")
    shutil.copytree(DIGITS, repo / "paced")
    (repo / "paced" / "config.toml").write_text(slow_config(delay_ms=100))
    running = start_server(repo, tmp_path_factory.mktemp("streams") / "server.log", "--workers", "1")
    yield running
    stop_server(running)


def streams(server: RunningServer, model: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", server.url, "--model", model, *SHORT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def adds_up(counts: dict[str, int]) -> bool:
    return sum(counts[k] for k in FATES) == counts["sent"]


def test_a_streams_run_accounts_for_every_frame_and_writes_its_files(server: RunningServer, tmp_path: Path) -> None:
    run = streams(server, "digits", "--streams", "3", "--fps", "20", "--image-size", "64x48", "--out", str(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every frame got exactly one answer" in run.stdout and "age p99" in run.stdout
    report = json.loads((tmp_path / "results.json").read_text())
    assert report["mode"] == "streams" and report["streams"] == 3 and report["total_fps"] == 60
    for s in report["per_stream"]:
        assert s["sent"] == 40, s  # 20 frames/s due in the 2 s window, whatever the stream's phase
        assert adds_up(s) and s["lost"] == 0 and s["answered"] > 0 and s["unexpected"] == 0, s
        assert s["age_ms"]["p50"] <= s["age_ms"]["p99"] and s["latency_ms"]["p50"] > 0, s
    total = report["total"]
    assert total["sent"] == 120 and adds_up(total)
    a = report["accounting"]
    assert a["ok"] and a["adds_up"] and a["lost"] == a["unexpected"] == a["unsent"] == 0, a
    assert a["sent"] == 3 * 50  # the warm-up's frames too: 20/s for 2.5 s each
    # The server counted every frame's fate as the client did.
    frames = report["server"]["stream_frames"]
    assert frames["answered"] == a["answered"] and frames["superseded"] == a["superseded"], (frames, a)
    assert sum(frames.values()) == a["sent"], (frames, a)
    seconds = report["timeline"]
    assert len(seconds) == 2 and sum(row["result"] for row in seconds) == total["answered"]
    assert sum(sum(row["answered_by_stream"]) for row in seconds) == total["answered"]
    rows = list(csv.DictReader((tmp_path / "streams.csv").open()))
    assert [r["stream"] for r in rows] == ["0", "1", "2", "all"] and int(rows[-1]["sent"]) == 120
    assert (tmp_path / "streams_over_time.png").read_bytes()[:4] == b"\x89PNG"


def test_a_server_slower_than_the_frames_supersedes_them(server: RunningServer) -> None:
    # paced answers a batch of one each 100 ms: two streams share about 10 answers a second, far below 40 + 10 fps.
    run = streams(server, "paced", "--streams", "2", "--fps", "10", "--stream-fps-first", "40", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    fast, slow = report["per_stream"]
    assert fast["fps"] == 40 and slow["fps"] == 10 and fast["sent"] == 80 and slow["sent"] == 20
    assert fast["superseded"] > 0 and fast["answered"] > 0 and fast["answered_fraction"] < 0.5, fast
    assert adds_up(fast) and adds_up(slow) and report["accounting"]["ok"], report["accounting"]
    frames, a = report["server"]["stream_frames"], report["accounting"]
    assert frames["superseded"] == a["superseded"] > 0 and frames["answered"] == a["answered"], (frames, a)
    # Every superseded frame's stream went on: each stream had answers after its first drop.
    assert all(row["result"] > 0 for row in report["timeline"]), report["timeline"]


def test_flags_that_do_not_go_with_streams_are_refused_before_any_traffic() -> None:
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", "http://127.0.0.1:9", "--models", "a,b",
           "--streams", "2", "--no-progress"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--models" in done.stderr, done.stderr


def test_accounting_reports_a_frame_without_an_answer_and_a_second_answer() -> None:
    plan = StreamPlan(url="http://127.0.0.1:9", model="m", streams=1, fps=2.0, duration_s=1.0)
    frames = [FrameRecord(0, 0, 0.0, status="result", age_ms=1.0), FrameRecord(0, 1, 0.5)]  # the second: no answer
    log = StreamLog(0, 2.0, frames, scheduled=2, unexpected=1)
    a = accounting(StreamRun(plan, [log], wall_s=1.0))
    assert a["sent"] == 2 and a["answered"] == 1 and a["lost"] == 1 and a["unexpected"] == 1
    assert not a["adds_up"] and not a["ok"]  # answered + superseded + expired + errors falls short of sent
    assert math.isnan(FrameRecord(0, 2, 1.0).latency_ms)
