"""Prove every GPU path in one command (``make gpu-check``, ``visionserve bench gpu-check``), and write one report of
every number.

Each step a subprocess through the command line (``python -m service.cli ...``), so that what is measured is what
users run: environment, install (from the carried wheels), ``pytest -m gpu``, export, bench, decode, serve_loadtest
and train. Each fails alone, within its share of the budget (545 s); ``--dry-run``: the same steps on the CPU with tiny
sizes. Exit 1 when a GPU test fails or a step errs. The steps, their shares and the wheels: docs/gpu-check.md.
"""

from __future__ import annotations

import argparse
import platform
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from service.bench.flags import Flag, ints, sized
from service.bench.runner import ROOT, StepError, StepRunner, flags, last_line, parser, step_summary
from service.bench.wheels import download_command

SECTIONS = ("environment", "install", "gpu_tests", "export", "bench", "decode", "serve_loadtest", "train")
AOTI_FILE = {"cpu": "model.pt2", "cuda": "model.cuda.pt2"}
# key: (the real run's, the dry run's, help[, type]); the flags' defaults, and figures no flag sets (FIXED)
SIZES: dict[str, tuple[Any, ...]] = {
    "batch_sizes": ([1, 8, 32, 64, 128], [1, 4], "bench batch sizes", ints),
    "seconds": (0.5, 0.05, "bench seconds per figure"),
    "concurrency": ([1, 2, 4, 8, 16, 32, 64, 128, 256], [1, 2], "closed-loop clients", ints),
    "loadtest_s": (4.0, 0.5, "loadtest seconds per step"),
}
FIXED = {"loadtest_warmup_s": (1.0, 0.2), "loadtest_processes": (4, 1), "slo_start_rate": (500, 20),
         "slo_max_steps": (6, 2), "train_epochs": (3, 1),
         "train_input_size": (32, 8),  # smallcnn's own 32; 8, the digits' own size: an epoch 3.1 s -> 0.2 s
         "decode_batch": (64, 4), "serve_batch": (64, 4), "serve_instances": (2, 1)}  # fmt: skip
FLAGS: list[Flag] = [
    *flags(what="steps", out="gpu-check-report", budget_s=545.0, skippable=SECTIONS[2:]),
    ("--list-wheels", None, "print the carried wheels' `pip download` command for this Python, and exit (default: no)"),
    ("--slo-p99-ms", 15.0, "the p99 target of the open-loop search"),
    ("--pytest-timeout-s", 240.0, "most seconds `pytest -m gpu` may take"),
    ("--pytest-args", [], "extra arguments for `pytest -m gpu`"),
    *sized(SIZES, "--dry-run"),
]


