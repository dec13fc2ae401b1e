"""Prove every GPU path in one command (``make gpu-check``), and write one report of every number.

On a GPU machine, in order, each step a subprocess through the command line (``python -m service.cli ...``) so that
what is measured is what users run:

1. environment: device name, driver, torch / CUDA / torchvision / onnxruntime versions, providers, GPU count;
2. install: the modules the project needs that this machine lacks, from wheels carried in ``.whl/`` into
   ``.site/`` (``pip install --no-index --no-deps --target``; torch, torchvision, numpy and the other packages
   the machine brings are never installed from ``.whl/``, even when a wheel is there);
3. ``pytest -m gpu``: every CUDA test (the run fails when one fails);
4. export: resnet50 (224x224, initial weights) as ONNX, TorchScript and AOTInductor for CUDA, fp32 and fp16, gated;
5. bench: the runtime alone at batch 1/8/32/64/128 for each GPU runtime, precision and CUDA graphs on/off
   (onnxruntime only when its CUDA execution provider is there; AOTInductor has no bf16 package);
6. decode: nvJPEG batch decode against the CPU decoding pool on every core, on the same JPEGs;
7. serve resnet50 fp16 and load it over HTTP on the same machine: closed loop at 1..256 clients, then the highest
   open-loop rate whose p99 stays under 15 ms;
8. train smallcnn on digits on CUDA (AMP and channels-last are what ``train`` does there), and with
   DistributedDataParallel through torchrun where two or more GPUs exist.

Every step that cannot run says why in the report (``skipped``). ``--dry-run`` runs the same steps on the CPU with
tiny sizes (smallcnn, short durations), so CI proves that the command itself works. The exit status is 1 when a GPU
test fails or a step errs, else 0. Budget: under 9 minutes on one H100 (each step checks the time left and is
skipped, with that reason, when the budget is spent).
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

ROOT = Path(__file__).resolve().parent.parent
# Import name -> distribution name, for what the project needs beyond what the GPU machine brings.
NEEDED = {
    "litestar": "litestar", "msgspec": "msgspec", "uvicorn": "uvicorn", "httptools": "httptools",
    "multipart": "multipart", "python_multipart": "python-multipart", "litestar_htmx": "litestar-htmx",
    "polyfactory": "polyfactory", "faker": "faker", "rich_click": "rich-click", "sniffio": "sniffio",
    "sklearn": "scikit-learn", "scipy": "scipy", "joblib": "joblib", "threadpoolctl": "threadpoolctl",
    "onnxscript": "onnxscript", "onnx_ir": "onnx-ir", "ml_dtypes": "ml-dtypes", "zmq": "pyzmq",
}  # fmt: skip
# Never installed from .whl/: the GPU machine's own builds (a second torch would break CUDA there).
NEVER_INSTALL = ("torch", "torchvision", "numpy", "pillow", "onnx", "onnxruntime", "onnxruntime-gpu", "triton")
SECTIONS = ("environment", "install", "gpu_tests", "export", "bench", "decode", "serve_loadtest", "train")


class Check:
    """Runs the steps, keeps every number and every reason, and writes the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.dry_run
        self.out = Path(args.out).resolve()
        self.started = time.monotonic()
        self.report: dict[str, Any] = {"kind": "dry run (CPU, tiny sizes)" if self.dry else "GPU check",
                                       "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
                                       "sections": {}, "skipped": {}, "errors": {}}  # fmt: skip
        site = Path(args.site).resolve()
        path = [str(ROOT), str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1"}
        self.site = site
        self.repo = self.out / "repo"
        self.model = "smallcnn" if self.dry else "resnet50"

    # ---- plumbing -------------------------------------------------------------------------------------------
    def left_s(self) -> float:
        return float(self.args.budget_s) - (time.monotonic() - self.started)

    def run(self, cmd: list[str], timeout_s: float, log: str) -> subprocess.CompletedProcess[str]:
        """Run ``cmd`` from the repository root with the carried packages on the path; keep its output."""
        timeout = max(5.0, min(timeout_s, self.left_s()))
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            (self.out / f"{log}.log").write_text(f"$ {' '.join(cmd)}\n(timed out after {timeout:.0f} s)\n")
            raise StepError(f"{' '.join(cmd[2:5])} ran past {timeout:.0f} s") from exc
        (self.out / f"{log}.log").write_text(f"$ {' '.join(cmd)}\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        self.timings[log] = round(time.monotonic() - started, 1)
        return proc

    def cli(self, *args: str, timeout_s: float, log: str) -> subprocess.CompletedProcess[str]:
        proc = self.run([sys.executable, "-m", "service.cli", *args, "--no-progress"], timeout_s, log)
        if proc.returncode != 0:
            raise StepError(f"visionserve {args[0]} exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
        return proc

    def step(self, name: str, fn: Any, *, min_left_s: float = 20.0) -> None:
        if self.left_s() < min_left_s:
            self.report["skipped"][name] = f"time budget: {self.left_s():.0f} s left of {self.args.budget_s:.0f} s"
            return
        if name in self.args.skip:
            self.report["skipped"][name] = "--skip"
            return
        say(f"{name} ({self.left_s():.0f} s left)")
        started = time.monotonic()
        try:
            self.report["sections"][name] = fn()
        except StepError as exc:
            self.report["errors"][name] = str(exc)
            say(f"  error: {exc}")
        except Exception as exc:  # a bug of this script: recorded, and the other steps still run
            self.report["errors"][name] = f"{type(exc).__name__}: {exc}"
            say(f"  error: {type(exc).__name__}: {exc}")
        self.report.setdefault("seconds", {})[name] = round(time.monotonic() - started, 1)

    # ---- steps ----------------------------------------------------------------------------------------------
    def environment(self) -> dict[str, Any]:
        code = (
            "import json, torch, torchvision, onnxruntime as o; c = torch.cuda.is_available(); "
            "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
            "'torchvision': torchvision.__version__, 'onnxruntime': o.__version__, "
            "'onnxruntime_providers': o.get_available_providers(), 'cuda_available': c, "
            "'gpus': torch.cuda.device_count() if c else 0, "
            "'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if c else [], "
            "'cudnn': torch.backends.cudnn.version() if c else None}))"
        )
        proc = self.run([sys.executable, "-c", code], 120, "environment")
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
        self.ort_cuda = "CUDAExecutionProvider" in env["onnxruntime_providers"]
        if not self.dry and not self.gpus:
            raise StepError("no usable CUDA device: run with --dry-run on a machine without a GPU")
        return env

    def install(self) -> dict[str, Any]:
        import importlib.util

        missing = {mod: NEEDED[mod] for mod in self._unimportable(list(NEEDED))}
        wheels_dir = Path(self.args.wheels)
        wheels = sorted(wheels_dir.glob("*.whl")) if wheels_dir.is_dir() else []
        size_mb = sum(w.stat().st_size for w in wheels) / 1e6
        chosen, refused = choose_wheels(wheels, set(missing.values()))
        result: dict[str, Any] = {
            "missing_before": sorted(missing.values()),
            "wheels_dir": str(wheels_dir),
            "wheels_mb": round(size_mb, 1),
            "installed": [w.name for w in chosen],
            "refused_never_reinstalled": [w.name for w in refused],
        }
        if chosen:
            cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--disable-pip-version-check", "--upgrade", "--target", str(self.site),
                   *map(str, chosen)]  # fmt: skip
            proc = self.run(cmd, 300, "install")
            if proc.returncode != 0:
                raise StepError(f"pip install from {wheels_dir} failed: {proc.stderr.strip()[-400:]}")
        importlib.invalidate_caches()
        still = sorted(NEEDED[mod] for mod in self._unimportable(list(missing)))
        result["missing_after"] = still
        if importlib.util.find_spec("service") is None:  # pragma: no cover - the script runs from the checkout
            raise StepError("run from the repository root")
        return result

    def _unimportable(self, modules: list[str]) -> list[str]:
        """The modules that fail to import, tried in one fresh interpreter with the carried packages on the path."""
        code = (
            "import importlib, sys\nfor m in sys.argv[1:]:\n    try:\n        importlib.import_module(m)\n"
            "    except Exception:\n        print(m)"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, *modules], cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120
        )
        return proc.stdout.split()

    def gpu_tests(self) -> dict[str, Any]:
        junit = self.out / "gpu-tests.xml"
        # The dry run collects only the files that hold GPU tests (collecting the whole suite costs ~30 s on 2 cores).
        paths = ["tests/service/test_gpu.py", "tests/service/test_preprocess.py"] if self.dry else []
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *paths, *self.args.pytest_args]  # fmt: skip
        proc = self.run(cmd, self.args.pytest_timeout_s, "gpu-tests")
        counts = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
        if junit.is_file():
            text = junit.read_text()
            suite = re.search(r"<testsuite [^>]*>", text)
            attrs = dict(re.findall(r'(\w+)="([^"]*)"', suite.group(0))) if suite else {}
            total = int(attrs.get("tests", 0))
            counts.update({k: int(attrs.get(a, 0)) for k, a in (("failed", "failures"), ("errors", "errors"),
                                                                ("skipped", "skipped"))})  # fmt: skip
            counts["passed"] = total - counts["failed"] - counts["errors"] - counts["skipped"]
        tail = proc.stdout.strip().splitlines()[-1:] or [""]
        result = {**counts, "exit_code": proc.returncode, "summary": tail[0]}
        self.gpu_tests_failed = proc.returncode not in (0, 5) or bool(counts["failed"] or counts["errors"])
        if self.gpu_tests_failed:
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
            result["failed_tests"] = failed
        if not self.dry and counts["passed"] == 0:
            result["note"] = "no GPU test ran"
        return result

    def export(self) -> dict[str, Any]:
        args = ["export", "--arch", self.model, "--name", self.model, "--repository", str(self.repo),
                "--formats", "onnx,torchscript,aoti", "--no-latency"]  # fmt: skip
        if not self.dry:
            # The CPU package of resnet50 is not benched here and its C++ compile would cost minutes of the budget.
            args += ["--fp16", "--aoti-devices", "cuda", "--max-batch-size", str(max(self.args.batch_sizes))]
        else:
            args += ["--max-batch-size", str(max(self.args.batch_sizes))]
        proc = self.cli(*args, timeout_s=420, log="export")
        version = self.repo / self.model / "1"
        files = {p.name: round(p.stat().st_size / 1e6, 2) for p in sorted(version.glob("model*"))}
        parity = [line for line in proc.stdout.splitlines() if line.startswith("parity ")]
        return {"model": self.model, "files_mb": files, "parity": parity}

    def bench_matrix(self) -> list[tuple[str, str, bool]]:
        out = []
        for backend in ("torchscript", "aoti", "onnxruntime"):
            for precision in ("fp32", "fp16", "bf16"):
                for graphs in (True, False):
                    out.append((backend, precision, graphs))
        return out

    def bench(self) -> dict[str, Any]:
        runs: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        device = "cpu" if self.dry else "cuda"
        for backend, precision, graphs in self.bench_matrix():
            label = {"backend": backend, "precision": precision, "cuda_graphs": graphs}
            reason = self._bench_skip(backend, precision, graphs)
            if reason is None and self.left_s() < 30:
                reason = "time budget"
            if reason is not None:
                skipped.append({**label, "reason": reason})
                continue
            args = ["bench", "--model", self.model, "--repository", str(self.repo), "--device", device,
                    "--backend", backend, "--figures", "engine", "--json",
                    "--batch-sizes", ",".join(map(str, self.args.batch_sizes)),
                    "--seconds", str(self.args.seconds)]  # fmt: skip
            if not self.dry:
                args += ["--precision", precision, "--cuda-graphs", "on" if graphs else "off"]
            log = f"bench-{backend}-{precision}-{'graphs' if graphs else 'eager'}"
            try:
                proc = self.cli(*args, timeout_s=240, log=log)
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
        if self.dry and (precision != "fp32" or not graphs):
            return "dry run on the CPU: reduced precision and CUDA graphs are GPU-only (measured once, fp32)"
        if backend == "onnxruntime":
            if not self.dry and not self.ort_cuda:
                return "onnxruntime has no CUDA execution provider here (the CPU build is installed)"
            if not graphs and not self.dry:
                return "CUDA graphs are a torch-runtime setting; onnxruntime measured once"
        return None

    def decode(self) -> dict[str, Any]:
        size = 4 if self.dry else 64
        args = ["bench", "--model", self.model, "--repository", str(self.repo), "--figures", "decode",
                "--batch-sizes", str(size), "--seconds", str(self.args.seconds), "--json",
                "--device", "cpu" if self.dry else "cuda", "--backend", "torchscript"]  # fmt: skip
        result = json.loads(self.cli(*args, timeout_s=180, log="decode").stdout.strip().splitlines()[-1])
        keys = ("decode_cpu_images_per_s", "decode_gpu_images_per_s", "decode_gpu_skipped", "decode_workers")
        out = {k: result[k] for k in keys if k in result}
        out["batch"] = size
        if "decode_gpu_images_per_s" in out:
            out["gpu_to_cpu_ratio"] = out["decode_gpu_images_per_s"] / out["decode_cpu_images_per_s"]
        return out

    def serve_loadtest(self) -> dict[str, Any]:
        config = self.repo / self.model / "config.toml"
        if self.dry:
            config.write_text('device = "cpu"\nmax_batch_size = 4\nmax_queue_delay_ms = 2.0\n')
        else:
            config.write_text(
                'device = "cuda"\nprecision = "fp16"\nmax_batch_size = 64\nmax_queue_delay_ms = 2.0\ninstances = 2\n'
            )
        # Imported here: the carried packages (.site) are importable only once the install step has run.
        sys.path[:0] = [p for p in (str(ROOT), str(self.site)) if p not in sys.path]
        from service import launcher

        started = time.monotonic()
        server = launcher.start(self.repo, "--max-images", "64", log=self.out / "server.log", env=self.env,
                                ready_timeout_s=min(300.0, self.left_s()))  # fmt: skip
        ready_s = time.monotonic() - started
        url = server.url
        try:
            closed = ["loadtest", "--url", url, "--model", self.model, "--mode", "closed", "--json",
                      "--concurrency", ",".join(map(str, self.args.concurrency)),
                      "--duration", str(self.args.loadtest_s), "--warmup", str(self.args.loadtest_warmup_s),
                      "--image-size", "500x375", "--processes", str(self.args.loadtest_processes)]  # fmt: skip
            closed_result = json.loads(self.cli(*closed, timeout_s=300, log="loadtest-closed").stdout.splitlines()[-1])
            slo = ["loadtest", "--url", url, "--model", self.model, "--json", "--slo-p99-ms", str(self.args.slo_p99_ms),
                   "--rate", str(self.args.slo_start_rate), "--slo-max-steps", str(self.args.slo_max_steps),
                   "--duration", str(self.args.loadtest_s), "--warmup", str(self.args.loadtest_warmup_s),
                   "--processes", str(self.args.loadtest_processes)]  # fmt: skip
            slo_result = json.loads(self.cli(*slo, timeout_s=300, log="loadtest-slo").stdout.splitlines()[-1])
        finally:
            server.stop(60)
        return {"model": self.model, "config": config.read_text(), "ready_after_s": round(ready_s, 1),
                "closed": [_step_summary(s) for s in closed_result.get("steps", [])],
                "slo_p99_ms": self.args.slo_p99_ms, "slo": slo_result.get("slo")}  # fmt: skip

    def train(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        device = "cpu" if self.dry else "cuda"
        args = ["train", "--arch", "smallcnn", "--dataset", "digits", "--device", device,
                "--epochs", str(self.args.train_epochs), "--out", str(self.out / "digits.pt")]  # fmt: skip
        proc = self.cli(*args, timeout_s=300, log="train")
        out["single"] = {"device": device, "amp_and_channels_last": device == "cuda", "result": last_line(proc.stdout)}
        if self.gpus >= 2:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.gpus}",
                   "-m", "service.cli", "train", "--arch", "smallcnn", "--dataset", "digits", "--device", "cuda",
                   "--epochs", str(self.args.train_epochs), "--out", str(self.out / "digits-ddp.pt"),
                   "--no-progress"]  # fmt: skip
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
        self.timings: dict[str, float] = {}
        self.gpus, self.ort_cuda, self.gpu_tests_failed = 0, False, False
        self.step("environment", self.environment, min_left_s=0)
        if "environment" in self.report["errors"]:
            return self.finish()
        self.step("install", self.install, min_left_s=0)
        self.step("gpu_tests", self.gpu_tests)
        self.step("export", self.export)
        if "export" in self.report["sections"]:
            self.step("bench", self.bench)
            self.step("decode", self.decode)
            self.step("serve_loadtest", self.serve_loadtest, min_left_s=60)
        else:
            for name in ("bench", "decode", "serve_loadtest"):
                self.report["skipped"].setdefault(name, "the export failed or was skipped")
        self.step("train", self.train)
        return self.finish()

    def finish(self) -> int:
        self.report["seconds_total"] = round(time.monotonic() - self.started, 1)
        self.report["command_seconds"] = self.timings
        self.report["gpu_tests_failed"] = bool(self.gpu_tests_failed)
        (self.out / "report.json").write_text(json.dumps(self.report, indent=2) + "\n")
        (self.out / "report.md").write_text(markdown(self.report))
        say(f"report: {self.out / 'report.md'} and report.json ({self.report['seconds_total']:.0f} s)")
        failed = bool(self.gpu_tests_failed) or bool(self.report["errors"])
        return 1 if failed else 0


