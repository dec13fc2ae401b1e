"""Metrics on versus off, served: two servers on the same repository, one with ``--no-metrics``, each loaded by
the same closed-loop step, round after round. Each round gives one on/off throughput ratio, and the median ratio
comes with a bootstrap 95% interval, which says whether the runs can tell a 2% difference apart at all.

On a shared 2-core VM, runs one after the other differ by 10-20% from round to round, far more than 2%. With
``--pin --together`` both servers share one core and are loaded at the same moment, so the machine's weather
falls on both alike and the ratio is that of their cost per request; ``--restart-every 1`` starts a fresh pair
each round (the first process started alternates), because one pair of processes can sit a few percent apart for
its whole life; ``--control`` runs the same with metrics on in both, to show the set-up's own bias.

    .venv/bin/python scripts/metrics_ab.py --repository model_repository --model digits --rounds 24 \
        --concurrency 8 --duration 4 --pin --together --restart-every 1
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from loadtest.inputs import payloads
from loadtest.pool import WorkerPool
from loadtest.step import StepBounds, StepSpec, run_step
from service.core.arguments import size_pair
from service.core.samples import photo_like_jpegs


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(repository: str, port: int, *extra: str, pin: list[str]) -> subprocess.Popen[bytes]:
    cmd = [*pin, sys.executable, "-m", "service.cli", "serve", "--repository", repository, "--host", "127.0.0.1",
           "--port", str(port), *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError("server did not start")


def bootstrap_median(values: list[float], rounds: int = 10_000, seed: int = 0) -> tuple[float, float]:
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repository", required=True, help="model repository both servers load")
    p.add_argument("--model", default="digits", help="model to load (default digits)")
    p.add_argument("--concurrency", type=int, default=8, help="closed-loop clients (default 8)")
    p.add_argument("--duration", type=float, default=6.0, help="measured seconds per run (default 6)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds before measuring (default 1)")
    p.add_argument("--rounds", type=int, default=12, help="on/off pairs (default 12)")
    p.add_argument("--ports", default="8411,8412", help="ports of the on and off servers (default 8411,8412)")
    p.add_argument(
        "--pin", action="store_true", help="servers on the last CPU, the load generator on the others (default off)"
    )
    p.add_argument(
        "--control", action="store_true",
        help="A/A control: both servers with metrics on, to see the set-up's own bias (default off)",
    )  # fmt: skip
    p.add_argument("--protocol", choices=("image", "v2"), default="image", help="API to load (default image)")
    p.add_argument(
        "--image-size", type=size_pair, default=(500, 375), metavar="WxH",
        help="generated JPEGs' size; small ones make each request cheap and the metrics' share the largest "
        "(default 500x375)",
    )  # fmt: skip
    p.add_argument(
        "--together", action="store_true",
        help="load both servers at once (with --pin they share one core: a paired comparison of cost per request)",
    )  # fmt: skip
    p.add_argument(
        "--restart-every", type=int, default=0, metavar="K",
        help="start both servers afresh every K rounds, so that one process's luck does not decide (default never)",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    port_on, port_off = (int(x) for x in args.ports.split(","))
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", str(cpus[-1])] if args.pin else []  # every server thread inherits it
    off_flags = [] if args.control else ["--no-metrics"]
    ports = {"on": port_on, "off": port_off}

    def start_pair(block: int) -> dict[str, subprocess.Popen[bytes]]:
        # Which server starts first alternates, so that neither process always gets the same place in memory.
        flags = {"on": [], "off": off_flags}
        return {name: start(args.repository, ports[name], *flags[name], pin=pin) for name in in_turn(block)}

    def stop_pair(pair: dict[str, subprocess.Popen[bytes]]) -> None:
        for proc in pair.values():
            proc.terminate()
        for proc in pair.values():
            proc.wait(30)

    if args.pin:  # the client and the servers stop taking turns on the same core
        os.sched_setaffinity(0, set(cpus[:-1]) or {cpus[-1]})
    bodies = payloads(args.model, photo_like_jpegs(32, size=args.image_size), protocol=args.protocol)
    rate: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, list[float]] = {"on": [], "off": []}

    def bounds(name: str) -> StepBounds:
        return StepBounds(
            url=f"http://127.0.0.1:{ports[name]}",
            warmup_s=args.warmup,
            duration_s=args.duration,
            drain_s=10,
            timeout_s=30,
            max_requests=10**7,
            scrape=False,  # the comparison's own reads of /metrics would land on one side only
        )

    def measure(name: str, pool: WorkerPool) -> None:
        before, answered = cpu_seconds(servers[name].pid), pool.completed()
        step = run_step(pool, StepSpec("closed", concurrency=args.concurrency), bounds(name), args.model)
        used = cpu_seconds(servers[name].pid) - before
        if step.error_count:
            raise RuntimeError(f"errors ({name}): {step.errors}")
        rate[name].append(step.requests_per_s)
        cpu[name].append(1000 * used / max(1, pool.completed() - answered))

    servers = start_pair(0)
    try:
        with WorkerPool(1, bodies) as pool_on, WorkerPool(1, bodies) as pool_off:
            pools = {"on": pool_on, "off": pool_off}
            for k in range(args.rounds):
                if args.restart_every and k and k % args.restart_every == 0:
                    stop_pair(servers)
                    servers = start_pair(k // args.restart_every)
                if args.together:  # both loaded at once: they split one core, and its weather, between them
                    threads = [threading.Thread(target=measure, args=(name, pools[name])) for name in in_turn(k)]
                    for thread in threads:
                        thread.start()
                    for thread in threads:
                        thread.join()
                    if len(rate["on"]) != k + 1 or len(rate["off"]) != k + 1:
                        raise RuntimeError(f"round {k + 1} failed")
                else:
                    for name in in_turn(k):
                        measure(name, pools[name])
                print(f"round {k + 1:>2}: on {rate['on'][-1]:7.1f} req/s, off {rate['off'][-1]:7.1f} req/s, "
                      f"on/off {rate['on'][-1] / rate['off'][-1]:.4f}", flush=True)  # fmt: skip
        scrape_ms = scrape_cost(port_on)
    finally:
        stop_pair(servers)
    ratios = [a / b for a, b in zip(rate["on"], rate["off"], strict=True)]
    low, high = bootstrap_median(ratios)
    print(f"median req/s: on {statistics.median(rate['on']):.1f}, off {statistics.median(rate['off']):.1f}")
    print(f"median on/off throughput ratio over {len(ratios)} paired rounds: {statistics.median(ratios):.4f} "
          f"(bootstrap 95% interval {low:.4f} .. {high:.4f})")  # fmt: skip
    cpu_ratios = [a / b for a, b in zip(cpu["on"], cpu["off"], strict=True)]
    low, high = bootstrap_median(cpu_ratios)
    print(f"server CPU ms/request (warm-up included): on {statistics.median(cpu['on']):.3f}, "
          f"off {statistics.median(cpu['off']):.3f}; median on/off {statistics.median(cpu_ratios):.4f} "
          f"(bootstrap 95% interval {low:.4f} .. {high:.4f})")  # fmt: skip
    print(f"one scrape of /metrics (idle server, median of 50): {scrape_ms:.2f} ms; every 15 s that is "
          f"{100 * scrape_ms / 15_000:.3f}% of one core")  # fmt: skip


def in_turn(k: int) -> tuple[str, str]:
    """Which server goes (or starts) first in round or block ``k``: they alternate, so neither always does."""
    return ("on", "off") if k % 2 == 0 else ("off", "on")


def scrape_cost(port: int, times: int = 50) -> float:
    """Wall milliseconds per GET /metrics on an idle server (what a Prometheus scrape costs it, at most)."""
    spent = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
        for _ in range(times):
            started = time.perf_counter()
            client.get("/metrics").raise_for_status()
            spent.append(1000 * (time.perf_counter() - started))
    return statistics.median(spent)


if __name__ == "__main__":
    main()
