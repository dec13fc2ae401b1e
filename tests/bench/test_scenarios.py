"""Every scenario of ``visionserve bench`` runs: its parser states each flag's default, and one tiny real run prints
and writes the figures it promises. The values are not judged (seconds on a shared machine say nothing about them);
that each figure is there, positive and consistent with the others is. One exported model serves the whole module
(smallcnn with its initial weights, named digits: the answers are nonsense, the serving is real). The engine, streams
and rollouts have files of their own here."""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from export.exporter import ExportRequest, export_model
from export.sources import from_architecture
from service.bench.commands import SCENARIOS
from service.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
COMMON = ("help", "no_progress", "log_level")  # the command line's own flags, shown on every scenario


def bench(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "service.cli", "bench", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def scenario_parser(name: str) -> argparse.ArgumentParser:
    subs = [a for a in build_parser("bench")._actions if isinstance(a, argparse._SubParsersAction)]
    bench_parser = subs[0].choices["bench"]
    scenarios = [a for a in bench_parser._actions if isinstance(a, argparse._SubParsersAction)]
    parser: argparse.ArgumentParser = scenarios[0].choices[name]
    return parser


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_flag_states_its_default(name: str) -> None:
    parser = scenario_parser(name)
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if a.dest not in COMMON and not a.required]
    assert [a.dest for a in actions if "default" not in (formatter._get_help_string(a) or "")] == []


def test_bench_without_a_scenario_is_the_engine() -> None:
    parser = build_parser("bench")
    for words in (
        ["bench", "--model", "m"],
        ["bench", "engine", "--model", "m"],
        ["bench", "--no-progress", "--model", "m"],
    ):
        args = parser.parse_args(words)
        assert args.scenario == "engine" and args.model == "m" and args.batch_sizes == (1, 8, 32)
    args = parser.parse_args(["bench", "--no-progress", "soak", "--rate", "5"])
    assert args.scenario == "soak" and args.rate == 5 and args.no_progress


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench-repo")
    source = from_architecture("smallcnn")
    request = ExportRequest(name="digits", repository=str(root), formats=("onnx",), latency=False)
    export_model(source.eager, source.spec, request)
    return root


