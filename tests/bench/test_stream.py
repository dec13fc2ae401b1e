"""``visionserve bench stream`` runs end to end at its smallest sizes against a real server and writes every figure it
prints. The figures are not judged (seconds on a shared machine say nothing about them); that each is there and
consistent is, and so is what holds on any machine: every frame accounted for, and the max-min fair shares."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.bench.stream import fair_shares

ROOT = Path(__file__).resolve().parents[2]


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_fair_shares_fill_the_small_demands_first_and_split_the_rest_evenly() -> None:
    assert fair_shares([100.0, 10.0, 10.0], 30.0) == [10.0, 10.0, 10.0]
    shares = fair_shares([100.0, 2.0, 10.0], 30.0)
    assert shares == [18.0, 2.0, 10.0] and sum(shares) == 30.0


@pytest.mark.slow
def test_stream_bench_writes_every_target(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    # The smallest run reaching every figure: two streams (a fast one and another), 1 s steps (the overload run holds
    # a first and a last window), 32x32 JPEGs, and paced on the noop runtime: its [faults] delay sets its capacity.
    command = [sys.executable, "-m", "service.cli", "bench", "stream", "--quick", "--models", "paced", "--streams", "2",
               "--duration", "2", "--window", "1", "--other-duration", "1", "--capacity-s", "1", "--warmup", "0.2",
               "--image-size", "32x32", "--paced-noop", "--work", str(tmp_path / "work"),
               "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a target missed
    results = json.loads(out.read_text())
    paced = results["models"]["paced"]
    assert positive(paced["capacity"]["images_per_s"]) and positive(paced["capacity"]["compute_ms"])
    a, b, c = paced["overload"], paced["light"], paced["fairness"]
    for target in (a, b, c):
        assert target["accounting"]["ok"], target["accounting"]  # every frame got exactly one answer
    assert positive(a["age"]["p99_ms"]) and positive(a["age"]["bound_ms"]) and positive(a["flat"]["ratio"])
    assert a["total"]["superseded"] > 0  # at twice the capacity, frames are superseded
    assert positive(b["p50"]["age_p50_ms"]) and positive(b["one_shot"]["latency_p50_ms"])
    assert b["one_shot"]["requests"] > 0 and b["one_shot"]["errors"] == {}
    assert positive(c["others"]["fair_share_per_s"]) and positive(c["fast"]["answered_per_s"])
    for line in ("(a) 2x capacity", "age p99", "flat:", "accounted:", "(b) 50% of capacity", "one-shot latency p50",
                 "(c) fairness", "verdict:"):  # fmt: skip
        assert line in done.stdout, (line, done.stdout)
    for run in ("probe", "overload", "light", "fairness"):
        folder = tmp_path / "work" / "runs" / f"paced-{run}"
        assert (folder / "streams_over_time.png").read_bytes()[:4] == b"\x89PNG"
        assert json.loads((folder / "results.json").read_text())["accounting"]["ok"]
