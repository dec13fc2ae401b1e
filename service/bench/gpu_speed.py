"""The GPU's own speed figures in one command (``make gpu-speed``, ``visionserve bench gpu-speed``): resnet50 served
from JPEG bytes, beside its in-process limit and LitServe on the same GPU, with one report of every number.

Each step a subprocess of the command line, so that what is measured is what users run: environment, install, export,
bench, litserve (:mod:`service.bench.litserve_app`, loaded by :mod:`service.bench.drive`), serve and detector; the load
generator and every server on the same split of the cores. Each fails alone, within its share of the budget (480 s);
``--dry-run``: the same commands on the CPU with tiny sizes. The steps, the targets and the shares: docs/gpu-speed.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from service.bench import runner
from service.bench.flags import Flag, ints, sized
from service.bench.runner import ROOT, StepError, StepRunner, flags, on_cpus, parser, split_cores, step_summary

SECTIONS = ("environment", "install", "export", "bench", "litserve", "serve", "detector")
SAID = {None: "not measured", True: "met", False: "MISSED"}  # a target's verdict
DETECTOR = ROOT / "examples" / "model_repository" / "digits-detect"
# key: (the real run's, the dry run's, help[, type]); the flags' defaults, and figures no flag sets (FIXED)
SIZES: dict[str, tuple[Any, ...]] = {
    "batch_sizes": ([1, 8, 32, 64, 128, 256], [1, 4], "bench batch sizes", ints),
    "seconds": (0.5, 0.05, "bench seconds per figure"),
    "concurrency": ([1, 4, 16, 32, 64, 128, 256], [1, 2], "served clients", ints),
    # dry: 0.5 s, as gpu-check's dry run: eight load steps, each with the server and its client busy on the same
    # cores the whole window; the figures are only checked to be there and positive
    "loadtest_s": (3.0, 0.5, "measured seconds per load step"),
    "client_cores": (4, 1, "cores for the load generator"),
}
FIXED = {
    "litserve_concurrency": ([64, 256], [1, 2]),  # its batches are 64: 256 saturates 8 workers
    "litserve_workers": ([8, 4, 2, 1], [1]),  # the likeliest best first, should the share run out
    "warmup_s": (1.0, 0.2), "load_processes": (4, 1), "serve_batch": (64, 4), "serve_instances": (2, 1),
    "serve_workers": (8, 1),
}  # fmt: skip
FLAGS: list[Flag] = [
    *flags(what="commands", out="gpu-speed-report", budget_s=480.0, skippable=SECTIONS[1:]),
    ("--slo-p99-ms", 15.0, "the p99 target at 70%% of the best throughput"),
    *sized(SIZES, "--dry-run"),
]


class Speed(StepRunner):
    """The steps, the commands they issue (one builder per command, for both runs) and their figures."""

    prefix, kind, config_head = "gpu-speed", "GPU speed", 'backend = "torchscript"\n'
    # Each step's share of the 480 s budget on one H100 (scaled to another --budget-s). The first import of torch
    # on a cold machine takes seconds to tens of seconds (the environment step pays it); the served steps start
    # servers that load resnet50 and capture its graphs, then sweep; LitServe starts once per worker count.
    steps: ClassVar[dict[str, float]] = {"environment": 30, "install": 20, "export": 60, "bench": 70, "litserve": 140,
                                         "serve": 130, "detector": 30}  # fmt: skip
    after: ClassVar[dict[str, str]] = dict.fromkeys(("bench", "litserve", "serve"), "export")
    needs: ClassVar[dict[str, tuple[str, ...]]] = {
        "litserve": ("litserve", "fastapi"), "serve": ("litestar", "uvicorn", "zmq", "msgspec", "httpx"),
        "detector": ("litestar", "uvicorn", "zmq", "msgspec"),
    }  # fmt: skip
    sizes, fixed = SIZES, FIXED

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.client_cpus, self.server_cpus = split_cores(sorted(os.sched_getaffinity(0)), args.client_cores)

    def export_args(self) -> list[str]:
        return self.export_command("torchscript")

    def bench_args(self, figures: str) -> list[str]:
        sizes = self.args.batch_sizes if figures == "engine" else [self.args.serve_batch]
        return self.bench_command(figures, sizes, "--backend", "torchscript", "--precision", self.precision,
                                  "--cuda-graphs", "on")  # fmt: skip

    def serve_flags(self) -> list[str]:
        return ["--workers", str(self.args.serve_workers), "--max-images", "1"]

    def load(self, url: str, concurrency: str, rate: float) -> list[str]:
        """A load generator's flags: closed loop at ``concurrency`` clients, or (none given) open loop at ``rate``
        requests/s, on 500x375 JPEGs."""
        mode = ["closed", "--concurrency", concurrency] if concurrency else ["open", "--rate", f"{rate:.1f}"]
        return ["--url", url, "--mode", *mode, *self.load_flags(self.args.warmup_s, self.args.load_processes),
                "--image-size", "500x375"]  # fmt: skip

    def loadtest_args(self, url: str, model: str, *, concurrency: int = 0, rate: float = 0.0) -> list[str]:
        load = self.load(url, str(concurrency) if concurrency else "", rate)
        return ["loadtest", "--model", model, "--protocol", "image", *load]

    def detector_args(self, url: str) -> list[str]:
        return [*self.loadtest_args(url, DETECTOR.name, concurrency=8), "--task", "detect"]

    def litserve_args(self, workers: int, port: int) -> list[str]:
        return [sys.executable, "-m", "service.bench.litserve_app", "--model-dir", str(self.repo / self.model / "1"),
                "--device", self.device, "--precision", self.precision, "--workers", str(workers),
                "--max-batch-size", "64", "--batch-timeout-s", "0.005", "--port", str(port)]  # fmt: skip

    def drive_args(self, url: str, *, concurrency: str = "", rate: float = 0.0) -> list[str]:
        return [sys.executable, "-m", "service.bench.drive", "--path", "/predict", *self.load(url, concurrency, rate)]

    def environment(self) -> dict[str, Any]:
        env = self.versions(60)
        env.update(client_cpus=self.client_cpus, server_cpus=self.server_cpus)
        if shutil.which("nvidia-smi"):
            smi = self.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                           30, "nvidia-smi")  # fmt: skip
            env["nvidia_smi"] = smi.stdout.strip()
        return env

    def export(self) -> dict[str, Any]:
        return self.exported(self.cli(self.export_args(), timeout_s=300, log="export"), "*.pt")

    def bench(self) -> dict[str, Any]:
        # On the servers' cores: the served figures are held against this pipeline, so it gets the same CPUs.
        cpus = self.server_cpus
        engine = self.json_line(self.cli(self.bench_args("engine"), timeout_s=240, log="bench-engine", cpus=cpus))
        proc = self.cli(self.bench_args("pipeline,decode"), timeout_s=180, log="bench-pipeline", cpus=cpus)
        pipeline = self.json_line(proc)
        keys = ("pipeline_images_per_s", "pipeline_gpu_decode_images_per_s", "decode_cpu_images_per_s",
                "decode_gpu_images_per_s", "decode_gpu_skipped", "decode_workers")  # fmt: skip
        return {"device": engine["device"], "precision": engine["precision"], "cuda_graphs": engine["cuda_graphs"],
                "engine_images_per_s": engine["engine_images_per_s"], "pipeline_batch": self.args.serve_batch,
                **{k: pipeline[k] for k in keys if k in pipeline}}  # fmt: skip

    def litserve(self) -> dict[str, Any]:
        runs: list[dict[str, Any]] = []
        for workers in self.args.litserve_workers:
            if self.step_left_s() < 15:
                runs.append({"workers": workers, "skipped": "this step's share of the time is spent"})
                continue
            try:
                with self.litserve_app(workers, max(1.0, min(120.0, self.step_left_s() - 5))) as (url, pid):
                    run = {"workers": workers, **self._sweep(url, pid, f"litserve-{workers}", litserve=True)}
            except (RuntimeError, StepError) as exc:
                run = {"workers": workers, "error": str(exc)[-600:]}
                self.report["errors"][f"litserve {workers} workers"] = run["error"]
            runs.append(run)
        best = max((r for r in runs if r.get("best_images_per_s")), key=lambda r: r["best_images_per_s"], default=None)
        if best is None:
            raise StepError("no LitServe run answered: see the runs' errors and litserve-*.log")
        return {"max_batch_size": 64, "batch_timeout_s": 0.005, "runs": runs, "best": best}

    def _start_server(self, repo: Path, log: str, ready_timeout_s: float) -> Any:
        """``visionserve serve`` on the servers' cores, through the launcher, once ready."""
        from service import launcher

        server = launcher.launch(repo, *self.serve_flags(), log=self.out / f"{log}.log", env=self.env,
                                 preexec_fn=on_cpus(self.server_cpus, session=True))  # fmt: skip
        server.own_group = True  # its preexec_fn started a session of its own: stop() may kill the whole group
        try:
            launcher.wait_ready(server, max(1.0, ready_timeout_s))
        except BaseException:
            server.stop(5)
            raise
        return server

    def serve(self) -> dict[str, Any]:
        (self.repo / self.model / "config.toml").write_text(self.serve_config())
        server = self._start_server(self.repo, "server", min(180.0, self.step_left_s() - 10))
        try:
            result = self._sweep(server.url, server.process.pid, "serve", litserve=False)
            lit = self.report["sections"].get("litserve", {}).get("best")
            if lit and lit.get("best_images_per_s"):
                rate = 0.7 * lit["best_images_per_s"]
                result["at_litserve_70"] = self._load(server.url, server.process.pid, "serve-at-litserve-70",
                                                      rate=rate, litserve=False)  # fmt: skip
        finally:
            server.stop(30)
        pipeline = self.report["sections"].get("bench", {}).get("pipeline_images_per_s")
        if pipeline:
            result["to_pipeline_cpu_decode"] = result["best_images_per_s"] / pipeline
        return {"config": self.serve_config(), "flags": self.serve_flags(), **result}

    def detector(self) -> dict[str, Any]:
        repo = self.out / "detector-repo"
        shutil.rmtree(repo, ignore_errors=True)
        shutil.copytree(DETECTOR, repo / DETECTOR.name)
        config = repo / DETECTOR.name / "config.toml"
        config.write_text(config.read_text().replace('device = "auto"', f'device = "{self.device}"', 1))
        with self._start_server(repo, "detector-server", min(60.0, self.step_left_s() - 5)) as server:
            # Where it is served: its artifact is ONNX, and onnxruntime without its CUDA provider falls back to the
            # CPU (config fallback = "cpu"), which the model's metadata says.
            metadata = server.client().get(f"/v2/models/{DETECTOR.name}").json()
            proc = self.cli(self.detector_args(server.url), timeout_s=120, log="detector-loadtest",
                            cpus=self.client_cpus)  # fmt: skip
            out = self.json_line(proc)
        served = {k: v for k, v in metadata.items() if k in ("platform", "parameters", "device", "devices")}
        return {"model": DETECTOR.name, "device_asked": self.device, "served": served,
                "steps": [step_summary(s) for s in out["steps"]]}  # fmt: skip

    def detector_refused(self) -> str | None:
        """Why ``visionserve loadtest`` cannot drive the detector's route here (None: it can)."""
        import io

        from service.cli import build_parser

        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                build_parser(only="loadtest").parse_args(self.detector_args("http://127.0.0.1:1"))
        except SystemExit:
            return (f"visionserve loadtest cannot post to /v1/models/{DETECTOR.name}/detect here "
                    f"(`loadtest --task detect`: {said.getvalue().strip().splitlines()[-1:]})")  # fmt: skip
        return None

    # ---- a sweep: closed loop to saturation, then open loop at 70% of the best ------------------------------
    def _sweep(self, url: str, pid: int, log: str, *, litserve: bool) -> dict[str, Any]:
        concurrency = self.args.litserve_concurrency if litserve else self.args.concurrency
        closed = [self._load(url, pid, f"{log}-c{c}", concurrency=c, litserve=litserve) for c in concurrency]
        best = max(closed, key=lambda s: s["images_per_s"])
        if best["images_per_s"] <= 0:
            raise StepError(f"no answers at {url}: {best.get('errors')}")
        open_70 = self._load(url, pid, f"{log}-open70", rate=0.7 * best["images_per_s"], litserve=litserve)
        return {"closed": closed, "best_images_per_s": best["images_per_s"], "best_concurrency": best["concurrency"],
                "open_at_70": open_70}  # fmt: skip

    def _load(self, url: str, pid: int, log: str, *, concurrency: int = 0, rate: float = 0.0,
              litserve: bool) -> dict[str, Any]:  # fmt: skip
        """One load step (one command, so that the server's CPU is read around it alone)."""
        from loadtest.scrape import scrape

        before = None if litserve else scrape(url, self.model)
        cpu = runner.CpuClock(pid)
        if litserve:
            args = self.drive_args(url, concurrency=str(concurrency) if concurrency else "", rate=rate)
            proc = self.run(args, 120, log, cpus=self.client_cpus)
            if proc.returncode != 0:
                raise StepError(f"service.bench.drive exited {proc.returncode}: {proc.stderr.strip()[-600:]}")
        else:
            args = self.loadtest_args(url, self.model, concurrency=concurrency, rate=rate)
            proc = self.cli(args, timeout_s=120, log=log, cpus=self.client_cpus)
        out = self.json_line(proc)
        after = None if litserve else scrape(url, self.model)
        answers = out.get("sent", 0) if litserve else _images(after) - _images(before)
        step = out["steps"][0]
        split = step.get("server") or {}  # visionserve's own /metrics: where each request's time went
        stages = {k: split[k] for k in ("mean_batch_size", "mean_ms", "stages", "request_p99_ms") if k in split}
        return {**step_summary(step), **cpu.figures(int(answers)), **({"server": stages} if stages else {})}

    @contextlib.contextmanager
    def litserve_app(self, workers: int, ready_timeout_s: float) -> Iterator[tuple[str, int]]:
        """The LitServe app's URL and pid, on the servers' cores once ``GET /health`` answers 200 (every worker
        loaded) until the block ends; stopped as the launcher stops a process, its session's every worker signalled."""
        import httpx

        from service import launcher

        port = launcher.free_port()
        log, url = self.out / f"litserve-{workers}.log", f"http://127.0.0.1:{port}"
        with log.open("wb") as out:
            pinned = on_cpus(self.server_cpus, session=True)
            proc = subprocess.Popen(self.litserve_args(workers, port), cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, preexec_fn=pinned)  # fmt: skip

        def healthy() -> bool:
            try:
                return httpx.get(url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            launcher.wait_until(launcher.RunningServer(url, proc, log), healthy, ready_timeout_s, "ready (LitServe)")
            yield url, proc.pid
        finally:
            launcher.stop_process(proc, timeout_s=10.0, term_group=True)

    def why_not(self, name: str, allowance: float) -> str | None:
        refused = self.detector_refused() if name == "detector" and name not in self.skip else None
        return refused or super().why_not(name, allowance)

    def totals(self) -> dict[str, Any]:
        return {"verdicts": verdicts(self.report["sections"], self.args.slo_p99_ms)}

    def head(self) -> list[str]:
        return ["## targets", "", *[f"- {k}: {SAID[v]}" for k, v in self.report["verdicts"].items()], ""]

    def headline(self) -> list[str]:
        """The headline figures and the targets, a line each, for the end of the run."""
        sections, lines = self.report["sections"], []
        bench = sections.get("bench") or {}
        if bench.get("engine_images_per_s"):
            rates = ", ".join(f"{b}: {r:.0f}" for b, r in bench["engine_images_per_s"].items())
            lines.append(f"runtime alone, images/s by batch: {rates}")
        for key, label in (("pipeline_images_per_s", "CPU decoders"), ("pipeline_gpu_decode_images_per_s", "nvJPEG")):
            if key in bench:
                lines.append(f"pipeline from JPEG bytes with {label}: {bench[key]:.0f} images/s")
        lit = (sections.get("litserve") or {}).get("best")
        for name, body in (("LitServe", lit), ("served", sections.get("serve"))):
            if body and body.get("open_at_70"):
                workers, p99 = f" ({body['workers']} workers)" if "workers" in body else "", _p99(body["open_at_70"])
                lines.append(f"{name}{workers}: best {body['best_images_per_s']:.0f} images/s at "
                             f"c={body['best_concurrency']}, p99 {p99:.1f} ms at 70% of it")  # fmt: skip
        return lines + [f"target {k}: {SAID[v]}" for k, v in (self.report.get("verdicts") or {}).items()]

    def draw(self, name: str, body: dict[str, Any]) -> list[str]:
        lines: list[str] = []
        if name == "serve":
            lines += _sweep(body)
        elif name == "litserve":
            for run in body.get("runs", []):
                lines += [f"{run['workers']} workers: {run.get('error') or run.get('skipped') or ''}", ""]
                lines += _sweep(run) if "closed" in run else []
        return lines + super().draw(name, body)


def _images(sample: dict[str, float] | None) -> float:
    return (sample or {}).get("visionserve_images_total", 0.0)


def _p99(step: dict[str, Any] | None) -> Any:
    return (step or {}).get("latency_ms", {}).get("p99")


def verdicts(sections: dict[str, Any], slo_p99_ms: float) -> dict[str, Any]:
    """Each target against what was measured (None where its figures are missing)."""
    serve, lit = sections.get("serve") or {}, (sections.get("litserve") or {}).get("best") or {}
    best, ratio = serve.get("best_images_per_s"), serve.get("to_pipeline_cpu_decode")
    p99 = _p99(serve.get("open_at_70"))
    out: dict[str, Any] = {
        "served_images_per_s >= 5000": None if best is None else best >= 5000,
        "served / pipeline (CPU decode) >= 0.9": None if ratio is None else ratio >= 0.9,
        f"p99 at 70% <= {slo_p99_ms:g} ms": None if p99 is None else p99 <= slo_p99_ms,
    }
    if best is not None and lit.get("best_images_per_s"):
        out["served >= 3x LitServe's best"] = best >= 3 * lit["best_images_per_s"]
        ours, theirs = _p99(serve.get("at_litserve_70")), _p99(lit.get("open_at_70"))
        out["p99 below LitServe's at its 70% load"] = None if ours is None or theirs is None else ours < theirs
    return out


def _row(label: str, step: dict[str, Any]) -> str:
    lat = step.get("latency_ms") or {}
    batch = (step.get("server") or {}).get("mean_batch_size")
    cells = [label, f"{step.get('images_per_s', 0):.1f}", f"{lat.get('p50', float('nan')):.2f}",
             f"{lat.get('p99', float('nan')):.2f}", str(step.get("server_cores_busy", "-")),
             str(step.get("server_cpu_ms_per_image", "-")), "-" if batch is None else f"{batch:.2f}",
             str(sum((step.get("errors") or {}).values()))]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


HEAD = ["| load | images/s | p50 ms | p99 ms | server cores busy | server CPU ms/image | mean batch | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip


def _sweep(body: dict[str, Any]) -> list[str]:
    lines = list(HEAD)
    lines += [_row(f"c={s.get('concurrency')}", s) for s in body.get("closed", [])]
    for key, label in (("open_at_70", "open, 70% of best"), ("at_litserve_70", "open, LitServe's 70%")):
        if body.get(key):
            lines.append(_row(f"{label} ({body[key].get('rate', 0):.0f}/s)", body[key]))
    return [*lines, ""]


def build_parser() -> argparse.ArgumentParser:
    return parser("gpu_speed", __doc__, FLAGS)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(args: argparse.Namespace) -> int:
    return Speed(args).main()


if __name__ == "__main__":
    sys.exit(main(parse_args(sys.argv[1:])))
