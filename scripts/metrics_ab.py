"""Metrics on versus off, measured as the server process's CPU time per request (user + system, from /proc),
which a noisy shared machine disturbs far less than throughput. Two servers on the same repository, one with
``--no-metrics``; the same fixed number of closed-loop requests to each, alternating, several rounds.

    .venv/bin/python scripts/metrics_ab.py --repository /tmp/srepo --model noop --requests 3000 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from loadtest.closed import closed_loop, read_images


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(repository: str, port: int, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "service.cli", "serve", "--repository", repository, "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("server did not start")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repository", required=True)
    p.add_argument("--model", default="noop")
    p.add_argument("--images", default="examples")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=16)
    args = p.parse_args()
    images = read_images(args.images)
    servers = {"on": start(args.repository, 8411), "off": start(args.repository, 8412, "--no-metrics")}
    ports = {"on": 8411, "off": 8412}
    cpu: dict[str, list[float]] = {"on": [], "off": []}
    rate: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for _ in range(args.rounds):
            for name in ("on", "off"):
                pid = servers[name].pid
                before = cpu_seconds(pid)
                step = asyncio.run(closed_loop(f"http://127.0.0.1:{ports[name]}", args.model, images,
                                               concurrency=args.concurrency, duration_s=600, warmup_s=0,
                                               max_requests=args.requests))  # fmt: skip
                used = cpu_seconds(pid) - before
                cpu[name].append(used / max(step.requests, 1) * 1000)
                rate[name].append(step.requests_per_s)
                print(f"metrics {name:>3}: {step.requests} requests, server CPU {cpu[name][-1]:.3f} ms/request, "
                      f"{step.requests_per_s:.1f} req/s, errors {step.errors or 0}", flush=True)  # fmt: skip
    finally:
        for proc in servers.values():
            proc.terminate()
            proc.wait(30)
    on, off = statistics.median(cpu["on"]), statistics.median(cpu["off"])
    print(f"median server CPU per request: on {on:.3f} ms, off {off:.3f} ms, on/off {on / off:.4f}")
    print(f"median req/s: on {statistics.median(rate['on']):.1f}, off {statistics.median(rate['off']):.1f}")


if __name__ == "__main__":
    main()
