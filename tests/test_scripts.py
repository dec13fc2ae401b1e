"""Every tool in scripts/ runs: its parser states each flag's default, and one real run does what it promises.
The benchmarks, `make gpu-check` and `make gpu-speed` among them, are ``visionserve bench``'s (tests/bench/,
tests/test_gpu_check.py, tests/test_gpu_speed.py)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"
# What runs each script for real: a test below, or another file.
SMOKE_TESTED = {
    "default_model.py": "test_the_shipped_default_model_is_what_train_and_export_make_again",
    "detect_cost.py": "test_detect_cost_prints_what_one_request_costs",
    "first_answer.py": "test_first_answer_measures_a_fresh_make_serve",
    "gen_protocol.py": "test_gen_protocol_regenerates_the_committed_modules",
    "install-video.sh": "tests/sources/test_video_sources.py",
    "install-browser.sh": "test_install_browser_is_quiet_when_both_are_there",
    "make_folder_dataset.py": "test_make_folder_dataset_writes_its_classes",
    "test-suite.sh": "test_the_suite_script_runs_both_phases_on_what_it_is_given",
}


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))  # as when run: a script may import a sibling
    try:
        spec = importlib.util.spec_from_file_location(f"script_{name}", SCRIPTS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def run(*args: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_every_script_is_run_by_a_test() -> None:
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.is_file()) == sorted(SMOKE_TESTED)
    for test in SMOKE_TESTED.values():
        assert test in globals() or (ROOT / test).is_file(), test


@pytest.mark.parametrize("name", sorted(p.stem for p in SCRIPTS.glob("*.py")))
def test_every_flag_states_its_default(name: str) -> None:
    parser: argparse.ArgumentParser = load(name).build_parser()
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if a.dest != "help"]
    assert [a.dest for a in actions if "default" not in formatter._get_help_string(a)] == []


def test_make_folder_dataset_writes_its_classes(tmp_path: Path) -> None:
    make = load("make_folder_dataset")
    assert make.main(["--out", str(tmp_path), "--images", "6", "--classes", "3", "--width", "40", "--height", "30",
                      "--split"]) == 0  # fmt: skip
    files = sorted(p.relative_to(tmp_path).parts[:2] for p in tmp_path.rglob("*.jpg"))
    assert {part for part, _ in files} == {"train"} and len({cls for _, cls in files}) == 3 and len(files) == 6


def test_gen_protocol_regenerates_the_committed_modules(tmp_path: Path) -> None:
    done = run("scripts/gen_protocol.py", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    committed = ROOT / "service" / "core" / "protocol"
    for name in ("grpc_service_pb2.py", "grpc_service_pb2.pyi", "model_config_pb2.py", "model_config_pb2.pyi"):
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name


def test_install_browser_is_quiet_when_both_are_there(tmp_path: Path) -> None:
    for tool in ("chromium", "chromedriver"):
        (tmp_path / tool).write_text("#!/bin/sh\n")
        (tmp_path / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", str(SCRIPTS / "install-browser.sh")], capture_output=True, text=True, env=env)
    assert done.returncode == 0 and done.stdout == done.stderr == ""


# The venv's pytest plugins that the suite script's test module does not use, not loaded in its eight pytest
# processes (two runs of two phases, the parallel one three processes): importing faker, hypothesis and schemathesis
# was most of each process's start-up, and 17 of this test's 23 s (pinned to one core, 2026-11-28).
UNUSED_PLUGINS = ("faker", "hypothesispytest", "schemathesis", "anyio")


def test_the_suite_script_runs_both_phases_on_what_it_is_given(tmp_path: Path) -> None:
    """`make test`'s runner on a module of its own: the tests not marked `alone` in the parallel phase, the `alone`
    one after them, and a failure in either phase fails the whole."""

    def suite(alone_passes: bool) -> subprocess.CompletedProcess[str]:
        module = tmp_path / f"test_phases_{alone_passes}.py"
        module.write_text(
            "import os, pytest\n"
            "def test_in_a_worker():\n    assert os.environ['PYTEST_XDIST_WORKER']\n"
            "@pytest.mark.alone\n"
            f"def test_alone():\n    assert 'PYTEST_XDIST_WORKER' not in os.environ and {alone_passes}\n"
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "VISIONSERVE_TEST_"))}
        env["BIN"] = str(Path(sys.executable).parent)
        unused = [arg for name in UNUSED_PLUGINS for arg in ("-p", f"no:{name}")]
        return subprocess.run(["bash", str(SCRIPTS / "test-suite.sh"), "-q", "-p", "no:cacheprovider", *unused,
                               "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"), str(module)],
                              cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)  # fmt: skip

    passing = suite(alone_passes=True)
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert "parallel phase exit 0, alone phase exit 0" in passing.stdout
    assert passing.stdout.count("1 passed") == 2  # each phase ran its one test
    failing = suite(alone_passes=False)
    assert failing.returncode == 1 and "parallel phase exit 0, alone phase exit 1" in failing.stdout, failing.stdout


@pytest.mark.slow
def test_the_shipped_default_model_is_what_train_and_export_make_again(capsys: pytest.CaptureFixture[str]) -> None:
    """The models `make serve` serves are the project's own train and export. digits (examples/model_repository/
    digits), trained again here: the accuracy is within a point of the shipped record, the shipped model.onnx scores
    its record on the validation split, and its parity record is within the gate. digits-detect is not trained again
    (about 3 minutes): its model.onnx reaches its recorded mAP@0.5 on the held-out canvases made again from its
    recorded generator, and its detection parity record is within the gate."""
    assert load("default_model").main(["--check"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "shipped 9" in out and "digits-detect: shipped mAP@0.5 0.9" in out


@pytest.mark.slow
def test_first_answer_measures_a_fresh_make_serve() -> None:
    """A copy of the checkout, `make serve` in it from nothing (the serving install, the shipped model), the README's
    curl answered: the figures the lean install is held to, printed (their values are the docs', not a test's)."""
    done = run("scripts/first_answer.py", "--json", "--pip-cache", timeout_s=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert positive(figures["first_answer_s"]) and positive(figures["engine_start_s"])
    assert figures["torch_imports"] is False and 0 < figures["environment_mb"] < 1000
    assert "first answer to the README's curl" in done.stdout


def test_detect_cost_prints_what_one_request_costs() -> None:
    """docs/detection.md's figures, small: every head kind postprocessed and encoded, its detections counted."""
    for kind in ("grid", "random", "blank"):
        done = run("scripts/detect_cost.py", "--head", kind, "--images", "2", "--anchors", "64", "--classes", "3")
        assert done.returncode == 0, done.stderr[-3000:]
        found = re.search(rf"^{kind}: postprocess \d+ ms, JSON \d+ ms, (\d+) detections, answer ", done.stdout, re.M)
        assert found and 0 < int(found.group(1)) <= 2 * 64, done.stdout
