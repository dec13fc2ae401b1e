"""``visionserve bench rollout`` runs end to end with tiny sizes against real servers and writes every figure it prints.
The latency values are not judged (seconds on a shared machine say nothing about them); that each is there and
positive is, and so are the outcomes a rollout promises whatever the machine: a permuted candidate aborted at its
first chance, a promotion through the admin API that loses no request."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_rollout_bench_writes_every_target(tmp_path: Path) -> None:
    out = tmp_path / "rollout.json"
    # Capacity given (no capacity server); one round of 1 s windows after 0.2 s of warm-up: at 90 and 142 requests/s
    # with 10% shadowed, a window without a shadow sample is a 1-in-10^4 chance. A 2 s promotion promotes at 1 s.
    command = [sys.executable, "-m", "service.cli", "bench", "rollout", "--work", str(tmp_path / "work"), "--out",
               str(out), "--capacity", "150", "--rounds", "1", "--window-s", "1", "--warmup-s", "0.2",
               "--detect-samples", "60", "--detect-max-samples", "200", "--promote-s", "2"]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a target missed
    results = json.loads(out.read_text())

    offline = results["offline"]
    assert offline["copy"]["disagreement"] == 0 and offline["permuted"]["disagreement"] == 1
    assert 0 < offline["detect"]["disagreement"] < 0.05 and 0 < offline["promote"]["disagreement"] < 0.01

    loads = results["latency"]["loads"]
    assert [x["load"] for x in loads] == [0.6, 0.95]
    for load in loads:
        for side in ("shadow", "none"):
            assert load[side]["count"] == load[side]["ok"] > 0, load[side]
            assert positive(load[side]["p50_ms"]) and positive(load[side]["p99_ms"])
        assert positive(load["p99_ratio"]) and load["shadow_samples"] + load["shed"] > 0
        assert load["rollout_state"] == "running"  # auto off: the copy's rollout never decides

    detection = results["detection"]
    detect = detection["detect"]
    assert detect["history"] and detect["history"][-1]["samples"] > 0 and detect["final"]["state"] == "running"
    permuted = detection["permuted"]
    assert permuted["final"]["state"] == "aborted" and permuted["aborted_at_samples"] <= 200, permuted["final"]
    assert detection["promote"]["final"]["state"] in ("running", "promoted")

    promotion = results["promotion"]
    assert promotion["promote_call"]["status"] == 200, promotion["promote_call"]
    assert promotion["sent"] == promotion["recorded"] > 0 and promotion["failed"] == 0
    assert promotion["final_state"] == "promoted" and promotion["versions_after"] == {"2": 20}

    for target in ("of capacity", "held-out stream", "label-permuted", "sent"):
        assert re.search(rf"^  (PASS|MISS) [^\n]*{target}", done.stdout, re.MULTILINE), target
