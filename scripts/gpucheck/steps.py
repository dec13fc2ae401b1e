"""Running a GPU machine's prepared command as steps that fail alone, each within its share of the time budget,
with the report rewritten after every step (``scripts/gpu_speed.py`` stands on it; ``gpu_check.py`` holds the
same rules in its own class).

A step may use what the steps before it left unused, never what the steps after it are owed; its commands are
stopped at its deadline. What a step raises is its error (the next step runs); a step whose prerequisite step did
not complete, or whose modules do not import, is skipped with the reason.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpucheck.outputs import last_line
from gpucheck.proc import StepError, run_logged


class StepRunner:
    """The plumbing of one prepared command: deadlines, commands with logs, steps, the report."""

    prefix = "gpu"  # what every progress line starts with

    def __init__(self, *, root: Path, out: Path, budget_s: float, shares: Mapping[str, float], kind: str,
                 env: dict[str, str], skip: Collection[str] = (), fail_step: str | None = None,
                 needs: Mapping[str, Collection[str]] | None = None) -> None:  # fmt: skip
        self.root, self.out, self.budget_s, self.shares, self.env = root, out, budget_s, dict(shares), env
        self.skip, self.fail_step, self.needs = set(skip), fail_step, dict(needs or {})
        self.started = time.monotonic()
        self.deadline = self.started + budget_s
        self.timings: dict[str, float] = {}
        self.missing: set[str] = set()  # modules that do not import once the carried wheels are installed
        self.report: dict[str, Any] = {"kind": kind, "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                                       "budget_s": budget_s, "sections": {}, "skipped": {}, "errors": {},
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
            return f"module {', '.join(absent)} does not import here (carry its wheel in .whl/: `make gpu-wheels`)"
        if allowance < 1:
            return f"time budget: {self.left_s():.0f} s left of {self.budget_s:.0f} s, owed to the later steps"
        return None

    def render(self) -> str:
        """The report for people (a subclass draws its own)."""
        return "```json\n" + json.dumps(self.report, indent=2) + "\n```\n"

    def write(self) -> None:
        """The report as it stands (after every step, so that a run stopped half way still leaves one)."""
        self.report["seconds_total"] = round(time.monotonic() - self.started, 1)
        self.report["command_seconds"] = self.timings
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        try:
            text = self.render()
        except Exception as exc:  # a bug of the rendering must not cost the report: the numbers are in the JSON
            text = f"# visionserve {self.report['kind']}\n\nThe report could not be drawn ({exc!r}): see report.json.\n"
        (self.out / "report.md").write_text(text)
