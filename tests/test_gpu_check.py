"""`make gpu-check DRY_RUN=1`: the GPU proof's steps run end to end on the CPU with tiny sizes and the arguments of
the real run, so the command a person with a GPU runs first cannot rot between GPUs. Also proven here without a
GPU: the carried wheels bring every import of the serving path that the GPU machine lacks, each step fails alone
and within its share of the time, and the report is written whatever fails."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("environment", "install", "gpu_tests", "export", "bench", "decode", "serve_loadtest", "train")


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """The flags whose help does not state them (the help formatter adds each default)."""
    return [a.dest for a in parser._actions if not isinstance(a, argparse._HelpAction) and not a.help]


from service.bench import gpu_check, wheels  # noqa: E402

# ---- the wheels ------------------------------------------------------------------------------------------------
CP312 = {"cp312-cp312-manylinux_2_28_x86_64", "py3-none-any"}


def test_only_missing_packages_are_installed_never_the_machines_own_nor_another_pythons() -> None:
    names = ["torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl", "nvidia_cudnn_cu13-9.1-py3-none-any.whl",
             "msgspec-0.19.0-cp312-cp312-manylinux_2_28_x86_64.whl", "litestar-2.25.0-py3-none-any.whl",
             "pyzmq-27.0-cp311-cp311-manylinux_2_28_x86_64.whl", "onnx-1.23.2-cp312-cp312-manylinux_2_28_x86_64.whl",
             "uvicorn-0.38.0-py3-none-any.whl"]  # fmt: skip
    chosen, refused, other = wheels.choose_wheels([Path(n) for n in names], {"msgspec", "pyzmq", "torch", "uvicorn"},
                                                  supported=CP312)  # fmt: skip
    assert [w.name for w in chosen] == [names[2], names[6]]  # litestar is there already: not reinstalled
    assert [w.name for w in refused] == [names[0], names[1], names[5]]
    assert [w.name for w in other] == [names[4]]  # a cp311 wheel on Python 3.12: refused, and said so


def test_the_download_command_is_for_the_python_asked_and_names_every_carried_wheel() -> None:
    cmd = wheels.download_command("3.13")
    assert cmd[cmd.index("--python-version") + 1] == "3.13" and "--no-deps" in cmd
    assert set(cmd[cmd.index("-d") + 2 :]) == set(wheels.carried_distributions())
    proc = subprocess.run([sys.executable, "-m", "service.bench.gpu_check", "--list-wheels", "3.12"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "--python-version 3.12" in proc.stdout and "swagger-ui-bundle-v2" in proc.stdout


def test_every_carried_wheels_own_requirements_are_on_the_machine_or_carried() -> None:
    allowed = wheels.MACHINE_HAS | set(wheels.carried_distributions())
    env = {"extra": "", "python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
           "platform_python_implementation": "CPython", "os_name": "posix"}  # fmt: skip
    lacking = []
    for dist in wheels.carried_distributions():
        for text in metadata.distribution(dist).requires or []:
            req = Requirement(text)
            if (req.marker is None or req.marker.evaluate(env)) and wheels.normalize(req.name) not in allowed:
                lacking.append(f"{dist} needs {req.name}")
    assert not lacking, lacking


# Imports every module of the serving path, and every GPU test file, in a fresh interpreter where only the standard
# library, the project, the GPU machine's packages and the carried ones can be imported (the rest of this venv is
# hidden): what fails here would fail there.
ONLY_THE_MACHINES = """
import importlib, pkgutil, sys
from service.bench.wheels import hide_all_but_the_machines
hide_all_but_the_machines({"service", "export", "models", "loadtest", "tests"})
names = [m for pkg in ("service", "export", "models", "loadtest")
         for m in [pkg] + [i.name for i in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + ".")]]
names += [p.removesuffix(".py").replace("/", ".") for p in sys.argv[1:]]
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
print(len(names))
for name, why in failed.items():
    print(name, why)
