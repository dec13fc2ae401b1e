"""Prove every GPU path in one command (``make gpu-check``), and write one report of every number.

On a GPU machine, in order, each step a subprocess through the command line (``python -m service.cli ...``) so that
what is measured is what users run:

1. environment: device name, driver, torch / CUDA / torchvision / onnxruntime versions, providers, GPU count;
2. install: what the machine lacks, from wheels carried in ``.whl/`` into ``.site/`` (never torch, numpy or another
   package the machine brings, even when a wheel is there);
3. ``pytest -m gpu``: every CUDA test (the run fails when one fails);
4. export: resnet50 (224x224, initial weights) as TorchScript, AOTInductor for CUDA and ONNX (where onnxruntime has
   its CUDA provider), fp32 and fp16, gated;
5. bench: each GPU runtime alone at batch 1-128, per precision and CUDA graphs on/off (no bf16 AOTInductor);
6. decode: nvJPEG batch decode against the CPU decoding pool on every core, on the same JPEGs;
7. serve resnet50 fp16 and load it over HTTP: closed loop at 1..256 clients, then the highest open-loop rate whose
   p99 stays under 15 ms;
8. train smallcnn on digits on CUDA (AMP, channels-last), and with DDP through torchrun where two GPUs exist.

Every step that cannot run says why in the report (``skipped``); one that fails is recorded with its reason and the
next one still runs; the report is written after every step. ``--dry-run``: the same steps and arguments on the CPU
with tiny sizes (smallcnn, 8x8 digits, short durations, one thread), so CI proves the command itself. Exit 1 when a
GPU test fails or a step errs, else 0. Budget: 545 s (dry run too), a share per step (:data:`STEP_SHARE_S`); a step
may use what earlier steps left, never what later ones are owed; its commands are stopped at its deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpucheck.outputs import bench_matrix, junit_counts, last_line, step_summary
from gpucheck.proc import run_logged
from gpucheck.report import SECTIONS, markdown
from gpucheck.wheels import CARRIED, choose_wheels, download_command

ROOT = Path(__file__).resolve().parent.parent
# Each step's share of the 545 s budget on one H100 (scaled to another --budget-s). A step may also use what the
# steps before it left unused; its commands are stopped at its deadline, so the steps after it keep their shares.
STEP_SHARE_S = {"environment": 15, "install": 20, "gpu_tests": 150, "export": 150, "bench": 90, "decode": 20,
                "serve_loadtest": 80, "train": 20}  # fmt: skip
# The modules a step cannot run without, beyond torch (checked once the carried wheels are installed).
STEP_NEEDS = {"gpu_tests": ("pytest",), "export": ("onnx", "onnxscript"), "bench": ("onnxruntime",),
              "decode": ("PIL",), "serve_loadtest": ("litestar", "uvicorn", "zmq", "msgspec", "httpx"),
              "train": ("sklearn",)}  # fmt: skip


class Check:
    """Runs the steps, keeps every number and every reason, and writes the report after each step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.device = "cpu" if self.dry else "cuda"  # with the sizes, the only difference between the two runs
        self.out = Path(args.out).resolve()
        self.started = time.monotonic()
        self.report: dict[str, Any] = {"kind": "dry run (CPU, tiny sizes)" if self.dry else "GPU check",
                                       "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                                       "budget_s": args.budget_s, "sections": {}, "skipped": {}, "errors": {},
                                       "seconds": {}}  # fmt: skip
        site = Path(args.site).resolve()
        path = [str(ROOT), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
        if self.dry:  # one thread: two spun against all else on a busy 2-core CPU (train 41 s -> 12 s with one)
            self.env.setdefault("OMP_NUM_THREADS", "1")
        self.site = site
        self.repo = self.out / "repo"
        self.model = "smallcnn" if self.dry else "resnet50"
        self.timings: dict[str, float] = {}
        self.gpus, self.ort_cuda, self.gpu_tests_failed = 0, False, False
        self.missing: set[str] = set()  # modules that do not import once the carried wheels are installed
        self.deadline = self.started + args.budget_s

    # ---- plumbing -------------------------------------------------------------------------------------------
    def left_s(self) -> float:
        return float(self.args.budget_s) - (time.monotonic() - self.started)

    def step_left_s(self) -> float:
        return self.deadline - time.monotonic()

    def share_s(self, name: str) -> float:
        return STEP_SHARE_S[name] * self.args.budget_s / sum(STEP_SHARE_S.values())

    def run(self, cmd: list[str], timeout_s: float, log: str) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` from the repository root with the carried packages on the path, stopped at the step's
        deadline; keep its output, also what a command stopped at the deadline printed until then."""
        timeout = min(timeout_s, self.step_left_s())
        if timeout < 1:
            raise StepError(f"no time left in this step's share for {' '.join(cmd[2:5])}")
        started = time.monotonic()
        code, stdout, stderr = run_logged(cmd, cwd=ROOT, env=self.env, timeout_s=timeout, log=self.out / f"{log}.log")
        if code is None:
            at = f"; last said: {w}" if (w := last_line(stderr) or last_line(stdout)) else ""
            raise StepError(f"{' '.join(cmd[2:5])} ran past {timeout:.0f} s (this step's share){at}")
        self.timings[log] = round(time.monotonic() - started, 1)
        return subprocess.CompletedProcess(cmd, code, stdout, stderr)

    def cli(self, args: list[str], *, timeout_s: float, log: str) -> subprocess.CompletedProcess[str]:
        quiet = [] if args[0] == "export" else ["--no-progress"]  # export's: a line per gate, kept in its log
        proc = self.run([sys.executable, "-m", "service.cli", *args, *quiet], timeout_s, log)
        if proc.returncode != 0:  # the error, not the warnings printed after it
            said = "\n".join(ln for ln in proc.stderr.splitlines() if "Warning" not in ln and "warnings.warn" not in ln)
            raise StepError(f"visionserve {args[0]} exited {proc.returncode}: {said.strip()[-600:]}")
        return proc

    def step(self, name: str, fn: Any, *, after: str | None = None) -> None:
        """Run one step within its deadline; whatever it raises is its own error, and the next step still runs."""
        later = sum(self.share_s(s) for s in SECTIONS[SECTIONS.index(name) + 1 :] if s not in self.args.skip)
        allowance = self.left_s() - later
        reason = self._why_not(name, allowance, after)
        if reason is not None:
            self.report["skipped"][name] = reason
            say(f"{name}: skipped ({reason})")
            self.write()
            return
        say(f"{name} ({allowance:.0f} s, {self.left_s():.0f} s left in all)")
        self.deadline = time.monotonic() + allowance
        started = time.monotonic()
        try:
            if name == self.args.fail_step:
                raise StepError("made to fail by --fail-step")
            self.report["sections"][name] = fn()
        except StepError as exc:
            self.report["errors"][name] = str(exc)
            say(f"  error: {exc}")
        except Exception as exc:  # a bug of this script: recorded, and the other steps still run
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            say(f"  error: {type(exc).__name__}: {exc}")
        self.report["seconds"][name] = round(time.monotonic() - started, 1)
        self.write()

    def _why_not(self, name: str, allowance: float, after: str | None) -> str | None:
        """Why step ``name`` cannot run now (None: it can)."""
        if name in self.args.skip:
            return "--skip"
        if after is not None and after not in self.report["sections"]:
            return f"it needs the {after} step, which did not complete"
        absent = [m for m in STEP_NEEDS.get(name, ()) if m in self.missing]
        if absent:
            carried = [CARRIED[m] for m in absent if m in CARRIED]
            where = f"carry its wheel in {self.args.wheels}/ (`make gpu-wheels`)" if carried else "not carried"
            return f"module {', '.join(absent)} does not import here ({where})"
        if allowance < 1:
            return f"time budget: {self.left_s():.0f} s left of {self.args.budget_s:.0f} s, owed to the later steps"
        return None

    # ---- the commands (one builder per command, for both runs) ----------------------------------------------
    def gpu_test_args(self, junit: Path) -> list[str]:
        return ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                *gpu_test_files(), *self.args.pytest_args]  # fmt: skip

    def export_args(self) -> list[str]:
        # ONNX only where onnxruntime can run it on the device: a CPU build beside CUDA torch would spend the
        # export's share on an artifact that nothing here measures (and whose fp16 parity cannot be checked)
        formats = "onnx,torchscript,aoti" if self.device == "cpu" or self.ort_cuda else "torchscript,aoti"
        args = ["export", "--arch", self.model, "--name", self.model, "--repository", str(self.repo),
                "--formats", formats, "--aoti-devices", self.device, "--no-latency",
                "--max-batch-size", str(max(self.args.batch_sizes))]  # fmt: skip
        return [*args, "--fp16"] if self.device == "cuda" else args

    def bench_args(self, backend: str, precision: str, graphs: bool) -> list[str]:
        return ["bench", "--model", self.model, "--repository", str(self.repo), "--device", self.device,
                "--backend", backend, "--figures", "engine", "--json", "--precision", precision,
                "--cuda-graphs", "on" if graphs else "off", "--batch-sizes", ",".join(map(str, self.args.batch_sizes)),
                "--seconds", str(self.args.seconds)]  # fmt: skip

    def decode_args(self) -> list[str]:
        return ["bench", "--model", self.model, "--repository", str(self.repo), "--figures", "decode",
                "--batch-sizes", str(self.args.decode_batch), "--seconds", str(self.args.seconds), "--json",
                "--device", self.device, "--backend", "torchscript"]  # fmt: skip

    def serve_config(self) -> str:
        precision = "fp16" if self.device == "cuda" else "fp32"
        return (f'device = "{self.device}"\nprecision = "{precision}"\nmax_batch_size = {self.args.serve_batch}\n'
                f"max_queue_delay_ms = 2.0\ninstances = {self.args.serve_instances}\n")  # fmt: skip

    def loadtest_args(self, url: str, mode: str) -> list[str]:
        common = ["loadtest", "--url", url, "--model", self.model, "--json", "--duration",
                  str(self.args.loadtest_s), "--warmup", str(self.args.loadtest_warmup_s),
                  "--processes", str(self.args.loadtest_processes)]  # fmt: skip
        if mode == "closed":
            return [*common, "--mode", "closed", "--concurrency", ",".join(map(str, self.args.concurrency)),
                    "--image-size", "500x375"]  # fmt: skip
        return [*common, "--slo-p99-ms", str(self.args.slo_p99_ms), "--rate", str(self.args.slo_start_rate),
                "--slo-max-steps", str(self.args.slo_max_steps)]  # fmt: skip

    def train_args(self, out: str) -> list[str]:
        return ["train", "--arch", "smallcnn", "--dataset", "digits", "--device", self.device,
                "--epochs", str(self.args.train_epochs), "--input-size", str(self.args.train_input_size),
                "--out", str(self.out / out)]  # fmt: skip

    # ---- steps ----------------------------------------------------------------------------------------------
    def environment(self) -> dict[str, Any]:
        proc = self.run([sys.executable, "-c", ENVIRONMENT_CODE], 120, "environment")
        if proc.returncode != 0:
            raise StepError(f"torch does not import: {proc.stderr.strip()[-400:]}")
        env: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        env.update(python=platform.python_version(), cpu_cores=os.cpu_count(), machine=platform.machine())
        env["driver"] = None
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout else None
        self.gpus = int(env["gpus"])
        self.ort_cuda = "CUDAExecutionProvider" in (env.get("onnxruntime_providers") or [])
        if not self.dry and not self.gpus:
            raise StepError("no usable CUDA device: run with --dry-run on a machine without a GPU")
        return env

    def install(self) -> dict[str, Any]:
        import importlib

        needed = sorted({*CARRIED, *(m for needs in STEP_NEEDS.values() for m in needs)})
        unimportable = self._unimportable(needed)
        missing = {CARRIED[m] for m in unimportable if m in CARRIED}
        wheels_dir = Path(self.args.wheels)
        wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
        chosen, refused, other_python = choose_wheels(wheels, missing)
        result: dict[str, Any] = {
            "missing_before": sorted(unimportable),
            "wheels_dir": str(wheels_dir),
            "wheels_mb": round(sum(w.stat().st_size for w in wheels) / 1e6, 1),
            "installed": [w.name for w in chosen],
            "refused_never_reinstalled": [w.name for w in refused],
            "refused_for_another_python": [w.name for w in other_python],
        }
        if other_python:
            version = platform.python_version().rpartition(".")[0]
            result["hint"] = f"carried for another Python: {' '.join(download_command(version))}"
        if chosen:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--upgrade", "--target", str(self.site),
                   *map(str, chosen)]  # fmt: skip
            proc = self.run(cmd, 300, "install")
            if proc.returncode != 0:
                raise StepError(f"pip install from {wheels_dir} failed: {proc.stderr.strip()[-400:]}")
            importlib.invalidate_caches()
            unimportable = self._unimportable(needed)  # again only when something was installed
        self.missing = set(unimportable)
        result["missing_after"] = sorted(self.missing)
        return result

    def _unimportable(self, modules: list[str]) -> list[str]:
        """The modules that fail to import, tried in one fresh interpreter with the carried packages on the path."""
        code = (
            "import importlib, sys\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
            "    except Exception:\n        print(m)"
        )
        proc = self.run([sys.executable, "-c", code, *modules], 120, "imports")
        return proc.stdout.split()

    def gpu_tests(self) -> dict[str, Any]:
        junit = self.out / "gpu-tests.xml"
        proc = self.run([sys.executable, *self.gpu_test_args(junit)], self.args.pytest_timeout_s, "gpu-tests")
        counts = junit_counts(junit)
        tail = proc.stdout.strip().splitlines()[-1:] or [""]
        result = {**counts, "files": gpu_test_files(), "exit_code": proc.returncode, "summary": tail[0]}
        self.gpu_tests_failed = proc.returncode not in (0, 5) or bool(counts["failed"] or counts["errors"])
        if self.gpu_tests_failed:
            result["failed_tests"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
        if not self.dry and counts["passed"] == 0:
            result["note"] = "no GPU test ran"
        return result

    def export(self) -> dict[str, Any]:
        proc = self.cli(self.export_args(), timeout_s=600, log="export")
        version = self.repo / self.model / "1"
        files = {p.name: round(p.stat().st_size / 1e6, 2) for p in sorted(version.glob("model*"))}
        if not files:
            raise StepError(f"export wrote no artifact: {proc.stdout.strip()[-400:]}")
        lines = proc.stdout.splitlines()
        refused = [line for line in lines if "refused" in line or "skipped" in line]
        parity = [line for line in lines if line.startswith("parity ")]
        return {"model": self.model, "files_mb": files, "parity": parity, "refused_or_skipped": refused}

    def bench(self) -> dict[str, Any]:
        runs: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for backend, precision, graphs in bench_matrix():
            label = {"backend": backend, "precision": precision, "cuda_graphs": graphs}
            reason = self._bench_skip(backend, precision, graphs)
            if reason is None and self.step_left_s() < 10:
                reason = "this step's share of the time is spent"
            if reason is not None:
                skipped.append({**label, "reason": reason})
                continue
            log = f"bench-{backend}-{precision}-{'graphs' if graphs else 'eager'}"
            try:
                proc = self.cli(self.bench_args(backend, precision, graphs), timeout_s=240, log=log)
            except StepError as exc:
                runs.append({**label, "error": str(exc)})
                self.report["errors"][f"bench {log}"] = str(exc)
                continue
            result = json.loads(proc.stdout.strip().splitlines()[-1])
            runs.append({**label, "device": result["device"], "engine_images_per_s": result["engine_images_per_s"]})
        return {"model": self.model, "batch_sizes": self.args.batch_sizes, "runs": runs, "skipped": skipped}

    def _bench_skip(self, backend: str, precision: str, graphs: bool) -> str | None:
        """Why this combination is not measured (None: it is); what cannot exist anywhere is said first."""
        if backend == "aoti" and precision == "bf16":
            return "no bf16 AOTInductor package (a package keeps the precision it was compiled in)"
        if backend == "onnxruntime" and precision == "bf16":
            return "no bf16 ONNX artifact (export writes fp32 and fp16)"
        if backend == "onnxruntime" and self.device == "cuda" and not self.ort_cuda:
            return "onnxruntime has no CUDA execution provider here (the CPU build is installed)"
        artifact = {"onnxruntime": "model.onnx", "torchscript": "model.pt", "aoti": AOTI_FILE[self.device]}[backend]
        if not (self.repo / self.model / "1" / artifact).is_file():
            return f"export wrote no {artifact} (see the export step)"
        if self.device == "cpu" and (precision != "fp32" or not graphs):
            return "on the CPU: reduced precision and CUDA graphs are GPU-only (measured once, fp32)"
        if backend == "onnxruntime" and not graphs and self.device == "cuda":
            return "CUDA graphs are a torch-runtime setting; onnxruntime measured once"
        return None

    def decode(self) -> dict[str, Any]:
        result = json.loads(self.cli(self.decode_args(), timeout_s=180, log="decode").stdout.strip().splitlines()[-1])
        keys = ("decode_cpu_images_per_s", "decode_gpu_images_per_s", "decode_gpu_skipped", "decode_workers")
        out = {k: result[k] for k in keys if k in result}
        out["batch"] = self.args.decode_batch
        if "decode_gpu_images_per_s" in out:
            out["gpu_to_cpu_ratio"] = out["decode_gpu_images_per_s"] / out["decode_cpu_images_per_s"]
        return out

    def serve_loadtest(self) -> dict[str, Any]:
        config = self.repo / self.model / "config.toml"
        config.write_text(self.serve_config())
        # Imported here: the carried packages (.site) are importable only once the install step has run.
        sys.path[:0] = [p for p in (str(ROOT), str(self.site)) if p not in sys.path]
        from service import launcher

        started = time.monotonic()
        server = launcher.start(self.repo, "--max-images", "64", log=self.out / "server.log", env=self.env,
                                ready_timeout_s=max(1.0, min(300.0, self.step_left_s())))  # fmt: skip
        ready_s = time.monotonic() - started
        try:
            closed = self.cli(self.loadtest_args(server.url, "closed"), timeout_s=300, log="loadtest-closed")
            closed_result = json.loads(closed.stdout.splitlines()[-1])
            slo = self.cli(self.loadtest_args(server.url, "slo"), timeout_s=300, log="loadtest-slo")
            slo_result = json.loads(slo.stdout.splitlines()[-1])
        finally:
            server.stop(60)
        return {"model": self.model, "config": config.read_text(), "ready_after_s": round(ready_s, 1),
                "closed": [step_summary(s) for s in closed_result.get("steps", [])],
                "slo_p99_ms": self.args.slo_p99_ms, "slo": slo_result.get("slo")}  # fmt: skip

    def train(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        proc = self.cli(self.train_args("digits.pt"), timeout_s=300, log="train")
        out["single"] = {"device": self.device, "amp_and_channels_last": self.device == "cuda",
                         "result": last_line(proc.stdout)}  # fmt: skip
        if self.gpus >= 2:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.gpus}",
                   "-m", "service.cli", *self.train_args("digits-ddp.pt"), "--no-progress"]  # fmt: skip
            proc = self.run(cmd, 300, "train-ddp")
            if proc.returncode != 0:
                raise StepError(f"DDP training exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
            out["ddp"] = {"gpus": self.gpus, "result": last_line(proc.stdout)}
        else:
            reason = "no CUDA device" if not self.gpus else f"{self.gpus} GPU: DDP needs two or more"
            self.report["skipped"]["train.ddp"] = reason
            out["ddp"] = {"skipped": reason}
        return out

    # ---- all of it ------------------------------------------------------------------------------------------
    def main(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.repo.exists():
            shutil.rmtree(self.repo)
        try:
            self.step("environment", self.environment)
            self.step("install", self.install, after="environment")
            self.step("gpu_tests", self.gpu_tests, after="environment")
            self.step("export", self.export, after="environment")
            for name in ("bench", "decode", "serve_loadtest"):
                self.step(name, getattr(self, name), after="export")
            self.step("train", self.train, after="environment")
        finally:
            self.write()
            say(f"report: {self.out / 'report.md'} and report.json ({self.report['seconds_total']:.0f} s)")
        failed = bool(self.gpu_tests_failed) or bool(self.report["errors"])
        return 1 if failed else 0

    def write(self) -> None:
        """The report as it stands (after every step, so that a check stopped half way still leaves one)."""
        self.report["seconds_total"] = round(time.monotonic() - self.started, 1)
        self.report["command_seconds"] = self.timings
        self.report["gpu_tests_failed"] = bool(self.gpu_tests_failed)
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        try:
            text = markdown(self.report)
        except Exception as exc:  # a bug of the rendering must not cost the report: the numbers are in the JSON
            text = f"# visionserve {self.report['kind']}\n\nThe report could not be drawn ({exc!r}): see report.json.\n"
        (self.out / "report.md").write_text(text)


# torch alone is needed; torchvision and onnxruntime are reported, or said to be missing.
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
AOTI_FILE = {"cpu": "model.pt2", "cuda": "model.cuda.pt2"}


def gpu_test_files() -> list[str]:
    """Every test file that holds a GPU test, found by its marker: named to pytest, so that nothing else of the
    suite is collected (its other files import tools the GPU machine lacks)."""
    found = [p for p in sorted((ROOT / "tests").rglob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    return [str(p.relative_to(ROOT)) for p in found]


class StepError(Exception):
    """A step that failed; its message goes into the report."""


def say(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def _ints(text: str) -> list[int]:
    values = [int(x) for x in text.split(",") if x.strip().isdigit()]
    if not values or min(values) < 1 or len(values) != len([x for x in text.split(",") if x.strip()]):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0] if __doc__ else None
    p = argparse.ArgumentParser(
        "gpu_check", description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny sizes (for CI)")
    p.add_argument("--out", default="gpu-check-report", help="folder for report.json, report.md and the logs")
    p.add_argument("--wheels", default=".whl", help="folder of carried wheels to install what is missing from")
    p.add_argument("--site", default=".site", help="folder the carried wheels are installed into (on PYTHONPATH)")
    p.add_argument("--budget-s", type=float, default=545.0, help="time budget, cut per step (the same in the dry run)")
    p.add_argument("--skip", default="", help=f"comma-separated steps to skip, of: {', '.join(SECTIONS[2:])}")
    p.add_argument("--fail-step", default=None, help="make this step fail (proves that the next still runs)")
    p.add_argument("--list-wheels", default=None, metavar="PYTHON_VERSION",
                   help="print the `pip download` command of the carried wheels for this Python, and exit")  # fmt: skip
    p.add_argument("--batch-sizes", type=_ints, default=None, help="bench batch sizes; None: 1,8,32,64,128 (dry 1,4)")
    p.add_argument("--seconds", type=float, default=None, help="bench seconds per figure; None: 0.5 (dry 0.05)")
    p.add_argument("--concurrency", type=_ints, default=None, help="closed-loop clients; None: 1,2,4,...,256 (dry 1,2)")
    p.add_argument("--loadtest-s", type=float, default=None, help="loadtest seconds per step; None: 4 (dry 0.5)")
    p.add_argument("--slo-p99-ms", type=float, default=15.0, help="the p99 target of the open-loop search")
    p.add_argument("--pytest-timeout-s", type=float, default=240.0, help="most seconds `pytest -m gpu` may take")
    p.add_argument("--pytest-args", nargs="*", default=[], help="extra arguments for `pytest -m gpu`")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    dry = args.dry_run
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.batch_sizes = args.batch_sizes or ([1, 4] if dry else [1, 8, 32, 64, 128])
    args.seconds = args.seconds or (0.05 if dry else 0.5)
    args.concurrency = args.concurrency or ([1, 2] if dry else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    args.loadtest_s = args.loadtest_s or (0.5 if dry else 4.0)
    args.loadtest_warmup_s = 0.2 if dry else 1.0
    args.loadtest_processes = 1 if dry else 4
    args.slo_start_rate = 20 if dry else 500
    args.slo_max_steps = 2 if dry else 6
    args.train_epochs = 1 if dry else 3
    args.train_input_size = 8 if dry else 32  # smallcnn's own 32; 8, the digits' own size: an epoch 3.1 s -> 0.2 s
    args.decode_batch = 4 if dry else 64
    args.serve_batch = 4 if dry else 64
    args.serve_instances = 1 if dry else 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list_wheels:
        print(" ".join(download_command(args.list_wheels)))
        return 0
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main())
