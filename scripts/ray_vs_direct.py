"""Throughput of one visionserve server behind Ray Serve's HTTP proxy against the same server spoken to directly,
in one run on one machine: the same repository, the same load tester (closed loop) with the same settings.

    .venv/bin/python scripts/ray_vs_direct.py --repository model_repository --model digits

The direct server is started exactly as a Ray replica starts its own (deploy/ray/child.py: ``--workers 1`` on a
free 127.0.0.1 port); then a one-node Ray instance serves the deployment (deploy/ray/app.py) with one replica, and
the load tester runs against Ray's proxy. Prints both figures and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a file: deploy/ comes from this checkout

from deploy.ray.child import ReplicaOptions, ServerProcess, free_port  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", default="model_repository", help="model repository (default: model_repository)")
    p.add_argument("--model", default="digits", help="model to load (default: digits)")
    p.add_argument("--concurrency", default="16", help="load-test clients, comma-separated steps (default: 16)")
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per step (default: 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds before each step (default: 2)")
    p.add_argument("--image-size", default="500x375", help="generated JPEG size, WxH (default: 500x375)")
    p.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1, help="CPUs Ray may use (default: all)")
    p.add_argument(
        "--server-args", default="--grpc-port 0", help="more `visionserve serve` flags (default: '--grpc-port 0')"
    )
    p.add_argument("--out", default=None, help="folder for both runs' results.json (default: a temporary folder)")
    return p


def loadtest(url: str, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Run the load tester as a user would, against ``url``; its steps from results.json."""
    cmd = [sys.executable, "-m", "service.cli", "loadtest", "--url", url, "--model", args.model,
           "--concurrency", args.concurrency, "--duration", str(args.duration), "--warmup", str(args.warmup),
           "--image-size", args.image_size, "--out", str(out), "--no-progress"]  # fmt: skip
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    steps: list[dict[str, Any]] = json.loads((out / "results.json").read_text())["steps"]
    return steps


def direct(args: argparse.Namespace, options: ReplicaOptions, out: Path) -> list[dict[str, Any]]:
    server = ServerProcess(options)
    server.start()
    try:
        asyncio.run(_ready(server))
        return loadtest(server.url, args, out)
    finally:
        server.stop()


async def _ready(server: ServerProcess) -> None:
    async with httpx.AsyncClient() as client:
        await server.wait_ready(client)


def through_ray(args: argparse.Namespace, options: ReplicaOptions, out: Path) -> list[dict[str, Any]]:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep Ray on 127.0.0.1 (docs/deploy.md)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)
    import msgspec
    import ray
    from ray import serve

    from deploy.ray.app import VisionServe

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        # One replica, no autoscaling: the figure is one server's, with Ray's proxy and router in front.
        app = VisionServe.options(num_replicas=1, autoscaling_config=None, ray_actor_options={"num_cpus": 0})
        serve.run(app.bind(msgspec.to_builtins(options)), name="visionserve", route_prefix="/")
        return loadtest(f"http://127.0.0.1:{port}", args, out)
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = ReplicaOptions(
        repository=str(Path(args.repository).resolve()), server_args=tuple(args.server_args.split())
    )
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="ray_vs_direct-"))
    plain = direct(args, options, out / "direct")
    via_ray = through_ray(args, options, out / "ray")
    print(f"{'clients':>8} {'direct req/s':>13} {'Ray req/s':>10} {'ratio':>6} {'direct p50/p99 ms':>18} "
          f"{'Ray p50/p99 ms':>15} errors (direct, Ray)")  # fmt: skip
    for d, r in zip(plain, via_ray, strict=True):
        ratio = r["requests_per_s"] / d["requests_per_s"] if d["requests_per_s"] else float("nan")
        dl, rl = d["latency_ms"], r["latency_ms"]
        print(f"{d['concurrency']:>8} {d['requests_per_s']:>13.1f} {r['requests_per_s']:>10.1f} {ratio:>6.2f} "
              f"{dl['p50']:>8.1f}/{dl['p99']:<9.1f} {rl['p50']:>7.1f}/{rl['p99']:<7.1f} "
              f"{sum(d['errors'].values())}, {sum(r['errors'].values())}")  # fmt: skip
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
