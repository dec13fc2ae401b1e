"""A/B: two server configurations under the same load, in alternating rounds; per-round figures, medians, ratios.

Each side is a ``visionserve serve`` started here on a free port (service/launcher.py), with its own repository,
serve flags and protocol, or a server already running at a URL (``--a-url``/``--b-url``: Ray Serve's proxy, another
machine). Both get the same closed-loop step of the load tester (loadtest/: ``--concurrency`` clients, ``--warmup-s``
not counted, then ``--duration-s`` measured), round after round, the order alternating (A B, B A, ...) so that a
steady drift of the machine's speed falls on both alike. Printed per round and as medians: requests/s, images/s,
p50 and p99 latency, errors and, for a server started here, its process tree's CPU time per answered request (the
warm-up's included). The B/A ratios are medians of the per-round ratios, with a bootstrap 95% interval that says
whether the rounds can tell the two apart at all.

Rounds run one after the other on a shared machine differ by 10-20%. ``--pin --together`` puts both servers on the
last core and loads them at the same moment from the others, so the machine's weather falls on both alike and the
throughput ratio is that of their costs per request; ``--restart-every 1`` starts a fresh pair every round (which
one starts first alternates), since one pair of processes can sit a few percent apart for its whole life
(docs/performance.md, "The cost of metrics")::

    # metrics on against off; leave --b-flags out for the A/A control
    visionserve bench ab --model digits --b-flags=--no-metrics --rounds 24 --concurrency 8 \\
        --duration-s 4 --warmup-s 1 --pin --together --restart-every 1
    # HTTP binary v2 against gRPC, otherwise the same server
    visionserve bench ab --model resnet18 --a-protocol v2 --b-protocol grpc --rounds 3 --duration-s 10
    # a server started as a Ray replica starts its own, against the Ray Serve proxy in front of one
    visionserve bench ab --a-flags="--workers 1" --b-url http://127.0.0.1:8000

A flag value that begins with "--" needs "=" (``--b-flags=--no-metrics``). Exit code 0; 1 when a side answered a
request with an error (its figures are then suspect); 2 on a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.inputs import PROTOCOLS, payloads
from loadtest.pool import WorkerPool
from loadtest.scrape import batch_stats
from loadtest.step import StepBounds, StepSpec, run_step
from service import launcher
from service.bench.kit import COUNT, POSITIVE, CpuClock, Flag, bounds, step_figures, write_json
from service.bench.runner import on_cpus
from service.core.arguments import size_pair
from service.core.samples import image_files, photo_like_jpegs

FIGURES = ("requests_per_s", "images_per_s", "p50_ms", "p99_ms", "server_cpu_ms_per_request")
RATIOS = {
    "requests_per_s": "throughput (requests/s)",
    "p50_ms": "p50 latency",
    "p99_ms": "p99 latency",
    "server_cpu_ms_per_request": "server CPU per request",
}


SIDE_FLAGS: list[Flag] = [
    ("flags", "", "more `visionserve serve` flags, one string (default: none)"),
    ("repository", None, "its own repository (default: --repository)"),
    ("protocol", None, "its own API (default: --protocol)", PROTOCOLS),
    ("url", None, "a running server to load instead of starting one; image or v2 protocol only (default: none)"),
    ("python", None, "the interpreter that runs its server, e.g. another virtual environment's (default: this one's)"),
]
FLAGS: list[Flag] = [
    ("--repository", "model_repository", "both sides' repository"),
    ("--model", "digits", "model to load"),
    ("--protocol", "image", "both sides' API", PROTOCOLS),
    *(
        (f"--{side}-{name}", default, f"side {side.upper()}: {text}", *kind)
        for side in "ab"
        for name, default, text, *kind in SIDE_FLAGS
    ),
    ("--concurrency", 8, "closed-loop clients per side", COUNT),
    ("--duration-s", 5.0, "measured seconds per step", POSITIVE),
    ("--warmup-s", 1.0, "seconds per step before measuring"),
    ("--rounds", 6, "steps per side, alternating", COUNT),
    ("--images", None, "folder of images to send (default: generated JPEGs)"),
    ("--image-size", (500, 375), "generated JPEGs' size", size_pair),
    ("--images-per-request", 1, "images in each request", COUNT),
    ("--processes", 1, "load processes per side", COUNT),
    ("--together", False, "load both sides at the same moment (off: in turn)"),
    ("--pin", False, "started servers on the last CPU, the load on the others"),
    ("--restart-every", 0, "start both servers afresh every K rounds (0: never)"),
    ("--json", None, "write every figure to this file (default: none)"),
]


@dataclass
class Side:
    name: str  # "A" or "B"
    repository: str
    flags: list[str]
    protocol: str
    url: str | None  # a running server's; None: started here
    python: str | None = None  # the interpreter that runs its server (another virtual environment's); None: this one
    server: launcher.RunningServer | None = None
    steps: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> str:
        where = self.url or f"{self.repository}, flags: {' '.join(self.flags) or 'none'}"
        if self.python:
            where += f", python {self.python}"
        return f"{where}; {self.protocol} protocol"

    def bounds(self, args: argparse.Namespace) -> StepBounds:
        url = self.server.url if self.server else str(self.url)
        grpc = self.server.grpc_target if self.server and self.protocol == "grpc" else ""
        # No reads of /metrics: with metrics off on one side they would cost the other side only.
        return bounds(url, args.warmup_s, args.duration_s, grpc_target=grpc, scrape=False)


def measure(pool: WorkerPool, spec: StepSpec, bounds: StepBounds, model: str, pid: int | None) -> dict[str, Any]:
    """One step of the load tester, with the CPU time the server's process tree (``pid``'s, when known) spent per
    request answered while it ran, and the mean size of the batches it formed, both over the whole step (warm-up
    and drain included: a short step's measured window can hold no batch, nor a scrape landing late in it)."""
    cpu = CpuClock(pid)
    answered = pool.completed()
    batches = batch_stats(bounds.url, model) if bounds.scrape else None
    step = run_step(pool, spec, bounds, model)
    answered = pool.completed() - answered
    return step_figures(step) | {
        "server_cpu_ms_per_request": 1000 * cpu.spent_s() / max(1, answered) if pid else None,
        "mean_batch_size": None if batches is None else mean_batch_size(batches, batch_stats(bounds.url, model)),
    }


def mean_batch_size(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Images per batch between two reads of the server's batch statistics (:func:`loadtest.scrape.batch_stats`);
    None when no batch ran between them."""
    counts = {int(k.split("|")[1]): after[k] - before.get(k, 0.0) for k in after if k.startswith("batch_count|")}
    batches = sum(counts.values())
    return sum(size * n for size, n in counts.items()) / batches if batches > 0 else None


def start(sides: Sequence[Side], block: int, logs: Path, cpus: set[int] | None) -> None:
    """Start the sides that need a server (the first alternates by ``block``) and wait until both are ready."""
    order = list(sides) if block % 2 == 0 else list(sides)[::-1]
    try:
        for side in order:
            if side.url is None:
                side.server = launcher.launch(
                    side.repository,
                    *side.flags,
                    log=logs / f"{side.name}-{block}.log",
                    grpc_port=0 if side.protocol == "grpc" else None,
                    python=side.python,
                    preexec_fn=on_cpus(cpus, session=True),
                )
                side.server.own_group = True  # a session of its own (on_cpus): stop() may stop the whole group
        for side in order:
            if side.server is not None:
                launcher.wait_ready(side.server)
    except BaseException:
        stop(sides)
        raise


def stop(sides: Sequence[Side]) -> None:
    launcher.stop_all([s.server for s in sides if s.server is not None])


def ratio_of(a: Any, b: Any) -> float | None:
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)) or a <= 0:
        return None
    return float(b / a)


def bootstrap_median(values: list[float], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """A 95% interval of the median of ``values``, by resampling them with replacement."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples)]


def summarise(sides: Sequence[Side]) -> dict[str, Any]:
    a, b = sides
    medians: dict[str, dict[str, Any]] = {}
    for side in sides:
        finite = {key: [s[key] for s in side.steps if s[key] is not None and math.isfinite(s[key])] for key in FIGURES}
        medians[side.name] = {key: statistics.median(v) if v else None for key, v in finite.items()}
        medians[side.name]["errors"] = sum(sum(s["errors"].values()) for s in side.steps)
    ratios: dict[str, Any] = {}
    for key in RATIOS:
        per_round = [r for x, y in zip(a.steps, b.steps, strict=True) if (r := ratio_of(x[key], y[key])) is not None]
        if per_round:
            low, high = bootstrap_median(per_round)
            ratios[key] = {"median": statistics.median(per_round), "interval_95": [low, high], "per_round": per_round}
    return {"medians": medians, "ratios_b_over_a": ratios}


def _cells(step: dict[str, Any]) -> str:
    cpu = step["server_cpu_ms_per_request"]
    errors = sum(step["errors"].values())
    return (
        f"{step['requests_per_s']:8.1f} req/s, p50 {step['p50_ms']:7.2f} ms, p99 {step['p99_ms']:7.2f} ms"
        + (f", {cpu:.3f} CPU ms/req" if cpu is not None else "")
        + (f", {errors} errors" if errors else "")
        + (" (client-limited)" if step.get("client_limited") else "")
    )


def report(sides: Sequence[Side], summary: dict[str, Any]) -> None:
    print(f"\nmedians over {len(sides[0].steps)} round(s):")
    for side in sides:
        m = summary["medians"][side.name]
        figures = ", ".join(f"{key} {m[key]:.3f}" for key in FIGURES if m[key] is not None)
        print(f"  {side.name} ({side.describe()}): {figures}, errors {m['errors']}")
    print("B/A, the median of the per-round ratios [bootstrap 95% interval]:")
    for key, title in RATIOS.items():
        if key in summary["ratios_b_over_a"]:
            r = summary["ratios_b_over_a"][key]
            print(f"  {title:<24} {r['median']:.4f} [{r['interval_95'][0]:.4f} .. {r['interval_95'][1]:.4f}]")


def parse_sides(args: argparse.Namespace) -> list[Side]:
    sides = []
    for side in "ab":
        own = {name: getattr(args, f"{side}_{name}") for name, *_ in SIDE_FLAGS}
        protocol, url = own["protocol"] or args.protocol, own["url"]
        if url is not None and protocol == "grpc":
            raise ValueError(f"--{side}-url takes the image or v2 protocol: gRPC is for servers started here")
        flags, url = shlex.split(own["flags"]), url.rstrip("/") if url else None
        sides.append(Side(side.upper(), own["repository"] or args.repository, flags, protocol, url, own["python"]))
    return sides


def main(args: argparse.Namespace) -> int:
    try:
        sides = parse_sides(args)
        images = image_files(args.images) if args.images else photo_like_jpegs(32, args.image_size)
    except (OSError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    cpus = sorted(os.sched_getaffinity(0))
    server_cpus = {cpus[-1]} if args.pin else None
    if args.pin:  # the load and the servers stop taking turns on the same core
        os.sched_setaffinity(0, set(cpus[:-1]) or {cpus[-1]})
    logs = Path(tempfile.mkdtemp(prefix="vs-ab-"))
    spec = StepSpec("closed", concurrency=args.concurrency)
    with contextlib.ExitStack() as stack:
        start(sides, 0, logs, server_cpus)
        stack.callback(stop, sides)
        pools = {}
        for side in sides:
            bodies = payloads(args.model, images, protocol=side.protocol, per_request=args.images_per_request)
            pools[side.name] = stack.enter_context(WorkerPool(args.processes, bodies))
            command = shlex.join(side.server.command) if side.server else "(running)"
            print(f"{side.name}: {side.describe()}\n   {command}")
        print(f"server logs: {logs}")

        def one(side: Side) -> dict[str, Any]:
            pid = side.server.process.pid if side.server else None
            return measure(pools[side.name], spec, side.bounds(args), args.model, pid)

        for k in range(args.rounds):
            if args.restart_every and k and k % args.restart_every == 0:
                stop(sides)
                start(sides, k // args.restart_every, logs, server_cpus)
            order = sides if k % 2 == 0 else sides[::-1]
            if args.together:  # both at once: they split the same cores, and their weather, between them
                with ThreadPoolExecutor(len(order)) as threads:
                    done = {s.name: figures for s, figures in zip(order, threads.map(one, order), strict=True)}
            else:
                done = {s.name: one(s) for s in order}
            for side in sides:
                side.steps.append(done[side.name])
            ratio = ratio_of(done["A"]["requests_per_s"], done["B"]["requests_per_s"])
            print(
                f"round {k + 1:>2}: A {_cells(done['A'])} | B {_cells(done['B'])} | B/A "
                + (f"{ratio:.4f}" if ratio is not None else "-"),
            )
    summary = summarise(sides)
    report(sides, summary)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        rounds = {s.name: {"describe": s.describe(), "rounds": s.steps} for s in sides}
        write_json(args.json, {"config": config, "sides": rounds, "cpus": os.cpu_count(), **summary})
    return 1 if any(summary["medians"][s.name]["errors"] for s in sides) else 0
