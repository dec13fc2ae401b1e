"""Running a GPU machine's prepared command as steps that fail alone, each within its share of the time budget,
with the report rewritten after every step (``scripts/gpu_check.py`` and ``scripts/gpu_speed.py`` stand on it),
and the flags, environment and probe both commands share.

A step may use what the steps before it left unused, never what the steps after it are owed; its commands are
stopped at its deadline. What a step raises is its error (the next step runs); a step whose prerequisite step did
not complete, or whose modules do not import, is skipped with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpucheck.install import install_carried
from gpucheck.outputs import last_line
from gpucheck.proc import StepError, run_logged
from gpucheck.wheels import CARRIED

# The environment step's probe: torch alone is needed; torchvision and onnxruntime are reported, or said missing.
ENVIRONMENT_CODE = """
import importlib, json, torch
c = torch.cuda.is_available()
env = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": c,
       "gpus": torch.cuda.device_count() if c else 0,
       "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if c else [],
       "cudnn": torch.backends.cudnn.version() if c else None}
for name in ("torchvision", "onnxruntime"):
    try:
        env[name] = importlib.import_module(name).__version__
    except Exception as exc:
        env[name], env[name + "_missing"] = None, f"{type(exc).__name__}: {exc}"
if env["onnxruntime"]:
    env["onnxruntime_providers"] = importlib.import_module("onnxruntime").get_available_providers()