class Check(StepRunner):
    """Runs the steps, keeps every number and every reason, and writes the report after each step."""

    prefix, kind = "gpu-check", "GPU check"
    # Each step's share of the 545 s budget on one H100 (scaled to another --budget-s). A step may also use what
    # the steps before it left unused; its commands are stopped at its deadline, so the steps after it keep their
    # shares. The environment's probe (a fresh interpreter importing torch, torchvision and onnxruntime) took its
    # whole 15 s share on a cold H100 machine (docs/performance.md) and nearly so in a dry run on a slow, busy
    # CPU: 35 s now.
    steps: ClassVar[dict[str, float]] = {"environment": 35, "install": 20, "gpu_tests": 150, "export": 130,
                                         "bench": 90, "decode": 20, "serve_loadtest": 80, "train": 20}  # fmt: skip
    after: ClassVar[dict[str, str]] = dict.fromkeys(("bench", "decode", "serve_loadtest"), "export")
    # The modules a step cannot run without, beyond torch (checked once the carried wheels are installed).
    needs: ClassVar[dict[str, tuple[str, ...]]] = {
        "gpu_tests": ("pytest",), "export": ("onnx", "onnxscript"), "bench": ("onnxruntime",), "decode": ("PIL",),
        "serve_loadtest": ("litestar", "uvicorn", "zmq", "msgspec", "httpx"), "train": ("sklearn",),
    }  # fmt: skip
    sizes, fixed = SIZES, FIXED

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.gpus, self.ort_cuda, self.gpu_tests_failed = 0, False, False

    def gpu_test_args(self, junit: Path) -> list[str]:
        return ["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                *gpu_test_files(), *self.args.pytest_args]  # fmt: skip

    def export_args(self) -> list[str]:
        # ONNX only where onnxruntime can run it on the device: a CPU build beside CUDA torch would spend the
        # export's share on an artifact that nothing here measures (and whose fp16 parity cannot be checked)
        formats = "onnx,torchscript,aoti" if self.device == "cpu" or self.ort_cuda else "torchscript,aoti"
        return self.export_command(formats, "--aoti-devices", self.device)

    def bench_args(self, backend: str, precision: str, graphs: bool) -> list[str]:
        more = ["--backend", backend, "--precision", precision, "--cuda-graphs", "on" if graphs else "off"]
        return self.bench_command("engine", self.args.batch_sizes, *more)

    def decode_args(self) -> list[str]:
        return self.bench_command("decode", [self.args.decode_batch], "--backend", "torchscript")

    def loadtest_args(self, url: str, mode: str) -> list[str]:
        common = ["loadtest", "--url", url, "--model", self.model,
                  *self.load_flags(self.args.loadtest_warmup_s, self.args.loadtest_processes)]  # fmt: skip
        if mode == "closed":
            return [*common, "--mode", "closed", "--concurrency", ",".join(map(str, self.args.concurrency)),
                    "--image-size", "500x375"]  # fmt: skip
        return [*common, "--slo-p99-ms", str(self.args.slo_p99_ms), "--rate", str(self.args.slo_start_rate),
                "--slo-max-steps", str(self.args.slo_max_steps)]  # fmt: skip

    def train_args(self, out: str) -> list[str]:
        return ["train", "--arch", "smallcnn", "--dataset", "digits", "--device", self.device,
                "--epochs", str(self.args.train_epochs), "--input-size", str(self.args.train_input_size),
                "--out", str(self.out / out)]  # fmt: skip

    def environment(self) -> dict[str, Any]:
        env = self.versions(120)
        env.update(machine=platform.machine(), driver=None)
        if shutil.which("nvidia-smi"):
            query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout else None
        self.gpus = int(env["gpus"])
        self.ort_cuda = "CUDAExecutionProvider" in (env.get("onnxruntime_providers") or [])
        return env

    def gpu_tests(self) -> dict[str, Any]:
        junit = self.out / "gpu-tests.xml"
        proc = self.run([sys.executable, *self.gpu_test_args(junit)], self.args.pytest_timeout_s, "gpu-tests")
        counts = junit_counts(junit)
        result = {**counts, "files": gpu_test_files(), "exit_code": proc.returncode, "summary": last_line(proc.stdout)}
        self.gpu_tests_failed = proc.returncode not in (0, 5) or bool(counts["failed"] or counts["errors"])
        if self.gpu_tests_failed:
            result["failed_tests"] = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, re.M)
        if not self.dry and counts["passed"] == 0:
            result["note"] = "no GPU test ran"
        return result

    def export(self) -> dict[str, Any]:
        proc = self.cli(self.export_args(), timeout_s=600, log="export")
        refused = [line for line in proc.stdout.splitlines() if "refused" in line or "skipped" in line]
        return {**self.exported(proc, "model*"), "refused_or_skipped": refused}

    def bench(self) -> dict[str, Any]:
        runs: list[dict[str, Any]] = []
        skipped: list[dict[str, Any]] = []
        for backend, precision, graphs in bench_matrix():
            label = {"backend": backend, "precision": precision, "cuda_graphs": graphs}
            if (reason := self._bench_skip(backend, precision, graphs)) is not None:
                skipped.append({**label, "reason": reason})
                continue
            log = f"bench-{backend}-{precision}-{'graphs' if graphs else 'eager'}"
            try:
                proc = self.cli(self.bench_args(backend, precision, graphs), timeout_s=240, log=log)
            except StepError as exc:
                runs.append({**label, "error": str(exc)})
                self.report["errors"][f"bench {log}"] = str(exc)
            else:
                result = self.json_line(proc)
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
        return "this step's share of the time is spent" if self.step_left_s() < 10 else None

    def decode(self) -> dict[str, Any]:
        result = self.json_line(self.cli(self.decode_args(), timeout_s=180, log="decode"))
        keys = ("decode_cpu_images_per_s", "decode_gpu_images_per_s", "decode_gpu_skipped", "decode_workers")
        out = {k: result[k] for k in keys if k in result}
        out["batch"] = self.args.decode_batch
        if "decode_gpu_images_per_s" in out:
            out["gpu_to_cpu_ratio"] = out["decode_gpu_images_per_s"] / out["decode_cpu_images_per_s"]
        return out

    def serve_loadtest(self) -> dict[str, Any]:
        config = self.repo / self.model / "config.toml"
        config.write_text(self.serve_config())
        from service import launcher  # here: the carried packages are importable once the install step has run

        started = time.monotonic()
        server = launcher.start(self.repo, "--max-images", "64", log=self.out / "server.log", env=self.env,
                                ready_timeout_s=max(1.0, min(300.0, self.step_left_s())))  # fmt: skip
        ready_s = time.monotonic() - started
        try:
            closed = self.cli(self.loadtest_args(server.url, "closed"), timeout_s=300, log="loadtest-closed")
            closed_result = self.json_line(closed)
            slo = self.cli(self.loadtest_args(server.url, "slo"), timeout_s=300, log="loadtest-slo")
            slo_result = self.json_line(slo)
        finally:
            server.stop(60)
        return {"model": self.model, "config": config.read_text(), "ready_after_s": round(ready_s, 1),
                "closed": [step_summary(s) for s in closed_result.get("steps", [])],
                "slo_p99_ms": self.args.slo_p99_ms, "slo": slo_result.get("slo")}  # fmt: skip

    def train(self) -> dict[str, Any]:
        proc = self.cli(self.train_args("digits.pt"), timeout_s=300, log="train")
        out: dict[str, Any] = {"single": {"device": self.device, "amp_and_channels_last": self.device == "cuda",
                                          "result": last_line(proc.stdout)}}  # fmt: skip
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

    def main(self) -> int:
        return super().main() or int(self.gpu_tests_failed)

    def totals(self) -> dict[str, Any]:
        return {"gpu_tests_failed": bool(self.gpu_tests_failed)}

    def draw(self, name: str, body: dict[str, Any]) -> list[str]:
        if name != "bench" or "batch_sizes" not in body:
            return super().draw(name, body)
        sizes = [str(b) for b in body["batch_sizes"]]
        lines = ["| runtime | precision | CUDA graphs | " + " | ".join(f"batch {s}" for s in sizes) + " |",
                 "|---|---|---|" + "---:|" * len(sizes)]  # fmt: skip
        for run in body["runs"]:
            rates = run.get("engine_images_per_s", {})
            cells = [f"{rates[s]:.1f}" if s in rates else run.get("error", "-")[:40] for s in sizes]
            graphs = "on" if run["cuda_graphs"] else "off"
            lines.append(f"| {run['backend']} | {run['precision']} | {graphs} | " + " | ".join(cells) + " |")
        lines += ["", "engine images/s (the runtime alone on ready uint8 batches)", ""]
        lines += [f"- skipped {s['backend']} {s['precision']} graphs {s['cuda_graphs']}: {s['reason']}"
                  for s in body["skipped"]]  # fmt: skip
        return [*lines, ""]

    def markdown(self) -> str:
        return super().markdown() + f"\nGPU tests failed: {self.report['gpu_tests_failed']}\n"


