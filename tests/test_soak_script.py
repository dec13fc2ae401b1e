"""scripts/soak.py end to end, seconds instead of minutes: it starts a server, sends its mix of good and bad inputs,
starts a fresh server and runs the aged-against-fresh windows, and writes soak.json and soak.png. The soak's timing
criterion is not judged here (a few seconds on a shared machine say nothing about it); what must hold at any length
is: every good input answered 200, every bad one a 4xx, and the judgement's figures present and consistent. The
capacity search is checked on its own, against steps whose answer is known."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_checkpoint
from loadtest.openloop import Record

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def soak() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import soak
    finally:
        sys.path.pop(0)
    yield soak


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
           "--workers", "1", "--duration-s", "6", "--warmup-s", "2", "--rate", "20", "--judge-rounds", "1",
           "--judge-window-s", "2", "--judge-warmup-s", "1", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a timing criterion failed

    results = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    keys = {"config", "rate", "requests", "errors", "latency", "rss", "judgement", "criteria", "verdict", "passed",
            "server"}  # fmt: skip
    assert keys <= set(results)
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
    first_vs_last = results["latency"]["first_vs_last"]
    assert first_vs_last["judged"] is False and first_vs_last["last_p99_ms"] > 0
    assert results["server"]["started"] and results["server"]["exit_code"] == 0
    assert "PASS errors other than bad inputs' 4xx: 0" in done.stdout

    # The judgement: one round, aged then fresh, 2 s each at the soak's rate (capacity was not measured).
    judgement = results["judgement"]
    assert judgement["judged"] and judgement["rate"] == 20 and judgement["rate_from"].startswith("the soak's --rate")
    windows = judgement["windows"]
    assert [(w["server"], w["round"]) for w in windows] == [("aged", 1), ("fresh", 1)]
    for w in windows:
        assert w["count"] == w["ok"] == 40 and w["outcomes"] == {"200": 40}, w
        assert 0 < w["p50_ms"] <= w["p99_ms"]
    for server in ("aged", "fresh"):
        window = next(w for w in windows if w["server"] == server)
        assert judgement[server] == {"count": 40, "p50_ms": window["p50_ms"], "p99_ms": window["p99_ms"]}
    ratio = judgement["aged"]["p99_ms"] / judgement["fresh"]["p99_ms"]
    assert judgement["p99_ratio"] == pytest.approx(ratio) and judgement["p99_ratio_per_round"] == [pytest.approx(ratio)]
    assert judgement["rounds_agree"] is True  # one round agrees with itself
    assert judgement["errors"] == 0
    assert judgement["fresh_server"]["exit_code"] == 0 and judgement["fresh_server"]["url"] != results["config"]["url"]
    assert (out / "server-fresh.log").stat().st_size > 0

    criteria = results["criteria"]
    assert set(criteria) == {"rss_growth", "errors", "p99_vs_fresh"}
    assert criteria["p99_vs_fresh"]["ratio"] == pytest.approx(ratio) and criteria["p99_vs_fresh"]["limit"] == 1.2
    assert criteria["p99_vs_fresh"]["passed"] == (ratio <= 1.2)
    expected_verdict = "pass" if all(c["passed"] for c in criteria.values()) else "fail"
    assert results["verdict"] == expected_verdict and results["passed"] == (expected_verdict == "pass")
    assert done.returncode == (0 if expected_verdict == "pass" else 1)
    assert f"verdict: {expected_verdict.upper()}" in done.stdout


@pytest.mark.slow
def test_an_external_server_without_a_repository_is_not_judged_against_a_fresh_one(
    soak: ModuleType, digits_repo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "soak"
    with soak.started_server(digits_repo, 1, tmp_path / "server.log") as (url, process):
        cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--url", url, "--server-pid", str(process.pid),
               "--model", "digits", "--duration-s", "3", "--warmup-s", "1", "--rate", "20",
               "--out", str(out)]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]  # 3: nothing failed, one not judged

    results = json.loads((out / "soak.json").read_text())
    assert results["judgement"]["judged"] is False and "--repository" in results["judgement"]["reason"]
    latency = results["criteria"]["p99_vs_fresh"]
    assert latency["passed"] is None and latency["reason"] == results["judgement"]["reason"]
    assert results["criteria"]["errors"]["passed"] and results["criteria"]["rss_growth"]["passed"] is not None
    assert results["verdict"] == "not judged" and results["passed"] is False
    assert "NOT JUDGED p99 of the aged server against a fresh one" in done.stdout
    assert "verdict: NOT JUDGED" in done.stdout
    assert (out / "soak.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and not (out / "server-fresh.log").exists()


def _schedule(rate: float, seconds: float, answer: Any) -> list[Record]:
    """Requests due on a constant schedule, each answered when ``answer(due, previous_done)`` says, with 200."""
    records: list[Record] = []
    done = 0.0
    for i in range(int(rate * seconds)):
        due = i / rate
        done = answer(due, done)
        records.append(Record("good:png", due, due, done, "200"))
    return records


def test_a_capacity_step_is_sustained_only_when_all_is_served_in_time(soak: ModuleType) -> None:
    settle = soak.CAPACITY_SETTLE_S
    kept_up = _schedule(100, settle + 5, lambda due, _: due + 0.004)
    step = soak.capacity_step(kept_up, 100, 5, 100.0)
    assert step["sustained"] and step["why_not"] == "" and step["outcomes"] == {"200": 500}
    assert step["served_per_s"] == pytest.approx(100, rel=0.01) and step["p99_ms"] == pytest.approx(4)

    # A server that does 80 a second behind a queue: fewer answers in the window, and each waits longer.
    behind = soak.capacity_step(_schedule(100, settle + 5, lambda due, last: max(due, last) + 1 / 80), 100, 5, 100.0)
    assert not behind["sustained"] and behind["served_per_s"] < 85 and behind["p99_ms"] > 100
    assert "served" in behind["why_not"] and "p99" in behind["why_not"]

    overflowed = [*kept_up[:-1], Record("good:png", kept_up[-1].due_s, kept_up[-1].due_s, kept_up[-1].due_s,
                                        "client-overflow")]  # fmt: skip
    step = soak.capacity_step(overflowed, 100, 5, 100.0)
    assert not step["sustained"] and "client-overflow: 1" in step["why_not"]


def _search(
    soak: ModuleType, capacity: float, start: float, flaky: frozenset[float] = frozenset()
) -> tuple[dict[str, Any], list[float]]:
    tried: list[float] = []

    def try_rate(rate: float) -> dict[str, Any]:
        tried.append(rate)
        once_bad = rate in flaky and tried.count(rate) == 1
        return {"rate": rate, "sustained": rate <= capacity and not once_bad}

    return soak.find_capacity(try_rate, start), tried


@pytest.mark.parametrize("capacity, start", [(437.0, 100.0), (437.0, 2000.0), (37.5, 100.0), (100.0, 100.0)])
def test_the_capacity_search_ends_within_its_resolution_of_the_edge(
    soak: ModuleType, capacity: float, start: float
) -> None:
    found, tried = _search(soak, capacity, start)
    low, high = found["requests_per_s"], found["lowest_not_sustained"]
    assert low <= capacity < high and high / low <= soak.CAPACITY_RESOLUTION
    assert [s["rate"] for s in found["steps"]] == tried
    assert len(tried) == len(set(tried)) < 15


def test_one_bad_step_lowers_the_capacity_found_never_raises_it(soak: ModuleType) -> None:
    found, tried = _search(soak, 437.0, 100.0, flaky=frozenset({400.0}))
    assert tried.count(400.0) == 1 and found["requests_per_s"] < 400


def test_nothing_sustained_ends_the_search_at_zero(soak: ModuleType) -> None:
    found, tried = _search(soak, 0.5, 100.0)
    assert found["requests_per_s"] == 0 and min(tried) >= soak.CAPACITY_RATE_LIMITS[0]
