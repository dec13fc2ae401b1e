"""The one runner of a sequence of steps (``visionserve bench gpu-check`` and ``gpu-speed`` stand on it): each step
reported, each within its share of the time budget (never what the later steps are owed), one that fails or cannot
run says why and the next runs, and the report rewritten after every step. The standard library only at import (and
httpx, which the GPU machine brings): what the steps need beyond it comes from the carried wheels (the install step).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from service.bench.flags import Flag, add_flags, settle
from service.bench.wheels import CARRIED, choose_wheels, download_command
from service.launcher import stop_process, tree_cpu_s

ROOT = Path(__file__).resolve().parents[2]
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
IMPORT_PROBE = (
    "import importlib, sys\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
    "    except Exception:\n        print(m)"
)


class CpuClock:
    """The CPU time of ``pid``'s process tree from now on: in seconds, in cores busy, and as a load step's figures."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.began_s = pid, time.monotonic()
        self.cpu_s = tree_cpu_s(pid) if pid else 0.0

    def spent_s(self) -> float:
        return tree_cpu_s(self.pid) - self.cpu_s if self.pid else 0.0

    def cores(self) -> float:
        return self.spent_s() / (time.monotonic() - self.began_s)

    def figures(self, answers: int) -> dict[str, float]:
        """CPU seconds, cores busy on average and, given the ``answers``, CPU ms per answer."""
        cpu, wall = self.spent_s(), time.monotonic() - self.began_s
        out = {"server_cpu_s": round(cpu, 2), "server_cores_busy": round(cpu / wall, 2) if wall else 0.0}
        if answers:
            out["server_cpu_ms_per_image"] = round(1000 * cpu / answers, 3)
        return out


class StepError(Exception):
    """A step that failed; its message goes into the report."""


def flags(*, what: str, out: str, budget_s: float, skippable: Sequence[str]) -> list[Flag]:
    """The flags every step runner takes (``what`` it runs: "steps")."""
    return [
        ("--dry-run", False, f"the same {what} on the CPU with tiny sizes (for CI)"),
        ("--out", out, "folder for report.json, report.md and the logs"),
        ("--wheels", ".whl", "folder of carried wheels to install what is missing from"),
        ("--site", ".site", "folder the carried wheels are installed into (on PYTHONPATH)"),
        ("--budget-s", budget_s, "time budget, cut per step (the same in the dry run)"),
        ("--skip", "", f"comma-separated steps to skip, of: {', '.join(skippable)} (default: none)", names),
        ("--fail-step", None, "make this step fail, proving that the next still runs (default: none)"),
    ]


def parser(prog: str, doc: str | None, table: Sequence[Flag]) -> argparse.ArgumentParser:
    """``python -m service.bench.PROG``'s parser (what ``make`` runs: no carried wheel needed to parse its flags)."""
    p = argparse.ArgumentParser(prog, description=doc.split("\n\n")[0] if doc else None, formatter_class=Defaults)
    add_flags(p, table)
    return p


class Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default, where its help does not state it (service.core.arguments.HelpFormatter needs msgspec)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        said = action.help or ""
        return said if "default" in said else super()._get_help_string(action)


def names(text: str) -> set[str]:
    """``--skip a,b``: a set of step names."""
    return {s.strip() for s in text.split(",") if s.strip()}


def on_cpus(cpus: Collection[int] | None, session: bool = False) -> Callable[[], None] | None:
    """A ``preexec_fn`` that runs the child on ``cpus`` (what ``taskset -c`` does; inherited by its children), in a
    session of its own with ``session`` (so that its whole tree can be stopped)."""
    chosen = set(cpus or ())
    if not chosen and not session:
        return None

    def pin() -> None:
        if session:
            os.setsid()
        if chosen:
            os.sched_setaffinity(0, chosen)

    return pin


def split_cores(cores: list[int], client_cores: int) -> tuple[list[int], list[int]]:
    """(load generator's, servers') cores: the first ``client_cores`` and the rest; on one core, both share it."""
    if len(cores) <= client_cores:
        return cores, cores
    return cores[:client_cores], cores[client_cores:]


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-2] if len(lines) >= 2 and lines[-1].startswith("checkpoint written") else (lines[-1] if lines else "")


