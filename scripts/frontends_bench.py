"""Served throughput, batching and server CPU time per request: the process split against the single-process
server it replaced, and against the engine's in-process limit, in one run on one machine.

    .venv/bin/python scripts/frontends_bench.py --repository /tmp/bench-repo --baseline-ref e9101b5

Steps (each: start a server, warm up, one closed-loop step of the load tester, read the server's CPU time from
/proc for its whole process tree before and after, stop it):
- noop: ``backend = "noop"``, a 125-byte PNG, c=16: the single-process server (``--baseline-ref``, run from a
  git worktree) against the split at ``--workers 1`` and ``2``: req/s, server CPU ms per request, mean batch size.
- resnet18 (onnxruntime), JPEGs at 500x375, c=8 and c=1 against ``visionserve bench``'s pipeline figure (decode +
  run, in-process) and, at c=1, the in-process decode + batch-1 run + 3 ms bound on CPU per request.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and all its descendants, in seconds (live processes only)."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICK
    family = {pid}
    grew = True
    while grew:
        grew = False
        for child, parent in parents.items():
            if parent in family and child not in family:
                family.add(child)
                grew = True
    return sum(times.get(p, 0.0) for p in family)


class Server:
    def __init__(self, cwd: Path, repository: Path, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [PYTHON, "-m", "service.cli", "serve", "--repository", str(repository), "--port", str(self.port), *args]
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError("server not ready in 180 s")

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def load(server: Server, model: str, concurrency: int, args: argparse.Namespace, images: Path | None) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp(prefix="vs-step-"))
    cmd = [PYTHON, "-m", "service.cli", "loadtest", "--url", server.url, "--model", model, "--concurrency",
           str(concurrency), "--duration", str(args.duration), "--warmup", str(args.warmup), "--out", str(out),
           "--no-progress"]  # fmt: skip
    if images is not None:
        cmd += ["--images", str(images)]
    before = tree_cpu_s(server.process.pid)
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    after = tree_cpu_s(server.process.pid)
    step = json.loads((out / "results.json").read_text())["steps"][0]
    # The CPU read spans warm-up + measured window + drain; the server's own count of requests covers the same.
    served = sum(step["server"]["requests"].values()) if step.get("server") else step["requests"]
    return {
        "requests_per_s": step["requests_per_s"],
        "images_per_s": step["images_per_s"],
        "p50_ms": step["latency_ms"]["p50"],
        "p99_ms": step["latency_ms"]["p99"],
        "errors": sum(step["errors"].values()),
        "mean_batch_size": (step.get("server") or {}).get("mean_batch_size"),
        "server_cpu_ms_per_request": 1000 * (after - before) / max(1, served + _warmup_requests(step, args)),
    }


def _warmup_requests(step: dict[str, Any], args: argparse.Namespace) -> int:
    """Requests of the warm-up (served, so in the CPU read, but not in the step's count): estimated at the
    measured rate."""
    return int(step["requests_per_s"] * args.warmup)


def bench_pipeline(repository: Path, model: str, seconds: float) -> dict[str, Any]:
    cmd = [PYTHON, "-m", "service.cli", "bench", "--model", model, "--repository", str(repository), "--json",
           "--batch-sizes", "1,8", "--seconds", str(seconds), "--no-progress"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", required=True, help="holds noop/ (backend noop) and resnet18/ (onnx)")
    p.add_argument("--baseline-ref", default=None, help="git ref of the single-process server (default: none)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per step (default: 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds per step (default: 2)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the noop comparison (default: 1)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: noop, resnet18 (default: none)")
    p.add_argument("--out", default=None, help="write every figure as JSON here (default: print only)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    repository = Path(args.repository).resolve()
    skip = set(filter(None, args.skip.split(",")))
    logs = Path(tempfile.mkdtemp(prefix="vs-bench-logs-"))
    results: dict[str, Any] = {"machine": f"{os.cpu_count()} cores", "date": time.strftime("%Y-%m-%d")}
    png = Path(tempfile.mkdtemp(prefix="vs-png-"))
    (png / "digit-3.png").write_bytes((ROOT / "examples" / "digit-3.png").read_bytes())
    if "noop" not in skip:
        configs: list[tuple[str, Path, list[str]]] = []
        if args.baseline_ref:
            tree = Path(tempfile.mkdtemp(prefix="vs-baseline-")) / "tree"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.baseline_ref], cwd=ROOT,
                           check=True, capture_output=True)  # fmt: skip
            configs.append(("single process", tree, []))
        configs += [("workers 1", ROOT, ["--workers", "1", "--grpc-port", "0"]),
                    ("workers 2", ROOT, ["--workers", "2", "--grpc-port", "0"])]  # fmt: skip
        rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in configs}
        for round_ in range(args.rounds):
            order = configs if round_ % 2 == 0 else list(reversed(configs))
            for name, cwd, extra in order:
                server = Server(cwd, repository, extra, logs / f"{name}-{round_}.log")
                try:
                    rows[name].append(load(server, "noop", 16, args, png))
                finally:
                    server.stop()
                row = rows[name][-1]
                print(f"noop c=16 {name:>15}: {row['requests_per_s']:8.1f} req/s, "
                      f"{row['server_cpu_ms_per_request']:.3f} CPU ms/request, mean batch {row['mean_batch_size']}, "
                      f"p99 {row['p99_ms']:.1f} ms, errors {row['errors']}", flush=True)  # fmt: skip
        results["noop"] = rows
        if args.baseline_ref:
            base = rows["single process"]
            for name in ("workers 1", "workers 2"):
                rps = sum(r["requests_per_s"] for r in rows[name]) / sum(r["requests_per_s"] for r in base)
                cpu = sum(r["server_cpu_ms_per_request"] for r in rows[name]) / sum(
                    r["server_cpu_ms_per_request"] for r in base
                )
                print(f"  {name} / single process: req/s x{rps:.3f}, CPU per request x{cpu:.3f}")
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    if "resnet18" not in skip:
        limit = bench_pipeline(repository, "resnet18", max(3.0, args.duration / 2))
        pipeline = limit["pipeline_images_per_s"]
        print(f"resnet18 in-process: pipeline {pipeline:.1f} images/s; engine batch 1 "
              f"{limit['engine_images_per_s']['1']:.1f} images/s", flush=True)  # fmt: skip
        served = {}
        for concurrency in (8, 1):
            server = Server(ROOT, repository, ["--grpc-port", "0"], logs / f"resnet18-c{concurrency}.log")
            try:
                served[concurrency] = row = load(server, "resnet18", concurrency, args, None)
            finally:
                server.stop()
            ratio = row["images_per_s"] / pipeline
            print(f"resnet18 c={concurrency}: {row['images_per_s']:.1f} images/s = {ratio:.3f} of the pipeline; "
                  f"{row['server_cpu_ms_per_request']:.2f} CPU ms/request, p99 {row['p99_ms']:.1f} ms",
                  flush=True)  # fmt: skip
        results["resnet18"] = {"in_process": limit, "served": served}
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
