"""What every scenario stands on, written once: flags declared as a table, scratch repositories, the closed-loop step
and the rate search that measure capacity (the load tester's), the open loop, one sampler thread, one percentile
(0..1, nearest rank: the load tester's), one results header and verdict, and one JSON writer (NaN, a percentile of
nothing, written as null)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

from loadtest.inputs import Payload, payloads
from loadtest.openloop import Record, Request, run_open_loop
from loadtest.pool import WorkerPool
from loadtest.slo import SloSearch, search
from loadtest.step import StepBounds, StepResult, StepSpec, run_step
from service.bench.flags import Flag, add_flags, refused, settle, sized
from service.bench.runner import CpuClock
from service.core.arguments import integer_in, number_in
from service.core.config import toml_value
from service.core.percentile import percentile

__all__ = ["VERDICT", "CpuClock", "Flag", "Sampler", "add_flags", "closed_loop", "config_toml", "json_safe", "ms",
           "percentile", "refused", "settle", "sized"]  # fmt: skip

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
VERDICT = {True: "PASS", False: "MISS", None: "----"}
T = TypeVar("T")
# Flag types that refuse a bad value at the edge, in argparse's usage error (exit code 2).
COUNT = integer_in(1, 10**9)
POSITIVE = number_in(0, 1e12, above=True)
SHARE = number_in(0, 1, above=True)


def workspace(args: argparse.Namespace, error: str | None) -> Path | None:
    """``--work`` with its logs folder made, or None after printing ``error`` (a usage error: exit code 2)."""
    if error is not None:
        print(error, file=sys.stderr)
        return None
    (Path(args.work) / "logs").mkdir(parents=True, exist_ok=True)
    return Path(args.work)


def ms(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` in seconds, in milliseconds."""
    return 1000 * percentile(values, q)


def json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str | Path, results: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(json_safe(results), indent=1, default=str))
    print(f"wrote {path}")


def header(**fields: Any) -> dict[str, Any]:
    """A results record's first fields: when, the command line, then ``fields``."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv), **fields}


def conclude(results: dict[str, Any], began: float, out: str | Path | None, as_json: bool = False) -> int:
    """The verdict line (``results["passed"]``), the JSON at ``out`` and, ``as_json``, on stdout (the verdict then on
    stderr); the exit code (1: a target missed)."""
    results["wall_s"] = time.perf_counter() - began
    if results["passed"] is not None:
        met = "every target met" if results["passed"] else "a target missed"
        print(f"verdict: {met} ({results['wall_s']:.0f} s)", file=sys.stderr if as_json else sys.stdout)
    if out:
        write_json(out, results)
    if as_json:
        print(json.dumps(json_safe(results)))
    return 0 if results["passed"] is not False else 1


def config_toml(settings: Mapping[str, Any] | None = None, **tables: Mapping[str, Any] | None) -> str:
    """A config.toml of ``settings`` and ``[table]`` sections (one left out when None)."""
    lines = [f"{k} = {toml_value(v)}" for k, v in (settings or {}).items()]
    for name, table in tables.items():
        if table is not None:
            lines += [f"[{name}]", *(f"{k} = {toml_value(v)}" for k, v in table.items())]
    return "".join(line + "\n" for line in lines)


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same file, no more disk: a scenario builds dozens of repositories of one model
    except OSError:
        shutil.copy2(src, dst)  # another file system


def repository(root: Path, models: Mapping[str, tuple[Mapping[int, Path], str]]) -> Path:
    """A fresh repository at ``root``: each model's versions (number -> a version folder, hard-linked) and its
    config.toml text. Returns ``root``."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    for name, (versions, config) in models.items():
        for number, source in versions.items():
            shutil.copytree(source, root / name / str(number), copy_function=_link)
        (root / name / "config.toml").write_text(config)
    return root


def in_process(args: argparse.Namespace, images: Path, figures: str, batch_sizes: str) -> dict[str, Any]:
    """``visionserve bench``'s ``figures`` of ``--model`` in ``--repository`` for ``--bench-seconds`` each, on the
    images in ``images``, in a process of its own (a served scenario's limit: no HTTP); its JSON."""
    flags = ["--model", args.model, "--repository", args.repository, "--figures", figures, "--batch-sizes", batch_sizes]
    cmd = [sys.executable, "-m", "service.cli", "bench", *flags, "--seconds", str(args.bench_seconds)]
    done = subprocess.run([*cmd, "--images", str(images), "--json", "--no-progress"], capture_output=True, text=True)
    done.check_returncode()
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def bounds(url: str, warmup_s: float, duration_s: float, **more: Any) -> StepBounds:
    options: dict[str, Any] = {"drain_s": 10.0, "timeout_s": 30.0, "max_requests": 10**8} | more
    return StepBounds(url=url, warmup_s=warmup_s, duration_s=duration_s, **options)


def one_step(model: str, bodies: list[Payload], spec: StepSpec, where: StepBounds) -> StepResult:
    """One step of the load tester (one process) sending ``bodies`` to ``model``."""
    with WorkerPool(1, bodies) as pool:
        return run_step(pool, spec, where, model)