def step_summary(step: dict[str, Any]) -> dict[str, Any]:
    """One loadtest step without its histogram: clients or rate, throughput, errors, latency percentiles."""
    keep = ("step", "concurrency", "rate", "requests", "errors", "requests_per_s", "images_per_s", "latency_ms",
            "client_limited", "client_cpu")  # fmt: skip
    return {k: step[k] for k in keep if k in step}


class StepRunner:
    """One prepared command's steps: deadlines, commands with logs, the install step, the report. A subclass names
    its ``steps`` (name -> share of the budget, in order; each needs the first, or the step it comes ``after``), the
    modules each ``needs``, its ``sizes`` (flags) and ``fixed`` figures (``key: (the real run's, the dry run's)``),
    and draws its sections."""

    prefix = "gpu"  # what every progress line starts with
    kind = "GPU run"  # what the report calls the real run
    config_head = ""  # the served config.toml's first lines
    steps: ClassVar[dict[str, float]] = {}
    after: ClassVar[dict[str, str]] = {}
    needs: ClassVar[dict[str, tuple[str, ...]]] = {}
    sizes: ClassVar[dict[str, tuple[Any, ...]]] = {}
    fixed: ClassVar[dict[str, tuple[Any, Any]]] = {}

    def __init__(self, args: argparse.Namespace) -> None:
        """``args``: the flags of :func:`flags` and the command's own; the sizes not given are filled in."""
        settle(args, self.sizes, small=args.dry_run)
        for key, (full, dry) in self.fixed.items():
            setattr(args, key, dry if args.dry_run else full)
        self.args, self.dry, self.out = args, bool(args.dry_run), Path(args.out).resolve()
        self.site, self.wheels, self.budget_s = Path(args.site).resolve(), str(args.wheels), float(args.budget_s)
        self.skip, self.fail_step = set(args.skip), args.fail_step
        # Every command's: the project and the carried packages importable
        path = [str(ROOT), str(self.site), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
        if self.dry:  # one thread a process on a busy CPU (train 41 s -> 12 s with one on 2 cores)
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.device = "cpu" if self.dry else "cuda"  # with the sizes, the only difference between the two runs
        self.precision = "fp32" if self.dry else "fp16"
        self.model = "smallcnn" if self.dry else "resnet50"
        self.repo = self.out / "repo"  # where the export step writes the model
        self.started = time.monotonic()
        self.deadline = self.started + self.budget_s
        self.timings: dict[str, float] = {}
        self.missing: set[str] = set()  # modules that do not import once the carried wheels are installed
        self.report: dict[str, Any] = {"kind": "dry run (CPU, tiny sizes)" if self.dry else self.kind,
                                       "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                                       "budget_s": args.budget_s, "sections": {}, "skipped": {}, "errors": {},
                                       "seconds": {}}  # fmt: skip

    def say(self, message: str) -> None:
        print(f"{self.prefix}: {message}", file=sys.stderr, flush=True)

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def step_left_s(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, cmd: list[str], timeout_s: float, log: str, cpus: Collection[int] | None = None,
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run ``cmd`` from the repository root in a session of its own (on ``cpus`` when given), stopped with its
        children at the step's deadline; its output kept in ``OUT/log.log``, also what a command stopped at the
        deadline printed until then (a killed export's last gate, a killed test run's last test)."""
        timeout = min(timeout_s, self.step_left_s())
        what = " ".join([Path(cmd[0]).name, *(c.strip().splitlines()[0][:40] for c in cmd[1:5] if c.strip())])
        if timeout < 1:
            raise StepError(f"no time left in this step's share for {what}")
        started = time.monotonic()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=out, stderr=err, text=True,
                                    start_new_session=True, preexec_fn=on_cpus(cpus))  # fmt: skip
            try:
                code: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_process(proc, timeout_s=2, term_group=True)  # its own children too (a server, compile workers)
                code = None
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
        ended = "" if code is not None else f"(stopped after {timeout:.0f} s: above is what it printed until then)\n"
        (self.out / f"{log}.log").write_text(f"$ {' '.join(cmd)}\n{stdout}\n--- stderr\n{stderr}{ended}")
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
        return json.loads(lines[-1])

    # ---- the commands every GPU scenario issues, its own flags added (one builder each, for both runs) ---------
    def export_command(self, formats: str, *more: str) -> list[str]:
        """``visionserve export`` of the model with its initial weights into the repository, fp16 too on CUDA."""
        args = ["export", "--arch", self.model, "--name", self.model, "--repository", str(self.repo), "--formats",
                formats, *more, "--no-latency", "--max-batch-size", str(max(self.args.batch_sizes))]  # fmt: skip
        return [*args, "--fp16"] if self.device == "cuda" else args

    def bench_command(self, figures: str, sizes: Sequence[int], *more: str) -> list[str]:
        """``visionserve bench``'s ``figures`` of the exported model at batch ``sizes``, as JSON."""
        return ["bench", "--model", self.model, "--repository", str(self.repo), "--device", self.device, *more,
                "--figures", figures, "--batch-sizes", ",".join(map(str, sizes)), "--seconds", str(self.args.seconds),
                "--json"]  # fmt: skip

    def serve_config(self) -> str:
        """The served model's config.toml: ``config_head``, then the device, precision, batching and instances."""
        return (f'{self.config_head}device = "{self.device}"\nprecision = "{self.precision}"\n'
                f"max_batch_size = {self.args.serve_batch}\nmax_queue_delay_ms = 2.0\n"
                f"instances = {self.args.serve_instances}\n")  # fmt: skip

    def load_flags(self, warmup_s: float, processes: int) -> list[str]:
        """A load generator's measuring flags: JSON, ``--loadtest-s`` measured after ``warmup_s``, ``processes``."""
        return ["--json", "--duration", str(self.args.loadtest_s), "--warmup", str(warmup_s),
                "--processes", str(processes)]  # fmt: skip

    def exported(self, proc: subprocess.CompletedProcess[str], pattern: str) -> dict[str, Any]:
        """The files matching ``pattern`` the export wrote (in MB; StepError for none) and its parity lines."""
        found = sorted((self.repo / self.model / "1").glob(pattern))
        if not found:
            raise StepError(f"export wrote no artifact: {proc.stdout.strip()[-400:]}")
        return {"model": self.model, "files_mb": {p.name: round(p.stat().st_size / 1e6, 2) for p in found},
                "parity": [ln for ln in proc.stdout.splitlines() if ln.startswith("parity ")]}  # fmt: skip

    def main(self) -> int:
        """Every step in order, and the report; exit 1 when a step erred."""
        self.begin()
        try:
            for name in self.steps:
                self.step(name)
        finally:  # the last report, its headline and where it is
            self.write()
            for line in self.headline():
                self.say(line)
            self.say(f"report: {self.out / 'report.md'} and report.json ({self.report['seconds_total']:.0f} s)")
        return 1 if self.report["errors"] else 0

    def step(self, name: str) -> None:
        """Run step ``name`` within its deadline; whatever it raises is its own error, and the next step still runs."""
        order = list(self.steps)
        later = sum(self.steps[s] for s in order[order.index(name) + 1 :] if s not in self.skip)
        allowance = self.left_s() - later * self.budget_s / sum(self.steps.values())
        if (reason := self.why_not(name, allowance)) is not None:
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
            self.report["sections"][name] = getattr(self, name)()
        except Exception as exc:  # a StepError says why; anything else, a bug of the script, is recorded all the same
            said = str(exc) if isinstance(exc, StepError) else f"{type(exc).__name__}: {exc}"
            self.report["errors"][name] = said
            self.say(f"  error: {said}")
        self.report["seconds"][name] = round(time.monotonic() - started, 1)
        self.write()

    def why_not(self, name: str, allowance: float) -> str | None:
        """Why step ``name`` cannot run now (None: it can)."""
        first = next(iter(self.steps))  # every later step needs it, or the one ``after`` names
        after = self.after.get(name, first if name != first else None)
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
        """The environment step's start: torch, CUDA, the devices, torchvision, onnxruntime, Python, the cores;
        StepError where the real run finds no GPU."""
        proc = self.run([sys.executable, "-c", ENVIRONMENT_CODE], timeout_s, "environment")
        if proc.returncode != 0:
            raise StepError(f"torch does not import: {proc.stderr.strip()[-400:]}")
        env = self.json_line(proc)
        env.update(python=platform.python_version(), cpu_cores=os.cpu_count())
        if not self.dry and not env["gpus"]:
            raise StepError("no usable CUDA device: run with --dry-run on a machine without a GPU")
        return env

    def unimportable(self, modules: Sequence[str]) -> list[str]:
        """The modules that fail to import, tried in one fresh interpreter with the carried packages on the path."""
        return self.run([sys.executable, "-c", IMPORT_PROBE, *modules], 120, "imports").stdout.split()

    def install(self) -> dict[str, Any]:
        """The install step: what the steps need and fails to import, from the carried wheels (``.whl/``) into
        ``.site/`` with ``pip --no-index --no-deps``, never one of the machine's own packages."""
        needed = sorted({*CARRIED, *(m for needs in self.needs.values() for m in needs)})
        missing_before = self.unimportable(needed)
        wheels_dir = Path(self.wheels)
        wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
        chosen, refused, other_python = choose_wheels(wheels, {CARRIED[m] for m in missing_before if m in CARRIED})
        result: dict[str, Any] = {
            "missing_before": sorted(missing_before), "wheels_dir": str(wheels_dir),
            "wheels_mb": round(sum(w.stat().st_size for w in wheels) / 1e6, 1),
            "installed": [w.name for w in chosen], "refused_never_reinstalled": [w.name for w in refused],
            "refused_for_another_python": [w.name for w in other_python],
        }  # fmt: skip
        if other_python:
            version = platform.python_version().rpartition(".")[0]
            result["hint"] = f"carried for another Python: {' '.join(download_command(version))}"
        still = missing_before
        if chosen:
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
            cmd = [*pip, "--disable-pip-version-check", "--upgrade", "--target", str(self.site), *map(str, chosen)]
            proc = self.run(cmd, 300, "install")
            if proc.returncode != 0:
                raise StepError(f"pip install from {wheels_dir} failed: {proc.stderr.strip()[-400:]}")
            importlib.invalidate_caches()
            still = self.unimportable(needed)  # again only when something was installed
        result["missing_after"] = sorted(still)
        self.missing = set(still)
        return result

    def begin(self) -> None:
        """The output folder made, the last run's model gone, and the project and the carried packages importable
        here (the launcher and the load tester are imported once the install step has run)."""
        self.out.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.repo, ignore_errors=True)
        sys.path[:0] = [p for p in (str(ROOT), str(self.site)) if p not in sys.path]

    def totals(self) -> dict[str, Any]:
        """What the report ends with beside the times (a subclass adds its own)."""
        return {}

    def head(self) -> list[str]:
        """The report's lines before the sections (a subclass adds its own)."""
        return []

    def headline(self) -> list[str]:
        """The lines said at the end of the run, before where the report is (a subclass adds its own)."""
        return []

    def draw(self, name: str, body: dict[str, Any]) -> list[str]:
        """A section's numbers for people (a subclass draws its own tables)."""
        return ["```json", json.dumps(body, indent=2, default=str), "```", ""]

    def markdown(self) -> str:
        """Per step: its time, its error or why it was skipped, its numbers; then what else was skipped or failed."""
        r = self.report
        lines = [f"# visionserve {r['kind']}", "", f"Started {r['started_at']}, {r['seconds_total']:.0f} s in all.", ""]
        lines += self.head()
        for name in self.steps:
            lines += [f"## {name}", ""]
            if name in r["seconds"]:
                lines += [f"{r['seconds'][name]:.0f} s", ""]
            lines += [f"ERROR: {r['errors'][name]}", ""] if name in r["errors"] else []
            lines += [f"skipped: {r['skipped'][name]}", ""] if name in r["skipped"] else []
            lines += self.draw(name, r["sections"][name]) if name in r["sections"] else []
        other = [f"- skipped {k}: {v}" for k, v in r["skipped"].items() if k not in self.steps]
        other += [f"- error {k}: {v}" for k, v in r["errors"].items() if k not in self.steps]
        return "\n".join([*lines, *(["## skipped and errors", "", *other, ""] if other else [])])

    def write(self) -> None:
        """The report as it stands (after every step, so that a run stopped half way still leaves one)."""
        self.report["seconds_total"] = round(time.monotonic() - self.started, 1)
        self.report["command_seconds"] = self.timings
        self.report.update(self.totals())
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        try:
            text = self.markdown()
        except Exception as exc:  # a bug of the rendering must not cost the report: the numbers are in the JSON
            text = f"# visionserve {self.report['kind']}\n\nThe report could not be drawn ({exc!r}): see report.json.\n"
        (self.out / "report.md").write_text(text)