def gpu_test_files() -> list[str]:
    """Every test file that holds a GPU test, found by its marker: named to pytest, so that nothing else of the
    suite is collected (its other files import tools the GPU machine lacks)."""
    found = [p for p in sorted((ROOT / "tests").rglob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    return [str(p.relative_to(ROOT)) for p in found]


def junit_counts(junit: Path) -> dict[str, int]:
    suite = re.search(r"<testsuite [^>]*>", junit.read_text()) if junit.is_file() else None
    attrs = dict(re.findall(r'(\w+)="([^"]*)"', suite.group(0))) if suite else {}
    junit_names = {"failed": "failures", "errors": "errors", "skipped": "skipped"}
    counts = {k: int(attrs.get(a, 0)) for k, a in junit_names.items()}
    return {"passed": int(attrs.get("tests", 0)) - sum(counts.values()), **counts}


def bench_matrix() -> list[tuple[str, str, bool]]:
    return [(b, p, g) for b in ("torchscript", "aoti", "onnxruntime") for p in ("fp32", "fp16", "bf16")
            for g in (True, False)]  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    return parser("gpu_check", __doc__, FLAGS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(args: argparse.Namespace) -> int:
    if args.list_wheels:
        print(" ".join(download_command(args.list_wheels)))
        return 0
    return Check(args).main()


if __name__ == "__main__":
    sys.exit(main(parse_args(sys.argv[1:])))