"""


def test_the_serving_path_imports_with_only_the_machines_packages_and_the_carried_wheels() -> None:
    proc = subprocess.run([sys.executable, "-c", ONLY_THE_MACHINES, *gpu_check.gpu_test_files()], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    count, *failures = proc.stdout.strip().splitlines()
    assert int(count) > 100 and not failures, failures


# ---- the arguments -----------------------------------------------------------------------------------------------
def commands(check: Any, tmp_path: Path) -> dict[str, list[str]]:
    """Every visionserve command the run would issue, by step (the serve config apart)."""
    out = {"export": check.export_args(), "decode": check.decode_args(), "train": check.train_args("digits.pt"),
           "closed": check.loadtest_args("http://127.0.0.1:1", "closed"),
           "slo": check.loadtest_args("http://127.0.0.1:1", "slo")}  # fmt: skip
    for backend, precision, graphs in gpu_check.bench_matrix():
        out[f"bench {backend} {precision} {graphs}"] = check.bench_args(backend, precision, graphs)
    return out


def test_the_dry_run_builds_the_real_runs_arguments_and_the_cli_accepts_them(tmp_path: Path) -> None:
    from service.cli import build_parser

    real = gpu_check.Check(gpu_check.parse_args(["--out", str(tmp_path / "real")]))
    dry = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path / "dry")]))
    real_commands, dry_commands = commands(real, tmp_path), commands(dry, tmp_path)
    assert real_commands.keys() == dry_commands.keys()
    for key, args in real_commands.items():
        for run in (args, dry_commands[key]):
            build_parser(only=run[0]).parse_args(run)  # argparse exits on an unknown or bad flag
        flags = {a for a in args if a.startswith("--")}
        assert flags - {"--fp16"} == {a for a in dry_commands[key] if a.startswith("--")}, key
    assert real_commands["export"][real_commands["export"].index("--aoti-devices") + 1] == "cuda"
    assert "--fp16" in real_commands["export"] and "--fp16" not in dry_commands["export"]
    assert 'device = "cuda"' in real.serve_config() and 'precision = "fp16"' in real.serve_config()
    assert real.serve_config().replace("cuda", "cpu").split("\n")[0] == dry.serve_config().split("\n")[0]
    junit = tmp_path / "j.xml"
    assert real.gpu_test_args(junit) == dry.gpu_test_args(junit)  # the GPU tests by name, in both runs
    assert "tests/service/test_gpu.py" in real.gpu_test_args(junit)


# ---- failing alone, within its share -------------------------------------------------------------------------------
# Past the check's own budget (545 s, which stops every step at its deadline and still writes the report), within
# pytest-timeout's 600 s: a dry run that overruns says so in its report rather than in a TimeoutExpired.
DRY_RUN_TIMEOUT_S = 580


def dry_run(script: str, tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """``python -m service.bench.SCRIPT --dry-run`` (what `make` runs) with no carried wheels, as CI runs it: (the
    run, its report.json, its folder)."""
    out = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", f"service.bench.{script}", "--dry-run", "--out", str(out),
         "--wheels", str(tmp_path / "none"), "--site", str(tmp_path / "site"), *flags],
        cwd=ROOT, capture_output=True, text=True, timeout=DRY_RUN_TIMEOUT_S,
    )  # fmt: skip
    return proc, json.loads((out / "report.json").read_text()), out


def check_with(tmp_path: Path, argv: list[str], **steps: Any) -> Any:
    check = gpu_check.Check(gpu_check.parse_args(["--dry-run", "--out", str(tmp_path), *argv]))
    for name in SECTIONS:
        setattr(check, name, steps.get(name, lambda name=name: {"ran": name}))
    return check


def test_a_step_past_its_share_is_stopped_and_the_later_steps_keep_theirs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def install() -> dict[str, Any]:
        check.run([sys.executable, "-c", "import time; print('compiling', flush=True); time.sleep(60)"], 300, "sleep")
        return {}

    # 2 s each for the first two steps of a 100 s budget: install may use what environment left, about 4 s.
    monkeypatch.setattr(gpu_check.Check, "steps", {name: 5 if name in SECTIONS[:2] else 40 for name in SECTIONS})
    check = check_with(tmp_path, ["--budget-s", "100"], install=install)
    started = time.monotonic()
    assert check.main() == 1
    assert time.monotonic() - started < 30
    report = json.loads((tmp_path / "report.json").read_text())
    assert "ran past" in report["errors"]["install"] and "this step's share" in report["errors"]["install"]
    assert report["errors"]["install"].endswith("last said: compiling")  # what it was doing when stopped
    assert "compiling" in (tmp_path / "sleep.log").read_text()  # its output until then is kept
    assert set(report["sections"]) == set(SECTIONS) - {"install"}  # every later step still ran


def test_a_missing_module_skips_its_step_with_the_reason_and_a_failed_export_skips_what_needs_it(
    tmp_path: Path,
) -> None:
    def install() -> dict[str, Any]:
        check.missing = {"sklearn", "litestar"}
        return {}

    def export() -> dict[str, Any]:
        raise gpu_check.StepError("export wrote no artifact")

    check = check_with(tmp_path, [], install=install, export=export)
    assert check.main() == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["skipped"]["train"] == "module sklearn does not import here (not carried)"
    assert report["skipped"]["bench"] == "it needs the export step, which did not complete"
    assert report["errors"] == {"export": "export wrote no artifact"} and "gpu_tests" in report["sections"]
    assert "## train\n\nskipped: module sklearn" in (tmp_path / "report.md").read_text()


def test_a_step_made_to_fail_leaves_the_next_running_and_the_report_written(tmp_path: Path) -> None:
    proc, report, out = dry_run("gpu_check", tmp_path, "--fail-step", "install",
                                "--skip", "gpu_tests,export,bench,decode,serve_loadtest")  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert report["errors"] == {"install": "made to fail by --fail-step"}
    assert set(report["sections"]) == {"environment", "train"}  # the step after the failed one still ran, for real
    assert "ERROR: made to fail" in (out / "report.md").read_text()


# ---- the whole dry run -------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_dry_run_runs_every_step_and_reports_each(tmp_path: Path) -> None:
    proc, report, out = dry_run("gpu_check", tmp_path)
    assert proc.returncode == 0, (proc.stderr[-3000:], report["errors"])
    assert report["errors"] == {} and report["gpu_tests_failed"] is False
    assert set(report["sections"]) == set(SECTIONS), report["skipped"]
    sections = report["sections"]

    env = sections["environment"]
    assert env["cuda_available"] is False and env["torch"] and env["onnxruntime"]
    tests = sections["gpu_tests"]
    assert tests["failed"] == 0 and tests["skipped"] > 0 and tests["files"] == gpu_check.gpu_test_files()
    assert set(sections["export"]["files_mb"]) == {"model.onnx", "model.pt", "model.pt2"}

    bench = sections["bench"]
    measured = {run["backend"] for run in bench["runs"] if "engine_images_per_s" in run}
    assert measured == {"onnxruntime", "torchscript", "aoti"}
    for run in bench["runs"]:
        assert set(run["engine_images_per_s"]) == {"1", "4"} and min(run["engine_images_per_s"].values()) > 0
    reasons = {(s["backend"], s["precision"], s["cuda_graphs"]): s["reason"] for s in bench["skipped"]}
    assert "GPU-only" in reasons[("torchscript", "bf16", True)] and "bf16" in reasons[("aoti", "bf16", True)]

    decode = sections["decode"]
    assert decode["decode_cpu_images_per_s"] > 0 and decode["decode_gpu_skipped"] == "no CUDA device"

    served = sections["serve_loadtest"]
    assert [s["concurrency"] for s in served["closed"]] == [1, 2]
    assert all(s["requests"] > 0 and not s["errors"] for s in served["closed"])
    assert served["slo"]["target_p99_ms"] == 15.0 and served["slo"]["tried"]

    train = sections["train"]
    assert "validation accuracy" in train["single"]["result"] and "two or more" not in train["ddp"]["skipped"]
    assert report["skipped"]["train.ddp"] == "no CUDA device"
    assert set(report["seconds"]) == set(SECTIONS)

    markdown = (out / "report.md").read_text()
    for name in SECTIONS:
        assert f"## {name}" in markdown
    assert "| runtime | precision | CUDA graphs |" in markdown and "skipped torchscript fp16" in markdown


def test_the_parser_states_every_default() -> None:
    """Also as `visionserve bench gpu-check` (tests/test_cli_help.py); here the parser `make gpu-check` runs."""
    parser = gpu_check.build_parser()
    assert not undocumented(parser)
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if a.dest != "help"]
    assert [a.dest for a in actions if "default" not in (formatter._get_help_string(a) or "")] == []
