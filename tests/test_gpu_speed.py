"""`make gpu-speed DRY_RUN=1`: the GPU speed command's steps end to end on the CPU with tiny sizes and the commands
of the real run, so that the few minutes a GPU machine is at hand are never spent finding a typo. Also proven here:
the real run's commands parse with the real command lines and match the dry run's but for device and sizes; a step
made to fail fails alone; LitServe's app and the load driver import with only the GPU machine's packages and the
carried wheels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.bench import drive, gpu_speed, litserve_app
from service.bench.gpu_speed import verdicts
from tests.test_gpu_check import dry_run, undocumented

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("environment", "install", "export", "bench", "litserve", "serve", "detector")


def speed(tmp_path: Path, *argv: str) -> Any:
    return gpu_speed.Speed(gpu_speed.parse_args(["--out", str(tmp_path), "--site", str(tmp_path / "site"), *argv]))


def commands(run: Any) -> dict[str, list[str]]:
    """Every command the run would issue, by what it is for (the servers' configuration apart)."""
    url = "http://127.0.0.1:1"
    return {
        "export": run.export_args(), "bench engine": run.bench_args("engine"),
        "bench pipeline": run.bench_args("pipeline,decode"),
        "loadtest closed": run.loadtest_args(url, run.model, concurrency=2),
        "loadtest open": run.loadtest_args(url, run.model, rate=10.0),
        "loadtest detect": run.detector_args(url),
        "litserve": run.litserve_args(2, 1), "drive closed": run.drive_args(url, concurrency="1,2"),
        "drive open": run.drive_args(url, rate=10.0),
    }  # fmt: skip


def test_the_dry_run_issues_the_real_runs_commands_and_each_command_line_accepts_them(tmp_path: Path) -> None:
    from service.cli import build_parser

    real, dry = speed(tmp_path / "real"), speed(tmp_path / "dry", "--dry-run")
    real_commands, dry_commands = commands(real), commands(dry)
    scripts = {"service.bench.litserve_app": litserve_app.build_parser(),
               "service.bench.drive": drive.build_parser()}  # fmt: skip
    for key, args in real_commands.items():
        for run in (args, dry_commands[key]):
            if run[0] == sys.executable:
                scripts[run[2]].parse_args(run[3:])  # argparse exits on an unknown or bad flag
            elif key != "loadtest detect" or real.detector_refused() is None:  # else the step says why it skips
                build_parser(only=run[0]).parse_args(run)
        flags = {a for a in args if a.startswith("--")}
        assert flags - {"--fp16"} == {a for a in dry_commands[key] if a.startswith("--")}, key
    assert "--fp16" in real_commands["export"] and "--fp16" not in dry_commands["export"]
    bench = real_commands["bench engine"]
    assert bench[bench.index("--batch-sizes") + 1] == "1,8,32,64,128,256"
    assert bench[bench.index("--device") + 1] == "cuda" and bench[bench.index("--precision") + 1] == "fp16"
    assert bench[bench.index("--cuda-graphs") + 1] == "on"
    lit = real_commands["litserve"]
    assert lit[lit.index("--max-batch-size") + 1] == "64" and lit[lit.index("--batch-timeout-s") + 1] == "0.005"
    assert real.args.litserve_workers == [8, 4, 2, 1] and dry.args.litserve_workers == [1]
    assert real.serve_flags()[::2] == dry.serve_flags()[::2]
    assert 'device = "cuda"' in real.serve_config() and 'precision = "fp16"' in real.serve_config()
    same = [ln.split("=")[0] for ln in real.serve_config().splitlines()]
    assert same == [ln.split("=")[0] for ln in dry.serve_config().splitlines()]


def test_the_load_generator_and_every_server_get_the_same_split_of_the_cores() -> None:
    assert gpu_speed.split_cores(list(range(16)), 3) == ([0, 1, 2], list(range(3, 16)))
    assert gpu_speed.split_cores([0, 1], 1) == ([0], [1])
    assert gpu_speed.split_cores([5], 1) == ([5], [5])  # one core: shared, and the run still works


def test_a_step_made_to_fail_fails_alone_and_the_report_is_written(tmp_path: Path) -> None:
    run = speed(tmp_path, "--dry-run", "--fail-step", "litserve")
    for name in SECTIONS:
        setattr(run, name, lambda name=name: {"ran": name})
    assert run.main() == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors"] == {"litserve": "made to fail by --fail-step"}
    assert {"environment", "install", "export", "bench", "serve"} <= set(report["sections"])
    assert "ERROR: made to fail" in (tmp_path / "report.md").read_text()


def test_a_failed_export_skips_what_needs_it_and_says_why(tmp_path: Path) -> None:
    proc, report, _ = dry_run("gpu_speed", tmp_path, "--fail-step", "export", "--skip", "install,detector")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert report["errors"] == {"export": "made to fail by --fail-step"} and "environment" in report["sections"]
    for name in ("bench", "litserve", "serve"):
        assert report["skipped"][name] == "it needs the export step, which did not complete"


def test_the_targets_are_judged_from_the_figures() -> None:
    sections = {
        "serve": {"best_images_per_s": 6000.0, "to_pipeline_cpu_decode": 0.95,
                  "open_at_70": {"latency_ms": {"p99": 12.0}}, "at_litserve_70": {"latency_ms": {"p99": 5.0}}},
        "litserve": {"best": {"best_images_per_s": 2500.0, "open_at_70": {"latency_ms": {"p99": 40.0}}}},
    }  # fmt: skip
    judged = verdicts(sections, 15.0)
    assert judged["served >= 3x LitServe's best"] is False  # 6000 < 7500
    assert all(v for k, v in judged.items() if k != "served >= 3x LitServe's best")
    assert set(verdicts({}, 15.0).values()) == {None}  # nothing measured: nothing judged


# Imports LitServe's app and the load driver where only the standard library, the project, the GPU machine's
# packages and the carried wheels can be found (as tests/test_gpu_check.py does for the serving path).
ONLY_THE_MACHINES = """
import importlib, sys
from service.bench.wheels import hide_all_but_the_machines
hide_all_but_the_machines({"service", "export", "models", "loadtest"})
for name in ("service.bench.gpu_speed", "service.bench.litserve_app", "service.bench.drive", "litserve", "fastapi",
             "pydantic"):
    try:
        importlib.import_module(name)
    except Exception as exc:
        print(name, f"{type(exc).__name__}: {exc}")
"""


def test_litserves_app_and_the_driver_import_with_only_the_machines_packages_and_the_carried_wheels() -> None:
    proc = subprocess.run([sys.executable, "-c", ONLY_THE_MACHINES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0 and not proc.stdout.strip(), (proc.stdout, proc.stderr[-2000:])


def test_the_parser_states_every_default() -> None:
    for parser in (gpu_speed.build_parser(), litserve_app.build_parser(), drive.build_parser()):
        assert not undocumented(parser)


# ---- the whole dry run -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_reports_each_with_numbers(tmp_path: Path) -> None:
    proc, report, out = dry_run("gpu_speed", tmp_path)
    assert proc.returncode == 0, (proc.stderr[-3000:], report["errors"])
    assert report["errors"] == {}
    sections = report["sections"]
    detector = sections.get("detector")
    if detector is None:  # a load tester that cannot post to /detect: the step says so
        assert "/detect" in report["skipped"]["detector"] and set(sections) == set(SECTIONS) - {"detector"}
    else:
        assert detector["steps"][0]["concurrency"] == 8 and detector["steps"][0]["images_per_s"] > 0
        assert set(sections) == set(SECTIONS)

    assert sections["environment"]["server_cpus"] and sections["environment"]["client_cpus"]
    assert set(sections["export"]["files_mb"]) == {"model.pt"} and sections["export"]["parity"]
    bench = sections["bench"]
    assert set(bench["engine_images_per_s"]) == {"1", "4"} and min(bench["engine_images_per_s"].values()) > 0
    assert bench["pipeline_images_per_s"] > 0 and bench["decode_gpu_skipped"] == "no CUDA device"

    lit = sections["litserve"]
    assert [r["workers"] for r in lit["runs"]] == [1] and lit["best"]["best_images_per_s"] > 0
    served = sections["serve"]
    for body in (lit["best"], served):
        assert [s["concurrency"] for s in body["closed"]] == [1, 2]
        for step in [*body["closed"], body["open_at_70"]]:
            assert step["requests"] > 0 and not step["errors"] and step["latency_ms"]["p99"] > 0
            assert step["server_cpu_ms_per_image"] > 0 and step["server_cores_busy"] > 0
        assert body["open_at_70"]["rate"] == pytest.approx(0.7 * body["best_images_per_s"], abs=0.1)
    assert served["closed"][0]["server"]["mean_ms"]["compute"] > 0  # the stages, from the server's /metrics
    assert served["at_litserve_70"]["requests"] > 0
    assert served["to_pipeline_cpu_decode"] == pytest.approx(
        served["best_images_per_s"] / bench["pipeline_images_per_s"]
    )

    markdown = (out / "report.md").read_text()
    for name in (*SECTIONS, "targets"):
        assert f"## {name}" in markdown
    assert "| load | images/s | p50 ms | p99 ms |" in markdown