def closed_loop(model: str, images: Sequence[bytes], clients: int, where: StepBounds) -> StepResult:
    """One closed-loop step of the load tester (one process): ``clients`` clients sending ``images`` to ``model``."""
    return one_step(model, payloads(model, list(images)), StepSpec("closed", concurrency=clients), where)


def step_line(result: StepResult) -> str:
    limited = f", client-limited ({'; '.join(result.client_limited)})" if result.client_limited else ""
    p50, p99 = result.latency_ms(50), result.latency_ms(99)
    return f"p50 {p50:7.2f} ms, p99 {p99:7.2f} ms, errors {result.errors or 0}{limited}"


def step_figures(step: StepResult) -> dict[str, Any]:
    """A load tester's step as the reports write it: its rates, p50/p99, errors and whether the client limited it."""
    return {"requests_per_s": step.requests_per_s, "images_per_s": step.images_per_s, "p50_ms": step.latency_ms(50),
            "p99_ms": step.latency_ms(99), "errors": step.errors, "client_limited": step.client_limited}  # fmt: skip


def rate_search(model: str, bodies: list[Payload], p99_ms: float, where: StepBounds, **options: Any) -> SloSearch:
    """Capacity: the load tester's search for the highest open-loop rate with p99 within ``p99_ms`` and no error,
    each step printed."""
    with WorkerPool(1, bodies) as pool:

        def step(rate: float) -> StepResult:
            result = run_step(pool, StepSpec("open", rate=rate, arrival="constant"), where, model)
            print(f"  {rate:8.1f} req/s: served {result.requests_per_s:8.1f}/s, {step_line(result)}")
            return result

        return search(step, p99_ms, **options)


def open_loop(url: str, requests: Sequence[Request], rate: float, duration_s: float, **more: Any) -> list[Record]:
    """The load tester's open loop: ``requests`` in turn at a constant ``rate`` for ``duration_s``, every record."""
    return asyncio.run(run_open_loop(url, requests, rate=rate, duration_s=duration_s, **more))


def quantiles(values_s: Sequence[float], prefix: str = "") -> dict[str, float]:
    """``PREFIXp50_ms`` and ``PREFIXp99_ms`` of ``values_s`` (seconds)."""
    return {f"{prefix}p50_ms": ms(values_s, 0.5), f"{prefix}p99_ms": ms(values_s, 0.99)}


def ok_seconds(records: Sequence[Record]) -> list[float]:
    """The latencies of the requests answered 200."""
    return [r.latency_s for r in records if r.outcome == "200"]


def latency(records: Sequence[Record]) -> dict[str, Any]:
    """Counts, outcomes and p50/p99 (ms, from each scheduled send) of the requests answered 200."""
    ok, outcomes = ok_seconds(records), dict(Counter(r.outcome for r in records))
    return {"count": len(records), "ok": len(ok), "outcomes": outcomes, **quantiles(ok)}


def take_turns(sides: Sequence[str], rounds: int, measure: Callable[[str, int], tuple[dict[str, Any], list[float]]],
               key: str = "side") -> tuple[list[dict[str, Any]], dict[str, list[float]]]:  # fmt: skip
    """``rounds`` rounds of one ``measure(side, round)`` per side, the order reversing each round (AB, BA, ...) so
    that a steady drift of the machine's speed falls on both alike: each round's ``{key, "round", **figures}`` and
    every side's latencies (seconds) pooled."""
    windows: list[dict[str, Any]] = []
    pooled: dict[str, list[float]] = {side: [] for side in sides}
    for k in range(1, rounds + 1):
        for side in sides if k % 2 else sides[::-1]:
            figures, ok = measure(side, k)
            pooled[side] += ok
            windows.append({key: side, "round": k, **figures})
    return windows, pooled


class Sampler(threading.Thread, Generic[T]):
    """``read()`` every ``period_s`` on a thread of its own (the caller's thread sends the load), kept as
    ``(seconds since start, value)``; an exception of ``errors`` is counted by its class name, not raised."""

    def __init__(
        self, read: Callable[[], T], period_s: float, errors: tuple[type[Exception], ...] = (), at_once: bool = True
    ) -> None:
        super().__init__(name="sampler", daemon=True)
        self.read, self.period_s, self.errors, self.at_once = read, period_s, errors, at_once
        self.started_s = time.perf_counter()
        self.samples: list[tuple[float, T]] = []
        self.failures: Counter[str] = Counter()
        self.halt = threading.Event()

    def sample(self) -> None:
        try:
            self.samples.append((time.perf_counter() - self.started_s, self.read()))
        except self.errors as exc:
            self.failures[type(exc).__name__] += 1

    def run(self) -> None:
        if self.at_once:
            self.sample()
        while not self.halt.wait(self.period_s):
            self.sample()

    def latest(self, default: T) -> T:
        return self.samples[-1][1] if self.samples else default

    def finish(self, last: bool = True) -> list[tuple[float, T]]:
        """Stop; with ``last``, one more sample: the figure at the end of the load."""
        self.halt.set()
        self.join()
        if last:
            self.sample()
        return self.samples