@pytest.mark.slow
def test_ab_alternates_two_servers_and_prints_medians_and_ratios(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "ab.json"
    done = bench("ab", "--repository", str(repo), "--rounds", "2", "--concurrency", "2", "--duration-s",
               "0.3", "--warmup-s", "0.1", "--image-size", "32x32", "--b-flags=--no-metrics", "--b-protocol", "v2",
               "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    for side in ("A", "B"):
        rounds = results["sides"][side]["rounds"]
        assert len(rounds) == 2 and all(r["errors"] == {} for r in rounds)
        for key in ("requests_per_s", "images_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request"):
            assert all(positive(r[key]) for r in rounds), (side, key, rounds)
            assert positive(results["medians"][side][key])
        assert results["medians"][side]["errors"] == 0
    assert "v2 protocol" in results["sides"]["B"]["describe"] and "--no-metrics" in results["sides"]["B"]["describe"]
    for key, ratio in results["ratios_b_over_a"].items():
        low, high = ratio["interval_95"]
        assert len(ratio["per_round"]) == 2 and low <= ratio["median"] <= high, key
    assert set(results["ratios_b_over_a"]) == {"requests_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request"}
    assert re.search(r"round  1: A .* req/s.*\| B .* req/s.*\| B/A \d", done.stdout)
    assert "round  2:" in done.stdout and "throughput (requests/s)" in done.stdout
    assert re.search(r"serve --repository \S+ .*--no-metrics", done.stdout)  # B's command, as started


def test_ab_refuses_grpc_to_a_server_it_did_not_start() -> None:
    assert main(["bench", "ab", "--b-url", "http://127.0.0.1:9", "--b-protocol", "grpc"]) == 2


@pytest.mark.slow
def test_soak_writes_every_figure_and_judges_them(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak"
    done = bench("soak", "--repository", str(repo), "--workers", "1", "--duration-s", "3", "--warmup-s",
               "1", "--capacity-s", "0.2", "--capacity-start-rate", "20", "--capacity-max-steps", "2",
               "--capacity-p99-ms", "5000", "--load", "0.5", "--judge-rounds", "1", "--judge-window-s", "1",
               "--judge-warmup-s", "0", "--out", str(out))  # fmt: skip
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: the p99 ratio, on a busy machine
    results = json.loads((out / "soak.json").read_text())
    assert (out / "soak.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    # The capacity search ran out of steps before any rate failed: 20, then 40 requests/s; the soak at half of it.
    assert [rate for rate, *_ in results["capacity"]["tried"]] == [20, 40] and results["capacity"]["best_rate"] == 40
    assert results["rate"] == 20 and results["requests"]["count"] == 60
    by_tag = results["requests"]["by_tag"]
    assert {tag: set(o) for tag, o in by_tag.items() if tag.startswith("good:")} == {
        "good:png": {"200"}, "good:jpeg": {"200"}, "good:v2-json": {"200"}}  # fmt: skip
    expected = {"bad:corrupt-png": "400", "bad:truncated-jpeg": "400", "bad:wrong-content-type": "415",
                "bad:unknown-model": "404", "bad:v2-not-json": "400"}  # fmt: skip
    assert {tag: set(o) for tag, o in by_tag.items() if tag.startswith("bad:")} == {t: {s} for t, s in expected.items()}
    assert results["errors"] == {} and results["criteria"]["errors"]["passed"]
    series = results["rss_mb"]["series"]
    assert len(series) >= 3 and all(positive(mb) for _, mb in series) and positive(results["rss_mb"]["at_warmup_end"])
    judgement = results["judgement"]  # at 0.6 x 40 requests/s, one window of 1 s each
    windows = [(w["server"], w["round"], w["outcomes"]) for w in judgement["windows"]]
    assert windows == [("aged", 1, {"200": 24}), ("fresh", 1, {"200": 24})]
    assert judgement["p99_ratio"] == pytest.approx(judgement["aged_p99_ms"] / judgement["fresh_p99_ms"])
    assert results["passed"] == all(c["passed"] for c in results["criteria"].values()) == (done.returncode == 0)
    assert results["exit_codes"] == {"aged": 0, "fresh": 0}
    assert f"verdict: {'PASS' if results['passed'] else 'FAIL'}" in done.stdout
    assert (out / "server.log").stat().st_size > 0 and (out / "server-fresh.log").stat().st_size > 0


@pytest.mark.slow
def test_frontends_bench_holds_served_against_the_pipeline(repo: Path, tmp_path: Path) -> None:
    out = tmp_path / "frontends.json"
    done = bench("frontends", "--repository", str(repo), "--model", "digits", "--concurrency", "2",
               "--duration-s", "0.3", "--warmup-s", "0.1", "--bench-seconds", "0.1", "--image-size", "64x48",
               "--workers", "1", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert positive(results["in_process"]["pipeline_images_per_s"])
    assert positive(results["in_process"]["engine_images_per_s"]["1"])
    row = results["served"]["2"]
    assert row["errors"] == {} and row["of_pipeline"] == pytest.approx(
        row["images_per_s"] / results["in_process"]["pipeline_images_per_s"])  # fmt: skip
    for key in ("images_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request", "mean_batch_size"):
        assert positive(row[key]), key
    assert re.search(r"digits c=2: [\d.]+ images/s = [\d.]+ of the pipeline; [\d.]+ server CPU ms/request", done.stdout)


@pytest.mark.slow
def test_many_models_bench_writes_every_target(tmp_path: Path) -> None:
    """--quick, smaller: three smallcnn copies on demand, a budget of two and a half, one round of 2 s (19 requests:
    each model's first a miss, hits after) against the top two pinned; two in-process cold starts, the first apart."""
    out = tmp_path / "many.json"
    done = bench("many-models", "--quick", "--models", "3", "--duration-s", "2", "--cold-repeats", "2", "--work",
                 str(tmp_path / "work"), "--out", str(out))  # fmt: skip
    assert done.returncode in (0, 1), done.stdout[-3000:] + done.stderr[-3000:]  # 1: a target missed
    results = json.loads(out.read_text())
    correct = results["correct"]
    assert correct["answers"] == results["requests"] > 0 and correct["wrong_model"] == 0
    assert correct["server_deaths"] == 0 and correct["ok"] + correct["5xx"] + correct["other_failures"] == correct[
        "answers"]  # fmt: skip
    assert (tmp_path / "work" / "sequence.txt").read_text().count("\n") == results["requests"]
    hits = results["hit_rate"]
    assert 0 <= hits["server"] <= 1 and 0 <= hits["ideal_lru"] <= 1
    assert hits["points"] == pytest.approx(100 * (hits["server"] - hits["ideal_lru"]))
    p99 = results["p99_hits"]
    assert all(positive(p99[k]) for k in ("a_hits_p99_ms", "b_p99_ms", "ratio", "a_misses_p99_ms"))
    assert len(p99["rounds"]) == 1 and positive(p99["rounds"][0]["ratio"])
    memory = results["memory"]
    assert memory["scrapes"] > 0 and positive(memory["max_charged_bytes"]) and positive(memory["rss_ratio_worst"])
    assert positive(results["model_bytes"]) and results["budget_bytes"] == int(2.5 * results["model_bytes"])
    cold = results["cold_start"]
    assert all(positive(cold["in_process"]["first"][k]) for k in ("read_ms", "build_ms", "warmup_ms", "total_ms"))
    assert positive(cold["served"]["first_cold_start_ms"]) and cold["served"]["second_cold_start_ms"] is None
    assert cold["triton"] == {"ran": False, "why": "not asked (--triton)"}
    for target in ("answers from the right model", "hit rate", "p99 of hits", "charged bytes", "RSS growth"):
        assert re.search(rf"^(PASS|MISS) [^\n]*{target}", done.stdout, re.MULTILINE), target


@pytest.mark.slow
def test_train_bench_measures_peak_memory(tmp_path: Path) -> None:
    done = bench("train", "--only", "rss", "--work", str(tmp_path), "--images", "10", "--arch",
               "smallcnn", "--input-size", "32", "--batch-size", "4", "--batches", "1", "--workers", "0")  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    runs = summary["rss"]["runs"]
    assert set(runs) == {"10", "40"} and all(positive(r["maxrss_mb"]) and positive(r["tree_peak_mb"])
                                              for r in runs.values())  # fmt: skip
    assert summary["rss"]["growth"] == pytest.approx(runs["40"]["maxrss_mb"] / runs["10"]["maxrss_mb"] - 1)
    assert len(list((tmp_path / "linked40").rglob("*.jpg"))) == 40  # 4 hard links of each generated image
    assert "growth with 4x the images" in done.stdout


@pytest.mark.slow
def test_transport_bench_prints_round_trips() -> None:
    done = bench("transport", "--senders", "1", "--inflight", "1", "--seconds", "0.3", "--json")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [row] = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert row["senders"] == row["inflight_per_sender"] == 1
    assert positive(row["round_trips_per_s"]) and 0 < row["median_us"] <= row["p99_us"]
