"""scripts/soak.py end to end, seconds instead of minutes: it starts a server, sends its mix of good and bad inputs,
and writes soak.json and soak.png. The soak's timing criteria are not judged here (a few seconds on a shared machine
say nothing about them); what must hold at any length is: every good input answered 200, every bad one a 4xx."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def digits_repo(digits_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("soak-repo")
    digits = from_checkpoint(digits_checkpoint)
    export_model(digits.eager, digits.spec, ExportRequest(name="digits", repository=str(root), latency=False))
    return root


@pytest.mark.slow
def test_a_short_soak_writes_its_results(digits_repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--repository", str(digits_repo), "--model", "digits",
           "--workers", "1", "--duration-s", "6", "--warmup-s", "2", "--rate", "20", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a timing criterion failed

    results = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert {"config", "rate", "requests", "errors", "latency", "rss", "criteria", "passed", "server"} <= set(results)
    assert results["rate"] == 20 and results["capacity"] is None
    assert results["requests"]["count"] == 120
    by_tag = results["requests"]["by_tag"]
    good = {tag: outcomes for tag, outcomes in by_tag.items() if tag.startswith("good:")}
    bad = {tag: outcomes for tag, outcomes in by_tag.items() if tag.startswith("bad:")}
    assert set(good) == {"good:png", "good:jpeg", "good:v2-json"}
    assert all(set(outcomes) == {"200"} for outcomes in good.values()), good
    expected = {"bad:corrupt-png": "400", "bad:truncated-jpeg": "400", "bad:wrong-content-type": "415",
                "bad:unknown-model": "404", "bad:v2-not-json": "400"}  # fmt: skip
    assert {tag: set(outcomes) for tag, outcomes in bad.items()} == {tag: {s} for tag, s in expected.items()}
    assert results["errors"]["count"] == 0 and results["criteria"]["errors"]["passed"]

    series = results["rss"]["series"]
    assert len(series) >= 5 and all(s["rss_mb"] > 0 for s in series)
    assert {"supervisor", "engine", "frontend"} <= set(series[-1]["rss_mb_by_role"])
    for key in ("at_warmup_end_mb", "max_after_warmup_mb", "final_mb", "growth_max_mb"):
        assert isinstance(results["rss"][key], float)
    assert [w["start_s"] for w in results["latency"]["per_10s"]] == [0.0]
    assert results["latency"]["per_minute"][0]["count"] == sum(sum(o.values()) for o in good.values())
    assert set(results["criteria"]) == {"rss_growth", "errors", "p99_stable"}
    assert results["server"]["started"] and results["server"]["exit_code"] == 0
    assert "PASS errors other than bad inputs' 4xx: 0" in done.stdout