print(json.dumps(env))
"""


class StepRunner:
    """The plumbing of one prepared command: deadlines, commands with logs, steps, the report."""

    prefix = "gpu"  # what every progress line starts with

    def __init__(self, args: argparse.Namespace, *, root: Path, shares: Mapping[str, float],
                 needs: Mapping[str, Collection[str]], kind: str) -> None:  # fmt: skip
        """``args``: the flags of :func:`step_parser`; ``kind``: what the report calls the real run."""
        self.args, self.dry, self.root, self.out = args, bool(args.dry_run), root, Path(args.out).resolve()
        self.site, self.wheels, self.budget_s = Path(args.site).resolve(), str(args.wheels), float(args.budget_s)
        self.shares, self.needs, self.skip, self.fail_step = dict(shares), dict(needs), set(args.skip), args.fail_step
        self.env = command_env(root, self.site, one_thread=self.dry)
        self.device = "cpu" if self.dry else "cuda"  # with the sizes, the only difference between the two runs
        self.model = "smallcnn" if self.dry else "resnet50"
        self.repo = self.out / "repo"  # where the export step writes the model
        self.started = time.monotonic()
        self.deadline = self.started + self.budget_s
        self.timings: dict[str, float] = {}
        self.missing: set[str] = set()  # modules that do not import once the carried wheels are installed
        kind = "dry run (CPU, tiny sizes)" if self.dry else kind
        self.report: dict[str, Any] = {"kind": kind, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                                       "budget_s": args.budget_s, "sections": {}, "skipped": {}, "errors": {},
                                       "seconds": {}}  # fmt: skip

    def say(self, message: str) -> None:
        print(f"{self.prefix}: {message}", file=sys.stderr, flush=True)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def step_left_s(self) -> float:
        return self.deadline - time.monotonic()

    def share_s(self, name: str) -> float:
        return self.shares[name] * self.budget_s / sum(self.shares.values())

    def run(self, cmd: list[str], timeout_s: float, log: str, cpus: Collection[int] | None = None,
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run ``cmd`` from the repository root, stopped at the step's deadline (on ``cpus`` when given); its
        output kept in ``OUT/log.log``, also what a command stopped at the deadline printed until then."""
        timeout = min(timeout_s, self.step_left_s())
        what = " ".join([Path(cmd[0]).name, *(c.strip().splitlines()[0][:40] for c in cmd[1:5] if c.strip())])
        if timeout < 1:
            raise StepError(f"no time left in this step's share for {what}")
        started = time.monotonic()
        code, stdout, stderr = run_logged(cmd, cwd=self.root, env=self.env, timeout_s=timeout,
                                          log=self.out / f"{log}.log", cpus=cpus)  # fmt: skip
        if code is None:
            at = f"; last said: {w}" if (w := last_line(stderr) or last_line(stdout)) else ""
            raise StepError(f"{what} ran past {timeout:.0f} s (this step's share){at}")
        self.timings[log] = round(time.monotonic() - started, 1)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def cli(self, args: list[str], *, timeout_s: float, log: str, cpus: Collection[int] | None = None,
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """``python -m service.cli ARGS`` (progress bars off but for export's gate lines); exit 0 or StepError."""
        quiet = [] if args[0] == "export" else ["--no-progress"]
        proc = self.run([sys.executable, "-m", "service.cli", *args, *quiet], timeout_s, log, cpus)
        if proc.returncode != 0:  # the error, not the warnings printed after it
            said = "\n".join(ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "warnings.warn" not in ln)
            raise StepError(f"visionserve {args[0]} exited {proc.returncode}: {said.strip()[-600:]}")
        return proc

    def json_line(self, proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
        """The last line of a command's output, which ``--json`` makes one JSON object."""
        lines = proc.stdout.strip().splitlines()
        if not lines:
            raise StepError(f"{' '.join(proc.args[2:5])} printed nothing: {proc.stderr.strip()[-400:]}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def step(self, name: str, fn: Callable[[], dict[str, Any]], *, after: str | None = None) -> None:
        """Run one step within its deadline; whatever it raises is its own error, and the next step still runs."""
        names = list(self.shares)
        later = sum(self.share_s(s) for s in names[names.index(name) + 1 :] if s not in self.skip)
        allowance = self.left_s() - later
        reason = self.why_not(name, allowance, after)
        if reason is not None:
            self.report["skipped"][name] = reason
            self.say(f"{name}: skipped ({reason})")
            self.write()
            return
        self.say(f"{name} ({allowance:.0f} s, {self.left_s():.0f} s left in all)")
        self.deadline = time.monotonic() + allowance
        started = time.monotonic()
        try:
            if name == self.fail_step:
                raise StepError("made to fail by --fail-step")
            self.report["sections"][name] = fn()
        except StepError as exc:
            self.report["errors"][name] = str(exc)
            self.say(f"  error: {exc}")
        except Exception as exc:  # a bug of the script: recorded, and the other steps still run
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            self.say(f"  error: {type(exc).__name__}: {exc}")
        self.report["seconds"][name] = round(time.monotonic() - started, 1)
        self.write()

    def why_not(self, name: str, allowance: float, after: str | None) -> str | None:
        """Why step ``name`` cannot run now (None: it can)."""
        if name in self.skip:
            return "--skip"
        if after is not None and after not in self.report["sections"]:
            return f"it needs the {after} step, which did not complete"
        absent = [m for m in self.needs.get(name, ()) if m in self.missing]
        if absent:
            carried = [m for m in absent if m in CARRIED]
            where = f"carry its wheel in {self.wheels}/ (`make gpu-wheels`)" if carried else "not carried"
            return f"module {', '.join(absent)} does not import here ({where})"
        if allowance < 1:
            return f"time budget: {self.left_s():.0f} s left of {self.budget_s:.0f} s, owed to the later steps"
        return None

    def versions(self, timeout_s: float) -> dict[str, Any]:
        """The environment step's start: torch, CUDA, the devices, torchvision, onnxruntime, Python, the cores."""
        proc = self.run([sys.executable, "-c", ENVIRONMENT_CODE], timeout_s, "environment")
        if proc.returncode != 0:
            raise StepError(f"torch does not import: {proc.stderr.strip()[-400:]}")
        env = self.json_line(proc)
        env.update(python=platform.python_version(), cpu_cores=os.cpu_count())
        return env

    def install(self) -> dict[str, Any]:
        """The install step: what the steps need and fails to import, from the carried wheels into ``site``."""
        needed = sorted({*CARRIED, *(m for needs in self.needs.values() for m in needs)})
        result, self.missing = install_carried(self.run, needed, Path(self.wheels), self.site)
        return result

    def totals(self) -> dict[str, Any]:
        """What the report ends with beside the times (a subclass adds its own)."""
        return {}

    def render(self) -> str:
        """The report for people (a subclass draws its own)."""
        return "```json\n" + json.dumps(self.report, indent=2) + "\n```\n"

    def write(self) -> None:
        """The report as it stands (after every step, so that a run stopped half way still leaves one)."""
        self.report["seconds_total"] = round(time.monotonic() - self.started, 1)
        self.report["command_seconds"] = self.timings
        self.report.update(self.totals())
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        try:
            text = self.render()
        except Exception as exc:  # a bug of the rendering must not cost the report: the numbers are in the JSON
            text = f"# visionserve {self.report['kind']}\n\nThe report could not be drawn ({exc!r}): see report.json.\n"
        (self.out / "report.md").write_text(text)


def command_env(root: Path, site: Path, *, one_thread: bool) -> dict[str, str]:
    """The environment every command runs in: the project and the carried packages (``site``) importable."""
    path = [str(root), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
    if one_thread:  # the dry run: one thread a process on a busy CPU (train 41 s -> 12 s with one on 2 cores)
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def ints(text: str) -> list[int]:
    """``--batch-sizes 1,8,32``: comma-separated positive integers."""
    values = [int(x) for x in text.split(",") if x.strip().isdigit()]
    if not values or min(values) < 1 or len(values) != len([x for x in text.split(",") if x.strip()]):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def names(text: str) -> set[str]:
    """``--skip a,b``: a set of step names."""
    return {s.strip() for s in text.split(",") if s.strip()}


def step_parser(prog: str, doc: str | None, *, what: str, out: str, budget_s: float,
                skippable: Sequence[str]) -> argparse.ArgumentParser:  # fmt: skip
    """The parser of a prepared command with the flags every such command takes (``what`` it runs: "steps")."""
    description = doc.split("\n\n")[0] if doc else None
    p = argparse.ArgumentParser(prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help=f"the same {what} on the CPU with tiny sizes (for CI)")
    p.add_argument("--out", default=out, help="folder for report.json, report.md and the logs")
    p.add_argument("--wheels", default=".whl", help="folder of carried wheels to install what is missing from")
    p.add_argument("--site", default=".site", help="folder the carried wheels are installed into (on PYTHONPATH)")
    p.add_argument("--budget-s", type=float, default=budget_s,
                   help="time budget, cut per step (the same in the dry run)")  # fmt: skip
    p.add_argument("--skip", type=names, default="", help=f"comma-separated steps to skip, of: {', '.join(skippable)}")
    p.add_argument("--fail-step", default=None, help="make this step fail (proves that the next still runs)")
    return p