def choose_wheels(wheels: Sequence[Path], missing: set[str]) -> tuple[list[Path], list[Path]]:
    """(the wheels to install: those of missing distributions, the wheels refused: the machine's own packages)."""
    chosen, refused = [], []
    for wheel in wheels:
        dist = wheel.name.split("-")[0].lower().replace("_", "-")
        if dist in NEVER_INSTALL or dist.startswith("nvidia-"):
            refused.append(wheel)
        elif dist in {m.lower() for m in missing}:
            chosen.append(wheel)
    return chosen, refused


class StepError(Exception):
    """A step that failed; its message goes into the report."""


def say(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-2] if len(lines) >= 2 and lines[-1].startswith("checkpoint written") else (lines[-1] if lines else "")


def _step_summary(step: dict[str, Any]) -> dict[str, Any]:
    """One loadtest step without its histogram: clients or rate, throughput, errors, latency percentiles."""
    keep = ("step", "concurrency", "rate", "requests", "errors", "requests_per_s", "images_per_s", "latency_ms",
            "client_limited", "client_cpu")  # fmt: skip
    return {k: step[k] for k in keep if k in step}


def markdown(report: dict[str, Any]) -> str:
    """The report for people: one section per step, every number, and what was skipped and why."""
    lines = [f"# visionserve {report['kind']}", "", f"Started {report['started_at']}, "
             f"{report['seconds_total']:.0f} s in all.", ""]  # fmt: skip
    sections = report["sections"]
    for name in SECTIONS:
        lines += [f"## {name}", ""]
        if name in report["errors"]:
            lines += [f"ERROR: {report['errors'][name]}", ""]
        if name in report["skipped"]:
            lines += [f"skipped: {report['skipped'][name]}", ""]
        body = sections.get(name)
        if name == "bench" and body:
            sizes = [str(b) for b in body["batch_sizes"]]
            lines += ["| runtime | precision | CUDA graphs | " + " | ".join(f"batch {s}" for s in sizes) + " |",
                      "|---|---|---|" + "---:|" * len(sizes)]  # fmt: skip
            for run in body["runs"]:
                rates = run.get("engine_images_per_s", {})
                cells = [f"{rates[s]:.1f}" if s in rates else run.get("error", "-")[:40] for s in sizes]
                graphs = "on" if run["cuda_graphs"] else "off"
                lines.append(f"| {run['backend']} | {run['precision']} | {graphs} | " + " | ".join(cells) + " |")
            lines += ["", "engine images/s (the runtime alone on ready uint8 batches)", ""]
            for s in body["skipped"]:
                lines.append(f"- skipped {s['backend']} {s['precision']} graphs {s['cuda_graphs']}: {s['reason']}")
            lines.append("")
        elif body is not None:
            lines += ["```json", json.dumps(body, indent=2), "```", ""]
    other = {k: v for k, v in report["skipped"].items() if k not in SECTIONS}
    if other or report["errors"]:
        lines += ["## skipped and errors", ""]
        lines += [f"- skipped {k}: {v}" for k, v in other.items()]
        lines += [f"- error {k}: {v}" for k, v in report["errors"].items() if k not in SECTIONS]
        lines.append("")
    lines += [f"GPU tests failed: {report['gpu_tests_failed']}", ""]
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
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
    p.add_argument("--budget-s", type=float, default=None, help="time budget; None: 530 s, or 280 s with --dry-run")
    p.add_argument("--skip", default="", help=f"comma-separated steps to skip, of: {', '.join(SECTIONS[2:])}")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="bench batch sizes; None: 1,8,32,64,128 (dry 1,4)")
    p.add_argument("--seconds", type=float, default=None, help="bench seconds per figure; None: 0.5 (dry 0.2)")
    p.add_argument("--concurrency", type=_ints, default=None, help="closed-loop clients; None: 1,2,4,...,256 (dry 1,2)")
    p.add_argument("--loadtest-s", type=float, default=None, help="loadtest seconds per step; None: 4 (dry 0.5)")
    p.add_argument("--slo-p99-ms", type=float, default=15.0, help="the p99 target of the open-loop search")
    p.add_argument("--pytest-timeout-s", type=float, default=240.0, help="most seconds `pytest -m gpu` may take")
    p.add_argument("--pytest-args", nargs="*", default=[], help="extra arguments for `pytest -m gpu`")
    return p


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    dry = args.dry_run
    args.budget_s = args.budget_s or (280.0 if dry else 530.0)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.batch_sizes = args.batch_sizes or ([1, 4] if dry else [1, 8, 32, 64, 128])
    args.seconds = args.seconds or (0.2 if dry else 0.5)
    args.concurrency = args.concurrency or ([1, 2] if dry else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    args.loadtest_s = args.loadtest_s or (0.5 if dry else 4.0)
    args.loadtest_warmup_s = 0.2 if dry else 1.0
    args.loadtest_processes = 1 if dry else 4
    args.slo_start_rate = 20 if dry else 500
    args.slo_max_steps = 2 if dry else 6
    args.train_epochs = 1 if dry else 3
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return Check(parse_args(argv)).main()


if __name__ == "__main__":
    sys.exit(main())
